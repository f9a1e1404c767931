# Every target creates its own virtual environment on first use (pip only; torch pinned to the CPU wheel
# when no torch is present, so no CUDA packages are pulled on a CPU machine).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test bench bench-full microbench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# The test suite. Without CUDA, Triton kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py); on a CUDA
# machine tests/test_gpu.py runs the paged path on the GPU too.
# Microbenchmarks run once each as smoke tests here (--benchmark-disable). ruff checks lint and formatting first.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --benchmark-disable

# The benchmark draws its plot with matplotlib (the `plot` extra; also in `dev`, installed explicitly here so the
# bench targets do not depend on what `dev` lists).
$(VENV)/.plot-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[plot]'
	touch $@

# The main job: the benchmark on the embedded default model; writes SERVING_LOG.md and serving_plot_burst.png.
bench: setup $(VENV)/.plot-installed
	$(PY) -m bench --quick

bench-full: setup $(VENV)/.plot-installed
	$(PY) -m bench --full

# Hot-path microbenchmarks for real (allocator, cache update, decode attention reference).
microbench: setup
	$(PY) -m pytest -q tests/test_bench_hotpaths.py tests/test_bench_kernels.py --benchmark-only --benchmark-sort=name --benchmark-columns=min,median,mean,rounds
