#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the GPU proof run needs beyond the GPU image's own
# torch 2.11 (CUDA 13), Triton 3.6, numpy and pytest: torchrec 1.6.1 (the torchrec line of
# torch 2.11), fbgemm-gpu-cpu 1.6.0 (its CUDA ops come from fbgemm_cuda_shim.py), and the
# pure-Python or cp312 wheels that torchrec, the pipelines and the Hydra app import.
#
# Run from the repository root:   bash benchmarks/gpu_torchrec/wheels.sh
# The device tool carries the folder when the run names it: carry=[".whl"]. There, nothing is
# built: `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` (see run.py).
#
# Every package is pinned to one version, so a rerun gives the same set (about 9 MB).
set -euo pipefail

DEST="${1:-.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
# only the versions listed below: a wheel left from an older list would be a second version
# of a package, which makes the GPU machine's one pip install fail
rm -f "$DEST"/*.whl

# Requires-Dist of each, checked by hand: torchrec -> fbgemm-gpu, tensordict, torchmetrics,
# tqdm, pyre-extensions, iopath; tensordict -> cloudpickle, importlib_metadata, orjson, pyvers
# (and numpy, packaging, torch: in the image); torchmetrics -> lightning-utilities;
# pyre-extensions -> typing-inspect -> mypy-extensions; iopath -> portalocker;
# importlib_metadata -> zipp; hydra-core -> omegaconf -> PyYAML, antlr4 4.9.3;
# packaging (lightning-utilities, hydra) is in the image through pytest, carried to be sure.
PACKAGES=(  # one dependency chain a line, as the comment above lists them
  torchrec==1.6.1 fbgemm-gpu-cpu==1.6.0
  tensordict==0.11.0 "pyvers<0.3" orjson==3.11.5 cloudpickle==3.1.2
  importlib_metadata==8.7.0 zipp==3.23.0
  torchmetrics==1.0.3 lightning-utilities==0.15.2 tqdm==4.67.1
  pyre-extensions==0.0.32 typing-inspect==0.9.0 mypy-extensions==1.1.0
  iopath==0.1.9 portalocker==3.2.0
  hydra-core==1.3.2 omegaconf==2.3.0 PyYAML==6.0.3 packaging==25.0
)

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DEST" "${PACKAGES[@]}"

# antlr4-python3-runtime 4.9.3 (the version omegaconf 2.3 pins) exists only as an sdist; it is
# pure Python, so the wheel built here installs on any Python 3 (nothing to build there).
if ! ls "$DEST"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" antlr4-python3-runtime==4.9.3
fi

du -sh "$DEST"
ls "$DEST"
