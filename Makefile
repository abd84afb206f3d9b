# Set-up and entry points. `make demo` and `make test` are the README's Quick start.
#
# The CPU stack is pinned (torch 2.13.0 CPU, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0). torchrec is
# installed with --no-deps because its metadata asks for the CUDA-only `fbgemm-gpu` package;
# the torch pin in the `cpu` extra keeps pip from ever pulling a CUDA torch on this path.
#
# The oldest supported torchrec gets an environment of its own, `.venv-tr16`: the same stack
# with torchrec 1.6.1 instead (1.6.1 asks for the same packages as 1.8.0, and runs on the same
# torch and fbgemm-gpu-cpu). `make test` runs the distributed and pipeline tests in it too,
# since those are the tests that touch the torchrec APIs that changed between the releases.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.robe-installed
TR16_VENV ?= .venv-tr16
TR16_PY := $(TR16_VENV)/bin/python
TR16_STAMP := $(TR16_VENV)/.robe-installed
# the tests that depend on which torchrec release is installed
TR16_TESTS := tests/distributed tests/pipelines tests/test_torchrec_compat.py

.PHONY: setup setup-tr16 demo test test-main test-slow test-tr16 test-gpu-triton bench \
	instructions compare quality clean

setup: $(STAMP)

setup-tr16: $(TR16_STAMP)

# make_venv DIR, TORCHREC_PIN: a virtual environment with this package, its CPU stack and
# that torchrec release (installed --no-deps, see above), checked, then stamped
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -e ".[cpu,test]"
	$(1)/bin/python -m pip install -q --no-deps $(2)
	$(1)/bin/python -c "import torch, fbgemm_gpu, torchrec; assert not torch.version.cuda, 'a CUDA torch was installed on the CPU path'"
	$(1)/bin/python -c "import importlib.metadata as m; v = m.version('torchrec'); assert '$(2)' == 'torchrec==' + v, v"
	touch $(1)/.robe-installed
endef

$(STAMP): pyproject.toml Makefile
	$(call make_venv,$(VENV),torchrec==1.8.0)

$(TR16_STAMP): pyproject.toml Makefile
	$(call make_venv,$(TR16_VENV),torchrec==1.6.1)

demo: setup
	$(PY) -m robe_torchrec.train

# the main suite, then the slow tests (multi-process runs, subprocess apps, benchmarks' CPU
# modes), both on the pinned stack, then the torchrec-dependent tests on torchrec 1.6.1, then
# the kernels compiled by the GPU image's Triton
test: test-main test-slow test-tr16 test-gpu-triton

# two workers for the machine's two cores; tests/conftest.py groups them by file
test-main: setup
	$(PY) -m pytest tests -q -n 2 --dist loadgroup -m "not slow" --durations=15

test-slow: setup
	$(PY) -m pytest tests -q -n 2 --dist loadgroup -m slow --durations=15

test-tr16: setup-tr16
	$(TR16_PY) -m pytest $(TR16_TESTS) -q -n 2 --dist loadgroup --durations=10

# The GPU machine's image (benchmarks/gpu_session.sh) has an older Triton than the pinned
# stack. Its interpreter cannot run the kernels, but its compiler can: every kernel variant
# the launchers produce must compile for sm_90 with it, and the cached launches must follow
# its launcher convention (tests/ops/sm90_launches.py, tests/ops/cached_launches.py), so that
# the rare GPU session does not fail on a version difference. Installed beside the venv,
# first on PYTHONPATH.
GPU_TRITON := 3.6.0
GPU_TRITON_DIR := .triton-$(GPU_TRITON)
GPU_TRITON_ENV = PYTHONPATH=$(GPU_TRITON_DIR):. TRITON_CACHE_DIR=$(GPU_TRITON_DIR)/cache

$(GPU_TRITON_DIR)/.installed: $(STAMP) Makefile
	rm -rf $(GPU_TRITON_DIR)
	$(PY) -m pip install -q --no-deps --no-compile --target $(GPU_TRITON_DIR) triton==$(GPU_TRITON)
	touch $@

test-gpu-triton: $(GPU_TRITON_DIR)/.installed
	$(GPU_TRITON_ENV) $(PY) -c "import triton; assert triton.__version__ == '$(GPU_TRITON)', triton.__version__"
	rm -rf $(GPU_TRITON_DIR)/cache
	$(GPU_TRITON_ENV) $(PY) -m tests.ops.sm90_launches > $(GPU_TRITON_DIR)/sm90_launches.log \
		|| { tail -30 $(GPU_TRITON_DIR)/sm90_launches.log; exit 1; }
	tail -1 $(GPU_TRITON_DIR)/sm90_launches.log
	$(GPU_TRITON_ENV) $(PY) -m tests.ops.cached_launches > $(GPU_TRITON_DIR)/cached_launches.log \
		|| { tail -30 $(GPU_TRITON_DIR)/cached_launches.log; exit 1; }
	tail -1 $(GPU_TRITON_DIR)/cached_launches.log

bench: setup
	$(PY) -m benchmarks.cpu_ops --out benchmarks/results/cpu_ops.md

# SASS instructions a bag of the bag kernels, compiled for sm_90 by the GPU image's Triton
# (the one the GPU runs: another Triton compiles the same kernels to other counts)
instructions: $(GPU_TRITON_DIR)/.installed
	$(GPU_TRITON_ENV) $(PY) -m benchmarks.kernel_instructions --out benchmarks/results

compare: setup
	$(PY) -m robe_torchrec.pipelines.compare

quality: setup
	$(PY) -m benchmarks.quality_study --out benchmarks/results

clean:
	rm -rf $(VENV) $(TR16_VENV) $(GPU_TRITON_DIR) .pytest_cache
