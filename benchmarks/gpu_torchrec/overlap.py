"""How much of FusedSparseDist's embedding lookup of batch i+1 runs on the GPU at the same
time as the dense optimizer step of batch i, from a ``torch.profiler`` Chrome trace.

A GPU activity (kernel, memcpy, memset) belongs to the pipeline range (``## optimizer i ##``,
``## start_embedding_lookup j ##``, from ``pipelines/fused_sparse_dist.py``) in which the CPU
launched it (same ``correlation`` id). For every step i that has both, the busy time (union
of intervals) of batch i+1's lookup is intersected with that of batch i's optimizer; the
fractions are the summed intersection over the summed lookup (or optimizer) busy time.
"""

from __future__ import annotations

import bisect
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

Interval = Tuple[float, float]

_GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_RANGE = re.compile(r"^## (optimizer|start_embedding_lookup) (\d+) ##$")


def union(intervals: Iterable[Interval]) -> List[Interval]:
    """The intervals merged into disjoint, sorted ones."""
    merged: List[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: List[Interval], b: List[Interval]) -> float:
    """Total length of the overlap of two disjoint sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _ranges(events: List[Dict[str, Any]]) -> Dict[Tuple[str, int], List[Interval]]:
    out: Dict[Tuple[str, int], List[Interval]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        m = _RANGE.match(str(e.get("name", "")))
        if m and e.get("cat") in ("user_annotation", "cpu_op", None):
            out.setdefault((m.group(1), int(m.group(2))), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    return out


def _owner(ts: float, starts: List[float], spans: List[Tuple[float, float, Tuple[str, int]]]
           ) -> Optional[Tuple[str, int]]:
    """The innermost named range containing a launch at ``ts``."""
    best = None
    for k in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
        start, end, key = spans[k]
        if start <= ts <= end and (best is None or start >= best[0]):
            best = (start, key)
        if ts - start > 60e6:  # a minute back: no pipeline range is that long
            break
    return best[1] if best else None


def lookup_optimizer_overlap(trace: Dict[str, Any]) -> Dict[str, Any]:
    """The overlap of batch i+1's lookup with batch i's optimizer step, summed over the
    steps the trace holds (see the module docstring). Times in microseconds."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    ranges = _ranges(events)
    spans = sorted((s, e, key) for key, ivs in ranges.items() for s, e in ivs)
    starts = [s for s, _, _ in spans]
    launches: Dict[Any, float] = {}
    for e in events:
        # Triton's kernels are launched through the driver API, ATen's through the runtime
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"])
    gpu: Dict[Tuple[str, int], List[Interval]] = {}
    streams: Dict[str, set] = {"optimizer": set(), "start_embedding_lookup": set()}
    for e in events:
        if e.get("cat") not in _GPU_CATEGORIES or e.get("ph") != "X":
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        key = _owner(launch, starts, spans) if launch is not None else None
        if key is None:
            continue
        gpu.setdefault(key, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        streams[key[0]].add(e.get("args", {}).get("stream"))
    steps = sorted(i for kind, i in gpu if kind == "optimizer"
                   and ("start_embedding_lookup", i + 1) in gpu)
    per_step = []
    for i in steps:
        opt, look = union(gpu[("optimizer", i)]), union(gpu[("start_embedding_lookup", i + 1)])
        per_step.append({"step": i, "optimizer_us": length(opt), "next_lookup_us": length(look),
                         "overlap_us": intersection(opt, look)})
    both, lookup_busy, opt_busy = (sum(s[k] for s in per_step)
                                   for k in ("overlap_us", "next_lookup_us", "optimizer_us"))
    return {"steps": len(steps), "overlap_us": both, "next_lookup_busy_us": lookup_busy,
            "optimizer_busy_us": opt_busy,
            "overlap_of_lookup": both / lookup_busy if lookup_busy else None,
            "overlap_of_optimizer": both / opt_busy if opt_busy else None,
            "optimizer_streams": sorted(str(s) for s in streams["optimizer"]),
            "lookup_streams": sorted(str(s) for s in streams["start_embedding_lookup"]),
            "per_step": per_step, "ranges_found": len(spans)}
