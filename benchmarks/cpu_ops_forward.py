"""Our forward alone against its floors, for both hashes, Z = 8 and 32 and both arrays: the
forward section of :mod:`benchmarks.cpu_ops`, its profile (hash / gather / store), the
backward against one read of its gradient, and the step floors."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from benchmarks.cpu_ops_common import (
    Batch, COMPUTE_REFERENCE, COMPUTE_REFERENCE_SIZE, FLOOR_SOURCE_ROWS, LINES_PER_BAG,
    LINE_FLOATS, LOSS_TEXT, Sizes, _div, floor_forward, fmt, markdown_table, read_lines)
from benchmarks.cpu_ops_step import (
    Result, Robe, Targets, _cpp_aids, floor_index, floor_of, ratio_text)
from robe_torchrec.hashing import HashMode
from robe_torchrec.ops import cpu_backend

# ---------------------------------------------------------------------------------------
# against the floors
# ---------------------------------------------------------------------------------------

FWD_FLOOR_RATIO = 1.5  # our 1-thread forward / the 1-thread forward floor
FWD_TWO_THREADS = 0.6  # our 2-thread forward / our 1-thread forward
STEP_FLOOR_RATIO = 1.5  # our step / the step floor, loss sum(outputs)


@dataclass(frozen=True)
class ForwardCase:
    hash_mode: HashMode
    memory: int
    block_size: int

    @property
    def name(self) -> str:
        return f"{self.hash_mode.name.lower()} hash, M={self.memory:,} Z={self.block_size}"


def forward_cases(sizes: Sizes) -> List[ForwardCase]:
    zs = sorted({sizes.small_block_size, sizes.block_size})
    return [ForwardCase(h, memory, z) for h in (HashMode.REFERENCE, HashMode.MIX)
            for memory in sizes.robe_sizes for z in zs]


# profile entries of time_forwards timed at 1 thread only (the backward profile is read at 1
# thread; the step floors read hash, lines and read at every thread count)
ONE_THREAD_ONLY = ("backward ",)


def time_forwards(sizes: Sizes, threads: Sequence[int], batches: Sequence[Batch], warmup: int,
                  iters: int, backend: str) -> Dict[Tuple[int, str], float]:
    """Median ms of the forward floor (``"floor"``) and of our forward in every
    :func:`forward_cases` case, per thread count, with the profile of each case (C++ kernel):
    ``hash`` (forward_hash_only), ``gather`` (forward_gather_only: all but the output
    stores), ``lines`` (:func:`read_lines` of the lines its gathers touch), ``backward`` (the
    dense-gradient op for a fixed output gradient) and ``read`` (one read of that gradient);
    with more than one thread count, :data:`COMPUTE_REFERENCE` (the machine's own scaling).
    Each iteration runs all of them at every thread count back to back (in alternating
    order), so load hits them alike; :data:`ONE_THREAD_ONLY` entries run at 1 thread only."""
    source = torch.randn(FLOOR_SOURCE_ROWS, sizes.dim)
    grad = torch.randn(2 * sizes.batch, sizes.dim)
    fns: Dict[str, Callable[[Batch], object]] = {
        "floor": lambda batch: floor_forward(source, 2 * sizes.batch)}
    if len(threads) > 1:
        a, b = (torch.randn(COMPUTE_REFERENCE_SIZE, COMPUTE_REFERENCE_SIZE) for _ in range(2))
        fns[COMPUTE_REFERENCE] = lambda batch: torch.mm(a, b)
    with cpu_backend(backend):
        for case in forward_cases(sizes):
            runner = Robe(sizes, "sgd", case.memory, case.block_size, "dense", case.hash_mode, "")
            fns[case.name] = lambda batch, runner=runner: runner.lookup(batch.values, batch.offsets)
            if backend == "cpp" and _cpp_aids():  # the kernel's parts, timed apart
                fns[f"hash {case.name}"] = lambda batch, runner=runner: runner._hash_only(batch)
                fns[f"gather {case.name}"] = lambda batch, runner=runner: runner.gather_only(batch)
                # two batches' lines, in turn: a real set of lines, without holding them all
                line_sets = itertools.cycle([runner.touched_lines(b) for b in batches[:2]])
                fns[f"lines {case.name}"] = (lambda batch, runner=runner, sets=line_sets:
                                             read_lines(next(sets), runner.weights))
                fns[f"backward {case.name}"] = (lambda batch, runner=runner:
                                                runner.backward_dense(batch, grad))
        if any(name.startswith("backward ") for name in fns):
            fns["read"] = lambda batch: float(grad.sum())
        samples: Dict[Tuple[int, str], List[float]] = {}
        with torch.no_grad():
            for it in range(warmup + iters):
                batch = batches[it % len(batches)]
                for k in threads:
                    torch.set_num_threads(k)
                    order = [(name, fn) for name, fn in fns.items()
                             if k == 1 or not name.startswith(ONE_THREAD_ONLY)]
                    for name, fn in order if it % 2 == 0 else reversed(order):
                        c0, t0 = time.thread_time(), time.perf_counter()
                        out = fn(batch)
                        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
                        del out
                        if it >= warmup:
                            samples.setdefault((k, name), []).append(elapsed)
                            samples.setdefault((k, f"cpu {name}"), []).append(cpu)
    return {key: statistics.median(v) * 1e3 for key, v in samples.items()}


def forward_floor_section(fwd: Dict[Tuple[int, str], float], threads: Sequence[int],
                          sizes: Sizes) -> str:
    header = ["case"] + [f"{c} ({k}t)" for k in threads for c in ("ms", "/ floor")]
    if 1 in threads and len(threads) > 1:
        header += [f"{k}t / 1t" for k in threads if k != 1]
    if 1 in threads:
        header += ["CPU ms (1t)", "CPU / floor (1t)", "hashing CPU ms (1t)", "hashing / floor (1t)"]
    cpu_floor = fwd.get((1, "cpu floor"))
    rows = [["forward floor"] + [x for k in threads for x in (fmt(fwd.get((k, "floor"))), "1.00x")]
            + ["" for k in threads if k != 1 and 1 in threads and len(threads) > 1]
            + ([fmt(cpu_floor), "1.00x", "", ""] if 1 in threads else [])]
    for case in forward_cases(sizes):
        row = [case.name]
        for k in threads:
            ms = fwd.get((k, case.name))
            row += [fmt(ms), ratio_text(_div(ms, fwd.get((k, "floor"))))]
        if 1 in threads and len(threads) > 1:
            row += [ratio_text(_div(fwd.get((k, case.name)), fwd.get((1, case.name))))
                    for k in threads if k != 1]
        if 1 in threads:
            cpu = fwd.get((1, f"cpu {case.name}"))
            hashing = fwd.get((1, f"cpu hash {case.name}"))
            row += [fmt(cpu), ratio_text(_div(cpu, cpu_floor)), fmt(hashing),
                    ratio_text(_div(hashing, cpu_floor))]
        rows.append(row)
    if (1, COMPUTE_REFERENCE) in fwd:
        n = COMPUTE_REFERENCE_SIZE
        rows.append([f"{COMPUTE_REFERENCE} ({n}x{n} matmul)"]
                    + [x for k in threads for x in (fmt(fwd.get((k, COMPUTE_REFERENCE))), "")]
                    + [ratio_text(_div(fwd.get((k, COMPUTE_REFERENCE)),
                                       fwd.get((1, COMPUTE_REFERENCE))))
                       for k in threads if k != 1]
                    + ["", "", "", ""])
    return markdown_table(header, rows)


def machine_scaling_summary(fwd: Dict[Tuple[int, str], float], threads: Sequence[int],
                            sizes: Sizes) -> str:
    """The forwards' k-thread / 1-thread ratios beside the compute reference's, for each
    k > 1: how much of the 2-thread target this machine leaves reachable."""
    lines = []
    for k in threads:
        reference = _div(fwd.get((k, COMPUTE_REFERENCE)), fwd.get((1, COMPUTE_REFERENCE)))
        if k == 1 or reference is None:
            continue
        ratios = [r for r in (_div(fwd.get((k, case.name)), fwd.get((1, case.name)))
                              for case in forward_cases(sizes)) if r is not None]
        if not ratios:
            continue
        as_good = sum(r <= reference for r in ratios)
        ideal = 1 / k
        lines.append(
            f"- {k} threads: the compute reference (a {COMPUTE_REFERENCE_SIZE}x"
            f"{COMPUTE_REFERENCE_SIZE} matmul, timed in the same loop) takes "
            f"{reference:.2f}x its 1-thread time, where {k} free cores give {ideal:.2f}x; "
            f"our forwards take {min(ratios):.2f}x to {max(ratios):.2f}x their 1-thread "
            f"time, {as_good} of {len(ratios)} at or below the reference's ratio. "
            + (f"The {FWD_TWO_THREADS}x target asks more of this machine than it gave "
               "compute-bound work in this run."
               if k == 2 and reference > FWD_TWO_THREADS else
               f"The reference is at or below the {FWD_TWO_THREADS}x target in this run."
               if k == 2 else ""))
        if k == 2 and (stores := store_scaling(fwd, k, sizes)):
            lines.append(stores)
    return "\n".join(lines)


def store_scaling(fwd: Dict[Tuple[int, str], float], k: int, sizes: Sizes) -> str:
    """The forward floor's own k-thread / 1-thread ratio (the output's writes alone), and
    for each case the ratio its forward would reach if the share of its time the store floor
    takes at 1 thread scaled as the floor does and all the rest perfectly (1/k)."""
    floor_1, floor_k = fwd.get((1, "floor")), fwd.get((k, "floor"))
    if floor_1 is None or floor_k is None:
        return ""
    modeled, measured = {}, {}
    for case in forward_cases(sizes):
        one, many = fwd.get((1, case.name)), fwd.get((k, case.name))
        if one is None or many is None or one < floor_1:
            continue
        modeled[case.name] = (floor_k + (one - floor_1) / k) / one
        measured[case.name] = many / one
    if not modeled:
        return ""
    missed = [name for name in modeled if measured[name] > FWD_TWO_THREADS]
    beyond = [name for name in missed if modeled[name] > FWD_TWO_THREADS]
    return (f"- {k} threads, the output's writes: the forward floor takes {floor_k / floor_1:.2f}x "
            f"its 1-thread time. A forward whose store-floor share scaled as the floor does and "
            f"whose other work scaled perfectly would take {min(modeled.values()):.2f}x to "
            f"{max(modeled.values()):.2f}x its 1-thread time (1 thread's share: the store floor "
            f"over the forward); the {FWD_TWO_THREADS}x target lies below that in "
            f"{sum(v > FWD_TWO_THREADS for v in modeled.values())} of {len(modeled)} cases; of "
            f"the {len(missed)} cases that missed the target, {len(beyond)} "
            f"{'lies' if len(beyond) == 1 else 'lie'} there"
            + (f" ({'; '.join(beyond)})" if beyond else "") + ".")


@dataclass(frozen=True)
class ForwardProfile:
    """One case's 1-thread CPU ms: the store floor, hash only, hash + gather, the forward,
    the line-read floor, and the work that must be done (hashes, lines touched)."""
    case: ForwardCase
    floor: float
    hash: float
    gather: float  # hash + gather + pool, no stores
    forward: float
    lines: float  # read_lines of the lines the gathers touch
    hashes: int  # (id, block) starts computed
    line_count: float  # lines the gathers touch (expected count)

    @property
    def parts(self) -> Tuple[float, float, float]:
        """hash, gather (gather only - hash only), store (forward - gather only), in ms."""
        return self.hash, self.gather - self.hash, self.forward - self.gather

    @property
    def serial_floor(self) -> float:
        """Store + hash + line reads, one after the other."""
        return self.floor + self.hash + self.lines

    @property
    def overlapped_floor(self) -> float:
        """The largest of the three: what perfect overlap of them would leave."""
        return max(self.floor, self.hash, self.lines)


def expected_lines(block_size: int) -> float:
    """Mean number of 64-byte lines a block of ``block_size`` floats at a uniformly random
    float offset spans: 1 + (4 Z - 4) / 64."""
    return 1 + (4 * block_size - 4) / (4 * LINE_FLOATS)


def forward_profiles(fwd: Dict[Tuple[int, str], float], sizes: Sizes,
                     threads: int = 1) -> List[ForwardProfile]:
    """The cases whose profile entries all ran (C++ kernel) at ``threads`` threads: CPU time
    at 1 thread, wall time at more (as the targets)."""
    clock = "cpu " if threads == 1 else ""
    out = []
    for case in forward_cases(sizes):
        keys = [f"{clock}{p}{case.name}" for p in ("", "hash ", "gather ", "lines ")]
        values = [fwd.get((threads, k)) for k in [f"{clock}floor"] + keys]
        if any(v is None for v in values):
            continue
        floor, forward, hashing, gather, lines = values
        hashes = 2 * sizes.batch * math.ceil(sizes.dim / case.block_size)
        out.append(ForwardProfile(case, floor, hashing, gather, forward, lines, hashes,
                                  hashes * expected_lines(case.block_size)))
    return out


def forward_profile_section(profiles: Sequence[ForwardProfile]) -> str:
    split_header = ["case", "forward", "store floor", "hash only", "hash + gather", "hash",
                    "gather", "store", "overlap"]
    split_rows = []
    for p in profiles:
        h, g, st = p.parts
        overlap = p.floor + p.gather - p.forward
        split_rows.append([p.case.name, fmt(p.forward), fmt(p.floor), fmt(p.hash), fmt(p.gather)]
                          + [f"{fmt(x)} ({x / p.forward:.0%})" for x in (h, g, st)]
                          + [fmt(overlap)])
    floor_header = ["case", "hashes", "ns / hash", "lines touched", "MiB", "line reads (ms)",
                    "ns / line", "store + hash + lines (ms)", "max of the three (ms)",
                    "forward / (store + hash + lines)", "forward / max", "forward / store floor"]
    floor_rows = []
    for p in profiles:
        floor_rows.append([
            p.case.name, f"{p.hashes:,}", f"{p.hash * 1e6 / p.hashes:.1f}", f"{p.line_count:,.0f}",
            f"{p.line_count * 64 / 2**20:.1f}", fmt(p.lines), f"{p.lines * 1e6 / p.line_count:.1f}",
            fmt(p.serial_floor), fmt(p.overlapped_floor),
            ratio_text(p.forward / p.serial_floor), ratio_text(p.forward / p.overlapped_floor),
            ratio_text(p.forward / p.floor)])
    return (markdown_table(split_header, split_rows) + "\n\n"
            + "The work this algorithm cannot skip, and its cost measured on its own in the same "
            "loop: one hash per (id, block) (`hash only`), every cache line the gathers touch "
            "(`line reads`: those lines read by torch's `embedding_bag`, FBGEMM's prefetching "
            f"kernel, {LINES_PER_BAG} lines pooled per output row), and the output's stores (the "
            "store floor). Their sum is the floor of a kernel that does them one after the "
            "other; their largest is the floor of one that overlaps them perfectly.\n\n"
            + markdown_table(floor_header, floor_rows))


def _span(values: Sequence[float], fmt_one: Callable[[float], str]) -> str:
    lo, hi = min(values), max(values)
    return fmt_one(lo) if fmt_one(lo) == fmt_one(hi) else f"{fmt_one(lo)} to {fmt_one(hi)}"


def stands_between_section(profiles: Sequence[ForwardProfile]) -> str:
    """What the profile says stands between the forward and its store floor (from the numbers)."""
    if not profiles:
        return "(no profile: needs the C++ kernel's profiling aids)"
    x = lambda v: f"{v:.2f}x"  # noqa: E731
    pct = lambda v: f"{v:.0%}"  # noqa: E731
    shares = [[part / p.forward for part in p.parts] for p in profiles]
    ns_line = {m: _span([p.lines * 1e6 / p.line_count for p in profiles if p.case.memory == m],
                        lambda v: f"{v:.1f}") for m in sorted({p.case.memory for p in profiles})}
    moved = {z: p.line_count * 4 * LINE_FLOATS / (p.hashes * z * 4)
             for p in profiles for z in [p.case.block_size]}
    below_serial = sum(p.serial_floor > FWD_FLOOR_RATIO * p.floor for p in profiles)
    below_max = sum(p.overlapped_floor > FWD_FLOOR_RATIO * p.floor for p in profiles)
    return "\n".join([
        f"- Of the forward's time, the gathers take {_span([s[1] for s in shares], pct)}, the "
        f"hashing {_span([s[0] for s in shares], pct)} and the output stores "
        f"{_span([s[2] for s in shares], pct)} (store = forward - (hash + gather); a large "
        "output is written with non-temporal stores while the next rows' loads are in flight, so "
        "its stores can cost less than the store floor's).",
        f"- Against the store floor: hashing alone takes {_span([p.hash / p.floor for p in profiles], x)}"
        f", reading the lines the gathers touch {_span([p.lines / p.floor for p in profiles], x)}; "
        f"store + hash + lines is {_span([p.serial_floor / p.floor for p in profiles], x)} the store "
        f"floor. The {FWD_FLOOR_RATIO:g}x target lies below that serial floor in {below_serial} of "
        f"{len(profiles)} cases, and below even the perfectly overlapped floor (the largest of the "
        f"three) in {below_max}.",
        "- A line read costs "
        + ", ".join(f"{v} ns at M={m:,}" for m, v in ns_line.items())
        + " floats; a block of Z floats at a random offset spans 1 + (4Z - 4)/64 lines, so the "
        "gathers move " + ", ".join(f"{v:.1f}x the bytes they use at Z = {z}"
                                    for z, v in sorted(moved.items())) + ".",
        f"- The forward takes {_span([p.forward / p.serial_floor for p in profiles], x)} the serial "
        f"floor and {_span([p.forward / p.overlapped_floor for p in profiles], x)} the overlapped one"
        + (": what is left to win is overlapping the hashing, the line reads and the stores, "
           "not doing less of them." if max(p.forward / p.serial_floor for p in profiles) <= 1.25
           else f"; beyond the serial floor it spends "
           f"{_span([p.forward - p.serial_floor for p in profiles], fmt)} ms on its own loops, "
           "tile buffers and misses the line-read floor does not pay."),
    ])


def backward_profile_section(fwd: Dict[Tuple[int, str], float], sizes: Sizes) -> str:
    header = ["case", "backward (dense gradient op)", "read once", "hash only", "backward / read",
              "hash share", "rest (ms)", "line reads (ms)", "rest / line reads"]
    read = fwd.get((1, "cpu read"))
    rows = []
    for case in forward_cases(sizes):
        bwd, hashing, lines = (fwd.get((1, f"cpu {part} {case.name}"))
                               for part in ("backward", "hash", "lines"))
        if bwd is None or hashing is None or read is None or lines is None:
            continue
        rest = bwd - hashing - read
        rows.append([case.name, fmt(bwd), fmt(read), fmt(hashing), ratio_text(bwd / read),
                     f"{hashing / bwd:.0%}", fmt(rest), fmt(lines), ratio_text(rest / lines)])
    if not rows:
        return "(no profile: needs the C++ kernel's profiling aids)"
    return markdown_table(header, rows)


def backward_read_section(results: Sequence[Result], sizes: Sizes) -> str:
    """Our backward against the floor's (same loss, optimizer, threads, array) and against
    one read of the gradient: own = ours - floor's backward + read."""
    floors = floor_index(results)
    header = ["row", "loss", "optimizer", "threads", "backward (ms)", "floor backward (ms)",
              "read once (ms)", "own backward (ms)", "own / read"]
    rows = []
    for r in results:
        if r.spec.model != "ours" or r.unavailable is not None or not r.phases:
            continue
        floor = floor_of(r, floors, sizes)
        if floor is None:
            continue
        read = floor.phases.get("read")
        own = r.phases["backward"] - floor.phases["backward"] + (read or 0.0)
        rows.append([f"ours {r.spec.gradient} M={r.spec.floats:,} Z={r.spec.block_size}",
                     LOSS_TEXT[r.spec.loss], r.spec.optimizer, str(r.threads),
                     fmt(r.phases["backward"]), fmt(floor.phases["backward"]), fmt(read), fmt(own),
                     ratio_text(_div(own, read))])
    return markdown_table(header, rows)


