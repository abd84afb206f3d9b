"""How fast is one CPU training step of our C++ kernel, against its peers and its floors?

A pair model: batch B = 32768, two lookups of one id per sample into one table or ROBE array,
done as one call over 2B bags by every row (SUM, dim 64), ids uniform in [0, 1,562,500). For
each optimizer and loss (``pair``: sum(e1*e2); ``sum``: sum(outputs), whose backward is
little more than the embedding's own) the rows are: ``floor`` (the loss and optimizer around
an embedding that only writes its output from a cache-resident source and reads its gradient
once), ``full table`` (``nn.EmbeddingBag``, 100M floats, sparse and dense gradients),
``fbgemm TBE`` (its fused optimizer, where FBGEMM has one on CPU), ``pytorch ROBE-Z`` (the
reference ops) and ``ours`` (the C++ ops, dense gradient and fused), arrays of 262,144 and
2,621,440 floats. Rows of arrays up to 10M floats are timed interleaved, step by step.

The forward section times our forward alone against the forward floor (both hashes, Z = 8
and 32, both arrays) with its profile: the hash pass alone, the forward without its stores,
a read of every line its gathers touch, the backward op and one read of its gradient. At 1
thread the targets are judged on CPU time, which time spent descheduled does not inflate::

    python -m benchmarks.cpu_ops --quick                                  # tiny sizes
    python -m benchmarks.cpu_ops --out benchmarks/results/cpu_ops.md
    python -m benchmarks.cpu_ops --rows floor ours --out benchmarks/results/cpu_ops_floors.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import (Split, command_line, fmt, header, interleaved, keep_freed_memory,
                               medians_ms, parser, publish, ratio, table)
from robe_torchrec.fused_lookup import fused_lookup
from robe_torchrec.hashing import HashMode, block_starts, hash_params
from robe_torchrec.ops import LayoutArgs, LookupArgs, cpu, cpu_backend
from robe_torchrec.ops import meta as m
from robe_torchrec.optim import RobeFusedOptimizer

OPTIMIZERS = ("sgd", "adagrad", "adam")
LOSSES = {"pair": "sum(e1*e2)", "sum": "sum(outputs)"}
GROUPS = ("floor", "full", "fbgemm", "pytorch", "ours")
LR, ADAGRAD_EPS, ADAM_BETAS, ADAM_EPS, HASH_SEED = 1e-3, 1e-10, (0.9, 0.999), 1e-8, 1024
FLOOR_SOURCE_ROWS = 256  # 64 KB at dim 64: the floor's source stays in L1/L2
LINE_FLOATS = 16  # floats per 64-byte cache line
LINES_PER_BAG = 64  # the line-read floor pools this many lines per output row
INTERLEAVE_MAX_FLOATS = 10_000_000  # rows of arrays up to this size are timed interleaved
#: the machine's own 2-thread scaling, timed in the forward section's loop: a compute-bound
#: 512x512 matmul (a reference, not a bound: a kernel waiting on memory may gain more)
COMPUTE_REFERENCE = "compute reference"
#: target -> its goal (at most)
TARGETS = {"forward / forward floor (CPU time)": 1.5, "forward / 1-thread forward": 0.6,
           "step / step floor, sum(outputs)": 1.5}


@dataclass(frozen=True)
class Sizes:
    batch: int
    num_embeddings: int
    dim: int
    robe_sizes: Tuple[int, ...]
    block_size: int
    small_block_size: int  # the ``ours`` rows' second Z, at the largest array


FULL_SIZES = Sizes(32768, 1_562_500, 64, (262_144, 2_621_440), 32, 8)
QUICK_SIZES = Sizes(256, 20_000, 64, (4_096, 16_384), 32, 8)


class Unavailable(Exception):
    """A row that cannot run here (the reason goes to the table)."""


@dataclass
class Batch:
    values: Tensor   # [2B] int64: feature 0's ids, then feature 1's
    offsets: Tensor  # [2B + 1] int64: one id per bag


def make_batches(sizes: Sizes, count: int, seed: int = 0) -> List[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [Batch(torch.randint(0, sizes.num_embeddings, (2 * sizes.batch,), generator=gen),
                  torch.arange(2 * sizes.batch + 1)) for _ in range(count)]


def optimizer_spec(name: str):
    """The ``torch.optim`` class and kwargs of ``name`` (the fused rows get the same)."""
    return {"sgd": (torch.optim.SGD, {"lr": LR}),
            "adagrad": (torch.optim.Adagrad, {"lr": LR, "eps": ADAGRAD_EPS}),
            "adam": (torch.optim.Adam, {"lr": LR, "betas": ADAM_BETAS, "eps": ADAM_EPS})}[name]


# --------------------------------------------------------------------------------- the rows

class Runner:
    """One model and its optimizer: a train step is forward, the loss's backward, step."""

    loss = "pair"  # a key of LOSSES
    opt: Optional[torch.optim.Optimizer] = None  # None: no step of its own (fused)
    feature_dim = 0  # the output's dim that holds the two lookups: [2B, D] (TBE: [B, 2D])

    def use(self, name: str, params, sparse: bool = False) -> None:
        """Train ``params`` with ``torch.optim`` optimizer ``name``."""
        cls, kwargs = optimizer_spec(name)
        if name == "adam" and sparse:
            cls = torch.optim.SparseAdam
        self.opt = cls(params, **kwargs)

    def forward(self, batch: Batch) -> Tensor:
        raise NotImplementedError

    def backward(self, out: Tensor) -> None:
        if self.loss == "sum":
            return out.sum().backward()
        first, second = out.chunk(2, dim=self.feature_dim)
        (first * second).sum().backward()

    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def extra(self) -> Dict[str, float]:
        """Timings (seconds) taken beside the step, outside it."""
        return {}


