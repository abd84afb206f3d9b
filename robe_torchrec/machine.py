"""What a measurement records about where it ran: the machine and software stack
(:func:`machine`, :func:`machine_line`), a process's memory (:func:`process_memory_mib`) and
step-time percentiles (:func:`nearest_rank`). Torch alone, and nothing imported to read a
version: the GPU check runs on images without torchrec, and must not import it.

Example::

    >>> from robe_torchrec.machine import machine_line, nearest_rank
    >>> print(machine_line())            # "AMD EPYC ..., 2 CPUs (host), Python 3.11.7, torch ..."
    >>> nearest_rank([3.0, 1.0, 2.0], 50)
    2.0
"""

from __future__ import annotations

import math
import os
import platform
from importlib.metadata import PackageNotFoundError, version as installed_version
from typing import Any, Dict, Optional, Sequence

import torch

#: distributions that install a module under another name
_DISTRIBUTIONS = {"fbgemm_gpu": ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm_gpu")}


def _first_field(path: str, prefix: str) -> Optional[str]:
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)),
                        None)
    except OSError:
        return None


def version(module: str) -> str:
    """The installed version of ``module``'s distribution, read from its metadata (the module
    is not imported), or ``"not installed"``."""
    for name in _DISTRIBUTIONS.get(module, (module,)):
        try:
            return installed_version(name)
        except PackageNotFoundError:
            pass
    return "not installed"


def nearest_rank(values: Sequence[float], pct: float) -> float:
    """The nearest-rank percentile (as TorchRec's pipeline benchmark): the smallest value with
    at least ``pct``% of the values at or below it; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(pct / 100.0 * len(ordered))) - 1]


def process_memory_mib(field: str = "VmHWM") -> float:
    """This process's ``/proc/self/status`` memory field in MiB: ``VmHWM`` (peak resident
    set) or ``VmRSS`` (resident now); NaN where there is no such file."""
    value = _first_field("/proc/self/status", f"{field}:")
    return int(value.split()[0]) / 1024.0 if value else float("nan")


def machine() -> Dict[str, Any]:
    """The machine and software stack a measurement ran on."""
    mem_kib = _first_field("/proc/meminfo", "MemTotal")
    return {"host": platform.node(), "platform": platform.platform(),
            "cpu": (_first_field("/proc/cpuinfo", "model name") or platform.processor()
                    or platform.machine()),
            "logical_cpus": os.cpu_count(),
            "memory_gib": round(int(mem_kib.split()[0]) / 2**20, 1) if mem_kib else None,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "torchrec": version("torchrec"), "fbgemm_gpu": version("fbgemm_gpu")}


def machine_line(m: Optional[Dict[str, Any]] = None) -> str:
    """One line for a report: the GPU and CPU, core count, and the versions."""
    m = m or machine()
    return (f"{m['gpu'] + ' GPU, ' if m['gpu'] else ''}{m['cpu']}, {m['logical_cpus']} CPUs "
            f"({m['host']}), Python {m['python']}, torch {m['torch']}, torchrec {m['torchrec']}")


__all__ = ["machine", "machine_line", "nearest_rank", "process_memory_mib", "version"]