@dataclass(frozen=True)
class StepFloors:
    """One `ours` step (loss sum(outputs)) against the work its step floor leaves out: the
    hashing, the gathers' line reads and the scatter's (the same lines). In ms: CPU time at 1
    thread, wall time at more."""
    row: str
    optimizer: str
    threads: int
    step: float
    floor: float  # the step floor row's, same threads
    serial: float  # floor + hash + 2 x line reads, all at these threads
    overlapped: float  # the same work hidden as well as it can be (see step_floors)


def step_floors(profiles: Dict[int, Sequence[ForwardProfile]], fwd: Dict[Tuple[int, str], float],
                results: Sequence[Result], sizes: Sizes, hash_mode: HashMode) -> List[StepFloors]:
    """The step floor writes the output and reads its gradient once. ROBE-Z must also hash
    every (id, block) once, read the lines its gathers touch and read-modify-write the same
    lines in its scatter: one after the other, that is the serial floor. Overlapped
    perfectly, the forward costs the largest of its store floor, hashing and line reads, and
    the backward's scatter hides under its one read of the gradient (or the reverse). At k
    threads that extra work is timed at k threads (``profiles[k]``: hashing on k threads,
    line reads by torch's k-thread embedding_bag), in the same loop as the 1-thread work, so
    the floor holds whatever the k cores and their shared memory give, not an assumed
    perfect scaling."""
    by_case = {(k, p.case.hash_mode, p.case.memory, p.case.block_size): p
               for k, at_k in profiles.items() for p in at_k}
    floors = floor_index(results)
    out = []
    for r in results:
        if r.spec.model != "ours" or r.spec.loss != "sum" or not r.phases:
            continue
        k = r.threads
        p = by_case.get((k, hash_mode, r.spec.floats, r.spec.block_size))
        floor = floor_of(r, floors, sizes)
        read = fwd.get((1, "cpu read")) if k == 1 else fwd.get((k, "read"))
        if p is None or floor is None or read is None:
            continue
        phase = "cpu total" if k == 1 else "total"  # as the targets: CPU time at 1 thread
        base = floor.phases[phase]
        serial = base + p.hash + 2 * p.lines
        overlapped = base + (p.overlapped_floor - p.floor) + (max(read, p.lines) - read)
        out.append(StepFloors(f"ours {r.spec.gradient} M={r.spec.floats:,} Z={r.spec.block_size}",
                              r.spec.optimizer, k, r.phases[phase], base, serial, overlapped))
    return sorted(out, key=lambda s: s.threads)