class FullTable(Runner):
    def __init__(self, sizes: Sizes, optimizer: str, sparse: bool):
        self.emb = nn.EmbeddingBag(sizes.num_embeddings, sizes.dim, mode="sum", sparse=sparse,
                                   include_last_offset=True)
        self.use(optimizer, self.emb.parameters(), sparse)

    def forward(self, batch: Batch) -> Tensor:
        return self.emb(batch.values, batch.offsets)


class Fbgemm(Runner):
    """FBGEMM's CPU TBE, its optimizer fused into its backward; output [B, 2D]."""

    feature_dim = 1

    def __init__(self, sizes: Sizes, optim_name: str):
        try:  # FBGEMM asserts on the optimizers it lacks on CPU: its reason goes to the table
            self.build(16, 8, optim_name)(torch.arange(1, 5), torch.arange(5)).sum().backward()
        except ImportError as exc:
            raise Unavailable(f"fbgemm_gpu not importable: {exc}") from exc
        except Exception as exc:  # noqa: BLE001
            raise Unavailable((str(exc).strip().splitlines() or [type(exc).__name__])[0]) from exc
        self.tbe = self.build(sizes.num_embeddings, sizes.dim, optim_name)

    @staticmethod
    def build(num_embeddings: int, dim: int, optim_name: str):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (EmbeddingLocation,
                                                                          PoolingMode)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

        return SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(num_embeddings, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            feature_table_map=[0, 0], optimizer=getattr(EmbOptimType, optim_name),
            learning_rate=LR, eps=ADAGRAD_EPS if "ADAGRAD" in optim_name else ADAM_EPS,
            beta1=ADAM_BETAS[0], beta2=ADAM_BETAS[1], pooling_mode=PoolingMode.SUM)

    def forward(self, batch: Batch) -> Tensor:
        return self.tbe(batch.values, batch.offsets)


