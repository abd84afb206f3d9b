"""What every benchmark records with its numbers: the machine (:func:`machine`,
:func:`machine_line`), a process's memory (:func:`process_memory_mib`), step-time
percentiles (:func:`nearest_rank`), and its results side by side (:func:`write_report`: ``<stem>.json`` with every number, ``<stem>.md`` with the
table the README quotes).

Example::

    >>> result = {"machine": machine(), ...}
    >>> write_report("benchmarks/results", "distributed_step", result, text)
"""

from __future__ import annotations

import json
import math
import os
import platform
from typing import Any, Dict, Sequence

import torch


def _first_field(path: str, prefix: str) -> "str | None":
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)),
                        None)
    except OSError:
        return None


def _version(module: str) -> str:
    try:
        return getattr(__import__(module), "__version__", "?")
    except Exception:  # noqa: BLE001 - reported, not needed
        return "?"


def nearest_rank(values: Sequence[float], pct: float) -> float:
    """The nearest-rank percentile: the smallest value with at least ``pct``% of the values
    at or below it."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[rank - 1]


def process_memory_mib(field: str = "VmHWM") -> float:
    """This process's ``/proc/self/status`` memory field in MiB: ``VmHWM`` (peak resident
    set) or ``VmRSS`` (resident now); NaN where there is no such file."""
    value = _first_field("/proc/self/status", f"{field}:")
    return int(value.split()[0]) / 1024.0 if value else float("nan")


def machine() -> Dict[str, Any]:
    """The machine and software stack a benchmark ran on."""
    mem_kib = _first_field("/proc/meminfo", "MemTotal")
    return {"host": platform.node(), "platform": platform.platform(),
            "cpu": _first_field("/proc/cpuinfo", "model name") or platform.processor()
            or platform.machine(),
            "logical_cpus": os.cpu_count(),
            "memory_gib": round(int(mem_kib.split()[0]) / 2**20, 1) if mem_kib else None,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "torchrec": _version("torchrec"), "fbgemm_gpu": _version("fbgemm_gpu")}


def machine_line(m: "Dict[str, Any] | None" = None) -> str:
    """One line for a results file: CPU (or GPU), core count, and the versions."""
    m = m or machine()
    device = f"{m['gpu']} GPU, " if m["gpu"] else ""
    return (f"{device}{m['cpu']}, {m['logical_cpus']} CPUs ({m['host']}), Python {m['python']}, "
            f"torch {m['torch']}, torchrec {m['torchrec']}")


def write_report(out_dir: "str | os.PathLike", stem: str, result: Dict[str, Any],
                 markdown: str) -> None:
    """Write ``result`` as ``<out_dir>/<stem>.json`` and ``markdown`` as ``<stem>.md``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown)