def step_floors_section(rows: Sequence[StepFloors]) -> str:
    if not rows:
        return "(no profile: needs the C++ kernel's profiling aids and 1-thread rows)"
    header = ["row", "optimizer", "threads", "step (ms)", "step floor (ms)", "serial floor (ms)",
              "overlapped floor (ms)", "serial / step floor", "overlapped / step floor",
              "step / serial floor", "target reachable"]
    table = []
    for s in rows:
        goal = STEP_FLOOR_RATIO * s.floor
        reach = ("yes, one after the other" if goal >= s.serial else
                 "only with overlap" if goal >= s.overlapped else "no: below the overlapped floor")
        table.append([s.row, s.optimizer, str(s.threads), fmt(s.step), fmt(s.floor), fmt(s.serial),
                      fmt(s.overlapped),
                      ratio_text(s.serial / s.floor), ratio_text(s.overlapped / s.floor),
                      ratio_text(s.step / s.serial), reach])
    x = lambda v: f"{v:.2f}x"  # noqa: E731
    per_threads = []
    for k in sorted({s.threads for s in rows}):
        at_k = [s for s in rows if s.threads == k]
        beyond = sum(STEP_FLOOR_RATIO * s.floor < s.serial for s in at_k)
        out_of_reach = sum(STEP_FLOOR_RATIO * s.floor < s.overlapped for s in at_k)
        per_threads.append(
            f"at {k} thread{'s' if k > 1 else ''}, the target lies below the serial floor in "
            f"{beyond} of {len(at_k)} rows (below the overlapped floor in {out_of_reach}), and "
            f"our step takes {_span([s.step / s.serial for s in at_k], x)} its serial floor")
    under = [s for s in rows if s.step < s.overlapped]
    return (markdown_table(header, table) + "\n\n"
            + f"The {STEP_FLOOR_RATIO:g}x target: " + "; ".join(per_threads) + ". Below the "
            "serial floor, only overlapping the hashing, the line reads and the stores better "
            "than one after the other can meet it."
            + ("" if not under else
               f" {len(under)} rows ({', '.join(sorted({s.optimizer for s in under}))}) take "
               "less than their overlapped floor: their step floor runs `torch.optim` over "
               "the whole array, which costs more than the update those rows do (fused in "
               "the backward, or the same step on a smaller share of the time), so for them "
               "it is no lower bound."))