class Robe(Runner):
    """ROBE-Z through ``torch.ops.robe`` (the caller's ``cpu_backend`` picks the kernel):
    dense gradient + ``torch.optim``, or fused (``robe::backward_fused_`` updates in backward)."""

    def __init__(self, sizes: Sizes, optimizer: str, memory: int, block_size: int, mode: str,
                 hash_mode: HashMode):
        self.sizes, self.memory, self.block_size, self.mode = sizes, memory, block_size, mode
        self.hash_mode, self.params = hash_mode, hash_params(hash_mode, HASH_SEED)
        # the two lookups read the same array with the same keys: one feature of 2B bags
        meta = m.build_table_meta(dims=[sizes.dim], weight_offsets=[0], weight_sizes=[memory],
                                  row_offsets=[0], num_rows=[sizes.num_embeddings],
                                  poolings=[m.Pooling.SUM])
        self.layout = LayoutArgs(meta, sizes.dim, block_size, int(hash_mode), self.params,
                                 int(m.BoundsCheck.ERROR))
        bound = math.sqrt(1.0 / sizes.num_embeddings)  # the reference DLRM's init
        self.weights = torch.empty(memory).uniform_(-bound, bound)
        if mode == "dense":
            self.weights = nn.Parameter(self.weights)
            self.use(optimizer, [self.weights])
        else:
            self.fused = RobeFusedOptimizer("weight", self.weights, *optimizer_spec(optimizer))

    def args(self, batch: Batch) -> LookupArgs:
        return LookupArgs(batch.values, batch.offsets, None, self.layout)

    def lookup(self, batch: Batch) -> Tensor:
        return self.args(batch).forward(self.weights)

    def forward(self, batch: Batch) -> Tensor:
        if self.mode == "dense":
            return self.lookup(batch)
        return fused_lookup(self.weights, self.fused, self.args(batch))

    # the forward's profile (C++ kernel): its parts, each alone
    def hash_only(self, batch: Batch) -> int:
        return cpu.forward_hash_only(self.weights.detach(), *self.args(batch).flat())

    def gather_only(self, batch: Batch) -> Tensor:
        return cpu.forward_gather_only(self.weights.detach(), *self.args(batch).flat())

    def backward_dense(self, batch: Batch, grad: Tensor) -> Tensor:
        return self.args(batch).backward_dense(grad, self.weights.detach())

    def touched_lines(self, batch: Batch) -> Tensor:
        """Index of every 64-byte line of the array that each (id, block) gather of
        ``batch`` reads, in gather order (a block of Z floats spans 1 to 3 lines)."""
        blocks = math.ceil(self.sizes.dim / self.block_size)
        starts = block_starts(batch.values, blocks, self.memory, self.block_size, self.hash_mode,
                              self.params).reshape(-1)
        first = starts // LINE_FLOATS
        count = (starts + self.block_size - 1) // LINE_FLOATS - first + 1
        begin = torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
        return torch.repeat_interleave(first, count) + (torch.arange(int(count.sum())) - begin)


def expected_lines(block_size: int) -> float:
    """Mean number of 64-byte lines a block of Z floats at a random float offset spans."""
    return 1 + (4 * block_size - 4) / (4 * LINE_FLOATS)


