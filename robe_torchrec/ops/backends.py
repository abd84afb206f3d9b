"""Which implementation of the ``robe`` ops runs on each device: the C++ kernel (or the
Triton or the pure-PyTorch one, under :func:`cpu_backend`) on CPU tensors, Triton on CUDA
tensors; and whether that implementation leaves its data checks' answer to a later call.

Example::

    >>> with cpu_backend("reference"):
    ...     out = torch.ops.robe.forward(weights, values, offsets, None, meta, 24, 4, 0, params, 0)
    >>> checks_deferred(torch.device("cuda"))   # True unless ROBE_DEFER_CHECKS=0
    True
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from types import ModuleType
from typing import Iterator

import torch

from robe_torchrec.ops.deferred_checks import deferred_for

BACKENDS = ("cpp", "triton", "reference")
_cpu_backend = os.environ.get("ROBE_CPU_BACKEND", "cpp")


@functools.lru_cache(maxsize=None)
def _module_for(backend: str) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"robe: unknown backend {backend!r}; expected one of {BACKENDS}")
    name = {"cpp": "cpu", "triton": "triton_kernels", "reference": "reference"}[backend]
    return importlib.import_module(f"robe_torchrec.ops.{name}")


@contextlib.contextmanager
def cpu_backend(backend: str) -> Iterator[None]:
    """Run the ``robe`` ops on CPU tensors with another implementation inside the block."""
    global _cpu_backend
    _module_for(backend)
    previous, _cpu_backend = _cpu_backend, backend
    try:
        yield
    finally:
        _cpu_backend = previous


def cpu_implementation() -> ModuleType:
    """The module whose functions the ops run on CPU tensors now."""
    return _module_for(_cpu_backend)


def cuda_implementation() -> ModuleType:
    """The module whose functions the ops run on CUDA tensors (Triton)."""
    return _module_for("triton")


def checks_deferred(device: torch.device) -> bool:
    """Whether an op on ``device`` leaves its data checks' answer to a later call: the
    Triton implementation (CUDA, or CPU under ``cpu_backend("triton")``) with deferred
    checks on (:mod:`robe_torchrec.ops.deferred_checks`)."""
    triton = device.type != "cpu" or _cpu_backend == "triton"
    return triton and deferred_for(device)