def floor_targets_section(fwd: Dict[Tuple[int, str], float], results: Sequence[Result],
                          threads: Sequence[int], sizes: Sizes) -> str:
    table = Targets()
    for case in forward_cases(sizes):
        if 1 in threads:  # CPU time: at 1 thread all the work, not inflated by descheduling
            table.add("forward / forward floor (CPU time)", case.name, 1, "-",
                      _div(fwd.get((1, f"cpu {case.name}")), fwd.get((1, "cpu floor"))),
                      FWD_FLOOR_RATIO, False)
        for k in threads:
            if k != 1 and 1 in threads:
                table.add("forward / our 1-thread forward", case.name, k, "-",
                          _div(fwd.get((k, case.name)), fwd.get((1, case.name))),
                          FWD_TWO_THREADS, False)
    floors = floor_index(results)
    for r in results:
        if r.spec.model != "ours" or r.spec.loss != "sum" or not r.phases:
            continue
        floor = floor_of(r, floors, sizes)
        # 1 thread: CPU time of the step (see one_iteration); more threads: wall time
        phase = "cpu total" if r.threads == 1 else "total"
        table.add(f"step / step floor, sum(outputs) ({'CPU' if r.threads == 1 else 'wall'} time)",
                  f"ours {r.spec.gradient} M={r.spec.floats:,} Z={r.spec.block_size}", r.threads,
                  r.spec.optimizer, _div(r.phases[phase], floor.phases[phase] if floor else None),
                  STEP_FLOOR_RATIO, False)
    return table.render()
