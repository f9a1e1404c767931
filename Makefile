# Every target creates its own virtual environment on first use (pip only; torch pinned to the CPU wheel
# when no torch is present, so no CUDA packages are pulled on a CPU machine).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test bench bench-full microbench bench-gpu test-gpu-versions kernel-resources bench-serve bench-serve-quick serve-soak soak zoo

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
# pytest-xdist runs one worker per core (at most 4), each test module whole in one worker (--dist loadfile), so a
# module-scoped fixture (the zoo's run, the kernels' compile, a server) is made once.
PYTEST_WORKERS := -n auto --maxprocesses 4 --dist loadfile
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --benchmark-disable $(PYTEST_WORKERS)

# The benchmark draws its plot with matplotlib (the `plot` extra; also in `dev`, installed explicitly here so the
# bench targets do not depend on what `dev` lists).
$(VENV)/.plot-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[plot]'
	touch $@

# The main job: a quick run of the benchmark on the embedded default model (a few minutes on 2 CPU cores); writes
# its report and plot to bench/results/quick/ (git-ignored), never over the committed full-run report.
bench: setup $(VENV)/.plot-installed
	$(PY) -m bench --quick --out bench/results/quick

# The full run: the committed SERVING_LOG.md and serving_plot_burst.png at the top of the repository.
bench-full: setup $(VENV)/.plot-installed
	$(PY) -m bench --full --out .

# Hot-path microbenchmarks for real (allocator, cache update, decode attention reference, an echoed prompt's logprobs).
microbench: setup
	$(PY) -m pytest -q tests/test_bench_hotpaths.py tests/test_bench_kernels.py --benchmark-only --benchmark-sort=name --benchmark-columns=min,median,mean,rounds

# Everything that needs a CUDA GPU: tests/test_gpu.py and the kernel tests on CUDA tensors, bench/decode_attention.py
# (fraction of HBM peak), bench/generate_speed.py (generate() per cache, compiled ones included), bench/engine_speed.py
# (the Engine eager, with CUDA graphs and with asynchronous scheduling beside transformers' batching) and the
# serving harness in float32 and bfloat16, into bench/results/gpu/REPORT.md. Exits 1 if a step failed; without CUDA it runs nothing, says so, and
# exits 2. GPU_REPORT_ARGS="--skip serving decode" leaves steps out.
bench-gpu: setup $(VENV)/.plot-installed
	$(PY) -m bench.gpu_report $(GPU_REPORT_ARGS)

# The suite on CPU with the torch and Triton of the GPU machine bench-gpu runs on (torch 2.11.0+cu130, triton 3.6.0,
# Python 3.12), in an environment of its own: an API those versions lack shows here, before a GPU run. pip's torch
# 2.11.0 is the CUDA build (its CUDA packages are several GB; CUDA stays unused). numpy below 2.4: Triton 3.6's
# interpreter turns one-element arrays into scalars, which numpy 2.4 refuses. One pip command, so the project's
# dependencies are resolved with these pins.
GPU_VERSIONS_VENV ?= .venv-gpu-versions
$(GPU_VERSIONS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(GPU_VERSIONS_VENV)
	$(GPU_VERSIONS_VENV)/bin/pip install --quiet torch==2.11.0 triton==3.6.0 "numpy<2.4" -e '.[dev]'
	touch $@

test-gpu-versions: $(GPU_VERSIONS_VENV)/.installed
	$(GPU_VERSIONS_VENV)/bin/python -m pytest -q --benchmark-disable -p no:cacheprovider $(PYTEST_WORKERS)

# Regenerates docs/kernels.md: registers, spills, shared memory and occupancy of every Triton kernel variant on
# sm_80 and sm_90 (compiled here, no GPU needed).
kernel-resources: setup
	$(PY) -m bench.kernel_resources

# The HTTP benchmark: transformers serve, transformers serve --continuous-batching and hf-paged serve, one after
# another at the same KV budget, driven by aiperf. aiperf gets its own venv: it would change packages in $(VENV).
AIPERF_VENV ?= .venv-aiperf
$(AIPERF_VENV)/.installed:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet aiperf
	touch $@

bench-serve: setup $(AIPERF_VENV)/.installed
	$(PY) -m bench.serve --aiperf $(AIPERF_VENV)/bin/aiperf

bench-serve-quick: setup $(AIPERF_VENV)/.installed
	$(PY) -m bench.serve --quick --aiperf $(AIPERF_VENV)/bin/aiperf

# A long-running hf-paged serve: waves of mixed requests (streams, disconnects, refusals), its memory after each.
serve-soak: setup
	$(PY) -m bench.serve_soak

# The Engine's serving-loop soak (tests/test_engine_soak.py): tiny requests with aborts, bad requests, injected
# forward failures, shared prompts and preemption; prints its numbers. SOAK_REQUESTS=N for another size.
SOAK_REQUESTS ?= 100000
soak: setup
	HF_PAGED_SOAK_REQUESTS=$(SOAK_REQUESTS) $(PY) -m pytest -q -s --benchmark-disable tests/test_engine_soak.py

# Every causal LM in transformers through PagedCache, beams and enable(); rewrites the matrix in docs/models.md and
# tests/zoo_expected.json (review the diff).
zoo: setup
	$(PY) -m tests.zoo --write
