"""What every benchmark shares, so that every report is made the same way: rows timed side by
side (:func:`interleaved`, :class:`DeviceTimer`), and a report that names its command,
machine and load, written as markdown for people and JSON for tests and scripts
(:func:`header`, :func:`publish`).

Timing rows side by side matters on a shared machine: load from other jobs then hits every
row alike, and a ratio of two rows of one run means more than either number alone.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, TypeVar

import torch

from robe_torchrec.machine import machine, machine_line

K = TypeVar("K", bound=Hashable)
Samples = Dict[str, List[float]]


def interleaved(fns: Mapping[K, Callable[[int], object]], iters: int, warmup: int = 0,
                before: Optional[Callable[[K], None]] = None) -> Dict[K, Samples]:
    """Seconds per call of each of ``fns`` (called with the iteration number), all of them
    in every iteration, the order reversed on odd iterations, so that load from other
    processes hits every row alike. Per key: ``wall`` and ``cpu`` (the calling thread's CPU
    time: not inflated by time spent descheduled), plus the parts of a :class:`Timings` a
    call returns (its own split, in seconds). ``before(key)`` runs untimed before each call."""
    samples: Dict[K, Samples] = {key: {} for key in fns}
    keys = list(fns)
    for it in range(warmup + iters):
        for key in keys if it % 2 == 0 else keys[::-1]:
            if before is not None:
                before(key)
            c0, t0 = time.thread_time(), time.perf_counter()
            out = fns[key](it)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if it >= warmup:
                parts = {"wall": wall, "cpu": cpu, **(out if isinstance(out, Timings) else {})}
                for name, seconds in parts.items():
                    samples[key].setdefault(name, []).append(seconds)
            del out
    return samples


class Timings(Dict[str, float]):
    """Seconds per part of one call, which the call returns for :func:`interleaved` to keep
    (any other return value is the call's own business)."""


class Split:
    """The parts of one call, timed inside it: :meth:`lap` after each part, then
    :meth:`done` gives seconds per part, ``total`` and ``cpu total`` (the calling thread's
    CPU time) since the split began. A call returns that dict to :func:`interleaved`."""

    def __init__(self) -> None:
        self.parts: Dict[str, float] = {}
        self.c0 = time.thread_time()
        self.t0 = self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name], self.last = now - self.last, now

    def done(self, **more: float) -> Timings:
        return Timings(self.parts, total=self.last - self.t0,
                       **{"cpu total": time.thread_time() - self.c0}, **more)


def medians_ms(samples: Mapping[K, Samples]) -> Dict[K, Dict[str, float]]:
    return {key: {name: statistics.median(v) * 1e3 for name, v in s.items()}
            for key, s in samples.items()}


class DeviceTimer:
    """Milliseconds per call of ``fn`` over ``inner`` back-to-back calls: the device's time
    from CUDA events on a GPU (queued calls overlap with the host), ``perf_counter`` on CPU.
    ``host_ms`` is then the host's time per call to issue them (on a GPU close to the
    device's time when the host is what limits the calls)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host_ms = float("nan")

    def __call__(self, fn: Callable[[], object], inner: int) -> float:
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        self.host_ms = (time.perf_counter() - t0) * 1e3 / inner
        if not self.cuda:
            return self.host_ms
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner


def keep_freed_memory(limit_mib: int = 32) -> str:
    """Ask glibc's malloc to keep freed blocks of up to ``limit_mib`` MiB in the process; says
    what it did, for the report. A fresh 16 MiB output otherwise costs thousands of page
    faults or none depending on the allocator's history: that moved a 1-thread CPU forward
    floor between 1.6 and 6.2 ms from run to run. A training loop reaches the same steady
    state for blocks up to 32 MiB (glibc raises its limit up to there as blocks are freed);
    a larger block is returned to the system when freed and page-faulted in again at every
    allocation, unless the limit is set higher."""
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (libc.mallopt(m_mmap_threshold, limit_mib << 20) == 1
              and libc.mallopt(m_trim_threshold, max(1 << 30, 2 * (limit_mib << 20))) == 1)
    except (OSError, AttributeError):
        ok = False
    return (f"glibc malloc keeps freed blocks up to {limit_mib} MiB" if ok else
            "allocator left as is (not glibc): fresh outputs may page-fault, timings vary more")


def loadavg() -> float:
    """The 1-minute load average (NaN where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of benchmark ``name``, described by its docstring's first line."""
    return argparse.ArgumentParser(prog=f"python -m benchmarks.{name}",
                                   description=doc.split("\n")[0])


def command_line(name: str, argv: Optional[Sequence[str]]) -> str:
    """The command that ran benchmark ``name`` (``argv``: its arguments; None: this process's)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(shlex.quote(a) for a in ["python", "-m", f"benchmarks.{name}", *args])


def header(title: str, command: str, *lines: str) -> List[str]:
    """A report's first lines: its title, the command, the machine, the date and load, and
    ``lines`` as more bullet points."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return [f"# {title}", "", f"- command: `{command}`", f"- machine: {machine_line()}",
            f"- date: {now:%Y-%m-%d %H:%M} UTC; load average (1 min) {loadavg():.2f}",
            *(f"- {line}" for line in lines), ""]


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> List[str]:
    """A markdown table's lines."""
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def fmt(value: Optional[float], digits: int = 2) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def publish(out: Optional[str], stem: str, lines: Sequence[str],
            result: Optional[dict] = None, echo: bool = True) -> Optional[str]:
    """Print a report (unless ``echo`` is false: a partial one, written in case the run is
    cut short) and, when ``out`` is given, write it: ``out`` itself when it ends in ``.md``,
    else ``<out>/<stem>.md``; ``result`` (with the machine added) as the ``.json`` beside it.
    Returns the markdown file's path."""
    text = "\n".join(lines).rstrip("\n") + "\n"
    if echo:
        print(text, flush=True)
    if not out:
        return None
    folder, stem = (os.path.split(out[:-3])) if out.endswith(".md") else (out, stem)
    path = os.path.join(folder or ".", stem)
    os.makedirs(folder or ".", exist_ok=True)
    # each file whole or not at all: a run stopped at its time limit while rewriting a
    # partial report keeps the last one written
    _write_whole(f"{path}.md", text)
    if result is not None:
        _write_whole(f"{path}.json",
                     json.dumps({"machine": machine(), **result}, indent=1, default=str))
    return f"{path}.md"


def _write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a file beside it, renamed into place."""
    partial = f"{path}.writing"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)
