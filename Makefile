# Set-up and entry points. `make demo` and `make test` are the README's Quick start.
#
# The CPU stack is pinned (torch 2.13.0 CPU, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0). torchrec is
# installed with --no-deps because its metadata asks for the CUDA-only `fbgemm-gpu` package;
# the torch pin in the `cpu` extra keeps pip from ever pulling a CUDA torch on this path.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.robe-installed

.PHONY: setup demo test test-fast bench compare quality clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test]"
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	$(PY) -c "import torch, fbgemm_gpu, torchrec; assert not torch.version.cuda, 'a CUDA torch was installed on the CPU path'"
	touch $(STAMP)

demo: setup
	$(PY) -m robe_torchrec.train

# two workers for the machine's two cores; tests/conftest.py groups them by file
test: setup
	$(PY) -m pytest tests -q -n 2 --dist loadgroup --durations=25

test-fast: setup
	$(PY) -m pytest tests -q -n 2 --dist loadgroup -m "not slow"

bench: setup
	$(PY) -m benchmarks.cpu_ops --out benchmarks/results/cpu_ops.md

compare: setup
	$(PY) -m pipelines.compare

quality: setup
	$(PY) -m benchmarks.quality_study --out benchmarks/results

clean:
	rm -rf $(VENV) .pytest_cache