def read_lines(lines: Tensor, weights: Tensor) -> Tensor:
    """The gathers' memory floor: the array's 64-byte lines ``lines`` read by torch's
    embedding_bag (FBGEMM's prefetching kernel), :data:`LINES_PER_BAG` pooled per row."""
    table_ = weights.detach()[: weights.numel() // LINE_FLOATS * LINE_FLOATS].view(-1, LINE_FLOATS)
    return F.embedding_bag(lines, table_, torch.arange(0, lines.numel(), LINES_PER_BAG), mode="sum")


def floor_forward(source: Tensor, rows: int) -> Tensor:
    """The forward floor: a fresh [rows, D] output written from the cache-resident
    ``source`` (what any lookup must at least do)."""
    out = source.new_empty(rows, source.shape[1])
    k = math.gcd(rows, source.shape[0])
    out.view(rows // k, k, -1).copy_(source[:k].expand(rows // k, k, source.shape[1]))
    return out


class _FloorLookup(torch.autograd.Function):
    """:func:`floor_forward`, whose backward reads its gradient once (one sum) and hands the
    optimizer a gradient that is zero but for one entry."""

    @staticmethod
    def forward(ctx, weights: Tensor, source: Tensor, rows: int) -> Tensor:  # type: ignore
        ctx.numel = weights.numel()
        return floor_forward(source, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore
        grad_weights = grad.new_zeros(ctx.numel)
        grad_weights[0] = grad.sum()
        return grad_weights, None, None


class Floor(Runner):
    """The step floor: the rows' loss and optimizer (on an array of ``memory`` floats)
    around :class:`_FloorLookup`; its ``read`` is one read of a [2B, D] gradient."""

    def __init__(self, sizes: Sizes, optimizer: str, memory: int):
        self.rows, self.source = 2 * sizes.batch, torch.randn(FLOOR_SOURCE_ROWS, sizes.dim)
        self.weights = nn.Parameter(torch.zeros(memory))
        self.use(optimizer, [self.weights])
        self.grad = torch.randn(self.rows, sizes.dim)

    def forward(self, batch: Batch) -> Tensor:
        return _FloorLookup.apply(self.weights, self.source, self.rows)

    def extra(self) -> Dict[str, float]:
        split = Split()
        float(self.grad.sum())
        split.lap("read")
        return split.parts


@dataclass
class RowSpec:
    key: str           # unique within a (loss, optimizer), e.g. "ours-fused-2621440-z32"
    model: str
    optimizer: str
    gradient: str      # sparse | dense | fused
    floats: int
    block_size: Optional[int]
    build: Callable[[], Runner]
    backend: Optional[str] = None  # the cpu_backend of ROBE rows
    note: str = ""
    loss: str = "pair"

    @property
    def name(self) -> str:
        return f"{self.model} {self.gradient} M={self.floats:,} Z={self.block_size}"


def row_specs(sizes: Sizes, optimizer: str, groups: Sequence[str],
              hash_mode: HashMode) -> List[RowSpec]:
    full = sizes.num_embeddings * sizes.dim
    specs = []
    if "floor" in groups:
        specs += [RowSpec(f"floor-{mem}", "floor", optimizer, "dense", mem, None,
                          lambda mem=mem: Floor(sizes, optimizer, mem)) for mem in sizes.robe_sizes]
    if "full" in groups:
        specs += [RowSpec(f"full-{g}", "full table", optimizer, g, full, None,
                          lambda g=g: FullTable(sizes, optimizer, g == "sparse"))
                  for g in ("sparse", "dense")]
    if "fbgemm" in groups:
        names = {"sgd": ["EXACT_SGD"], "adagrad": ["EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"],
                 "adam": ["ADAM", "PARTIAL_ROWWISE_ADAM"]}[optimizer]
        specs += [RowSpec("fbgemm" if i == 0 else f"fbgemm-{n.lower()}", "fbgemm TBE", optimizer,
                          "fused", full, None, lambda n=n: Fbgemm(sizes, n), note=n)
                  for i, n in enumerate(names)]
    configs = [(mem, sizes.block_size) for mem in sizes.robe_sizes]
    if "pytorch" in groups:
        specs += [RowSpec(f"pytorch-{mem}-z{z}", "pytorch ROBE-Z", optimizer, "dense", mem, z,
                          lambda mem=mem, z=z: Robe(sizes, optimizer, mem, z, "dense", hash_mode),
                          backend="reference") for mem, z in configs]
    if "ours" in groups:
        specs += [RowSpec(f"ours-{mode}-{mem}-z{z}", "ours", optimizer, mode, mem, z,
                          lambda mem=mem, z=z, mode=mode: Robe(sizes, optimizer, mem, z, mode,
                                                               hash_mode), backend="cpp")
                  for mem, z in configs + [(sizes.robe_sizes[-1], sizes.small_block_size)]
                  for mode in ("dense", "fused")]
    return specs


@dataclass
class Result:
    spec: RowSpec
    threads: int
    phases: Dict[str, float] = field(default_factory=dict)  # ms, medians
    unavailable: Optional[str] = None


def _backend(spec: RowSpec):
    return cpu_backend(spec.backend) if spec.backend else contextlib.nullcontext()


def train_step(runner: Runner, spec: RowSpec, batch: Batch) -> Dict[str, float]:
    """One train step of ``runner``, seconds per phase; ``cpu total`` is the calling
    thread's CPU time of the step (at 1 thread all of its work)."""
    with _backend(spec):
        split = Split()
        out = runner.forward(batch)
        split.lap("forward")
        runner.backward(out)
        split.lap("backward")
        runner.step()
        split.lap("optimizer")
        return split.done(**runner.extra())


def run_specs(specs: Sequence[RowSpec], threads: Sequence[int], batches: Sequence[Batch],
              warmup: int, iters: int) -> List[Result]:
    """The rows of ``specs`` timed together, interleaved step by step, at each thread count;
    a row that cannot be built or fails is reported and the others go on."""
    results = [[Result(spec, k) for k in threads] for spec in specs]
    live: List[Tuple[int, Runner]] = []
    for i, spec in enumerate(specs):
        try:
            with _backend(spec):
                live.append((i, spec.build()))
                live[-1][1].loss = spec.loss
        except Exception as exc:  # noqa: BLE001  a row failing must not lose the others
            for r in results[i]:
                r.unavailable = str(exc) if isinstance(exc, Unavailable) else f"error: {exc!r}"
    try:
        for j, k in enumerate(threads):
            torch.set_num_threads(k)
            steps = {i: (lambda it, runner=runner, spec=specs[i]:
                         train_step(runner, spec, batches[it % len(batches)]))
                     for i, runner in live}
            for i, phases in medians_ms(interleaved(steps, iters, warmup)).items():
                results[i][j].phases = {p: v for p, v in phases.items() if p not in ("wall", "cpu")}
    except Exception as exc:  # noqa: BLE001  the group's timing failed: say so on each row
        for i, _ in live:
            for r in results[i]:
                r.unavailable = f"error: {exc!r}"
    finally:
        live.clear()
        gc.collect()
    return [r for rs in results for r in rs]


# ------------------------------------------------------------------- the forward section

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
    return [ForwardCase(h, mem, z) for h in (HashMode.REFERENCE, HashMode.MIX)
            for mem in sizes.robe_sizes for z in zs]


def forward_calls(sizes: Sizes, threads: Sequence[int],
                  batches: Sequence[Batch]) -> Dict[str, Callable[[Batch], object]]:
    """The forward floor, our forward of every case and its profile's parts (``hash``,
    ``gather``, ``lines``, ``backward``), ``read`` (one read of the backward's gradient) and,
    with several thread counts, the compute reference."""
    source = torch.randn(FLOOR_SOURCE_ROWS, sizes.dim)
    grad = torch.randn(2 * sizes.batch, sizes.dim)
    calls: Dict[str, Callable[[Batch], object]] = {
        "floor": lambda batch: floor_forward(source, 2 * sizes.batch),
        "read": lambda batch: float(grad.sum())}
    if len(threads) > 1:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        calls[COMPUTE_REFERENCE] = lambda batch: torch.mm(a, b)
    for case in forward_cases(sizes):
        r = Robe(sizes, "sgd", case.memory, case.block_size, "dense", case.hash_mode)
        # two batches' lines, in turn: real sets of lines, without holding them all
        lines = itertools.cycle([r.touched_lines(b) for b in batches[:2]])
        calls.update({case.name: r.lookup, f"hash {case.name}": r.hash_only,
                      f"gather {case.name}": r.gather_only,
                      f"lines {case.name}": lambda batch, r=r, lines=lines: read_lines(next(lines),
                                                                                       r.weights),
                      f"backward {case.name}": lambda batch, r=r: r.backward_dense(batch, grad)})
    return calls


def time_forwards(sizes: Sizes, threads: Sequence[int], batches: Sequence[Batch], warmup: int,
                  iters: int) -> Dict[str, float]:
    """Median ms of :func:`forward_calls` keyed ``"<k>t <name>"`` (wall time) and
    ``"<k>t cpu <name>"`` (the calling thread's CPU time); the backward op at 1 thread only."""
    calls = forward_calls(sizes, threads, batches)
    keys = [(k, name) for k in threads for name in calls
            if k == 1 or not name.startswith("backward ")]
    fns = {key: (lambda it, fn=calls[key[1]]: fn(batches[it % len(batches)])) for key in keys}
    with cpu_backend("cpp"), torch.no_grad():
        ms = medians_ms(interleaved(fns, iters, warmup, lambda key: torch.set_num_threads(key[0])))
    return {f"{k}t {clock}{name}": v[part] for (k, name), v in ms.items()
            for clock, part in (("", "wall"), ("cpu ", "cpu"))}


def profiles(fwd: Dict[str, float], sizes: Sizes) -> List[Dict[str, object]]:
    """Each case's 1-thread CPU ms: the store floor, the forward and its parts, the
    backward op and one read of its gradient; the work done (hashes, lines touched); the
    serial floor (store + hash + line reads, one after the other)."""
    out = []
    for case in forward_cases(sizes):
        get = {part: fwd.get(f"1t cpu {part}{case.name}")
               for part in ("", "hash ", "gather ", "lines ", "backward ")}
        if any(v is None for v in get.values()):
            continue
        hashes = 2 * sizes.batch * math.ceil(sizes.dim / case.block_size)
        floor = fwd["1t cpu floor"]
        out.append({"case": case.name, "floor": floor, "forward": get[""], "hash": get["hash "],
                    "gather": get["gather "], "lines": get["lines "], "backward": get["backward "],
                    "read": fwd["1t cpu read"], "hashes": hashes,
                    "lines_touched": hashes * expected_lines(case.block_size),
                    "serial_floor": floor + get["hash "] + get["lines "]})
    return out


# ------------------------------------------------------------------------------ targets

def floor_of(r: Result, results: Sequence[Result], sizes: Sizes) -> Optional[Result]:
    """The floor row of ``r``: same threads, optimizer, loss and array size (rows of no
    ROBE size: the smallest array's)."""
    mem = r.spec.floats if r.spec.floats in sizes.robe_sizes else min(sizes.robe_sizes)
    return next((f for f in results if f.spec.model == "floor" and f.phases
                 and (f.threads, f.spec.optimizer, f.spec.loss, f.spec.floats)
                 == (r.threads, r.spec.optimizer, r.spec.loss, mem)), None)


def targets(fwd: Dict[str, float], results: Sequence[Result], threads: Sequence[int],
            sizes: Sizes) -> List[Dict[str, object]]:
    """Every target of :data:`TARGETS` that this run's rows measure, met or not."""
    out: List[Dict[str, object]] = []

    def add(target: str, case: str, k: int, optimizer: str, value: Optional[float]) -> None:
        if value is not None:
            out.append({"target": target, "case": case, "threads": k, "optimizer": optimizer,
                        "value": value, "goal": TARGETS[target], "met": value <= TARGETS[target]})

    for case in forward_cases(sizes) if 1 in threads else []:
        add("forward / forward floor (CPU time)", case.name, 1, "-",
            ratio(fwd.get(f"1t cpu {case.name}"), fwd.get("1t cpu floor")))
        for k in threads[1:] if threads[0] == 1 else [k for k in threads if k != 1]:
            add("forward / 1-thread forward", case.name, k, "-",
                ratio(fwd.get(f"{k}t {case.name}"), fwd.get(f"1t {case.name}")))
    for r in results:
        floor = floor_of(r, results, sizes)
        if r.spec.model == "ours" and r.spec.loss == "sum" and r.phases and floor:
            phase = "cpu total" if r.threads == 1 else "total"  # CPU time at 1 thread
            add("step / step floor, sum(outputs)", r.spec.name, r.threads, r.spec.optimizer,
                ratio(r.phases[phase], floor.phases[phase]))
    return out


# ------------------------------------------------------------------------------- report

def step_tables(results: Sequence[Result], threads: Sequence[int], sizes: Sizes) -> List[str]:
    head = ["model", "loss", "optimizer", "gradient", "floats", "Z", "forward", "backward",
            "optimizer step", "total", "forward / floor", "total / floor", "CPU total",
            "CPU total / floor", "notes"]
    lines = []
    for k in threads:
        rows = []
        for r in (r for r in results if r.threads == k):
            s, p = r.spec, r.phases
            fp = (floor_of(r, results, sizes) or Result(s, k)).phases
            cells = [fmt(p.get(x)) for x in ("forward", "backward", "optimizer", "total")]
            cells += [fmt(ratio(p.get(a), fp.get(a))) + "x" for a in ("forward", "total")]
            cells += [fmt(p.get("cpu total")), 
                      fmt(ratio(p.get("cpu total"), fp.get("cpu total"))) + "x"]
            notes = [n for n in [s.note, r.unavailable or ""] if n]
            rows.append([s.model, LOSSES[s.loss], s.optimizer, s.gradient, f"{s.floats:,}",
                         s.block_size or "-", *cells, "; ".join(notes)])
        lines += [f"### {k} thread{'s' if k > 1 else ''}", "", *table(head, rows), ""]
    return lines


def forward_tables(fwd: Dict[str, float], threads: Sequence[int], sizes: Sizes) -> List[str]:
    names = ["floor", *(c.name for c in forward_cases(sizes))] + \
        ([COMPUTE_REFERENCE] if f"1t {COMPUTE_REFERENCE}" in fwd else [])
    rows = [[name] + [fmt(x) for k in threads for x in (
        fwd.get(f"{k}t {name}"), ratio(fwd.get(f"{k}t {name}"), fwd.get(f"{k}t floor")))]
        for name in names]
    head = ["case"] + [f"{c} ({k}t)" for k in threads for c in ("ms", "/ floor")]
    prof = [[p["case"], fmt(p["forward"]), fmt(p["floor"]), fmt(p["hash"]), fmt(p["gather"]),
             fmt(p["lines"]), fmt(p["serial_floor"]), fmt(p["forward"] / p["serial_floor"]),
             fmt(p["backward"]), fmt(p["backward"] / p["read"])] for p in profiles(fwd, sizes)]
    return [*table(head, rows), "",
            "Profile, 1 thread, CPU ms: hash = the kernel's hash pass alone; gather = the "
            "forward without its output stores; lines = a read of every cache line the gathers "
            "touch; serial floor = store floor + hash + lines; backward = the dense-gradient op, "
            "beside one read of its gradient.", "",
            *table(["case", "forward", "store floor", "hash", "gather", "lines", "serial floor",
                    "forward / serial", "backward", "backward / read"], prof), ""]


def targets_table(found: Sequence[Dict[str, object]]) -> List[str]:
    met = sum(bool(t["met"]) for t in found)
    rows = [[t["target"], t["case"], t["threads"], t["optimizer"], f"{t['value']:.2f}",
             f"<= {t['goal']:g}", "met" if t["met"] else "missed"] for t in found]
    return [f"{met} of {len(found)} met.", "",
            *table(["target", "case", "threads", "optimizer", "value", "goal", "verdict"], rows)]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = parser("cpu_ops", __doc__)
    p.add_argument("--threads", type=int, nargs="+", default=None, help="default 1 2 (--quick: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 10; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="default 3; quick 1")
    p.add_argument("--forward-iters", type=int, default=None, help="default 3 x --iters")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    p.add_argument("--hash", default="reference", choices=["reference", "mix"])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--rows", nargs="+", default=list(GROUPS), choices=GROUPS,
                   help="row groups (the forward section runs with 'ours')")
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
    p.add_argument("--out", default=None, help="the report (.md; its numbers in a .json beside)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    threads = args.threads or ([1] if args.quick else [1, 2])
    iters = args.iters if args.iters is not None else (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    allocator = keep_freed_memory()
    torch.manual_seed(0)
    batches = make_batches(sizes, count=max(1, min(warmup + iters, 8)))
    fwd = time_forwards(sizes, threads, batches, warmup, args.forward_iters or 3 * iters) \
        if "ours" in args.rows else {}
    results: List[Result] = []
    for loss, opt in itertools.product(args.losses, args.optimizers):
        specs = [dataclasses.replace(s, loss=loss)
                 for s in row_specs(sizes, opt, args.rows, HashMode.parse(args.hash))]
        small = [s for s in specs if s.floats <= INTERLEAVE_MAX_FLOATS]
        for group in [small] + [[s] for s in specs if s.floats > INTERLEAVE_MAX_FLOATS]:
            results += run_specs(group, threads, batches, warmup, iters) if group else []
    found = targets(fwd, results, threads, sizes)
    lines = header("CPU op benchmark: one training step of the pair model",
                   command_line("cpu_ops", argv), f"allocator: {allocator}",
                   f"setup: batch {sizes.batch}, pair model, dim {sizes.dim}, ids uniform in [0, "
                   f"{sizes.num_embeddings:,}), losses {', '.join(LOSSES[x] for x in args.losses)},"
                   f" lr {LR}; {args.hash} hash (seed {HASH_SEED}); {warmup} warm-up + {iters} "
                   f"timed steps, medians, {len(batches)} distinct batches")
    lines += ["Milliseconds. `/ floor`: the row over the floor row of its loss, optimizer, "
              "threads and array (other sizes: the smallest array's). CPU total: the calling "
              "thread's CPU time of the step (at 2 threads it misses the worker's share).", ""]
    if fwd:
        lines += ["## Forward against its floor", "", *forward_tables(fwd, threads, sizes)]
    lines += ["## Step rows", "", *step_tables(results, threads, sizes),
              "## Targets (same run)", "", *targets_table(found)]
    result = {"command": command_line("cpu_ops", argv), "sizes": dataclasses.asdict(sizes),
              "forward": fwd, "profile": profiles(fwd, sizes), "targets": found,
              "rows": [dict(key=r.spec.key, model=r.spec.model, loss=r.spec.loss,
                            optimizer=r.spec.optimizer, gradient=r.spec.gradient,
                            floats=r.spec.floats, block_size=r.spec.block_size,
                            threads=r.threads, phases=r.phases,
                            unavailable=r.unavailable) for r in results]}
    publish(args.out, "cpu_ops", lines, result)
    return result


if __name__ == "__main__":
    main()
