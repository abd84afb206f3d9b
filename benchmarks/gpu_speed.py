"""The GPU lookups timed against the full-table lookup TorchRec users have, and against the
floors that bound any lookup: the speed half of ``benchmarks.gpu_check``.

Peers and floors, all at the paper's setting (batch 10240, dim 128, the 26 Criteo Kaggle
tables, ids uniform in each table, SUM pooling, float32, int64 ids):

* **full table, one lookup**: the 26 tables as one ``[33.8 M, 128]`` table (17.3 GB) looked
  up by one ``F.embedding_bag`` call, as FBGEMM's TBE looks all tables up in one kernel;
  its training row adds the in-place SGD row update (``index_add_`` of the rows' gradients);
* **26 x nn.EmbeddingBag**: one call a table, sparse gradients (the second peer);
* **floor: output write**: writing the ``[B, 26 * 128]`` output once;
* **floor: L2 block reads** (bags of several ids): reading every block the lookup touches
  from the (L2-resident) ROBE array, from starts computed beforehand, and pooling them:
  the ROBE-Z forward without its hash, its index loads and its checks.

ROBE-Z rows: ``torch.ops.robe.forward`` (its input checks included, deferred as on CUDA by
default); training = forward + ``robe::backward_fused_`` with SGD or Adagrad (what the module
runs under ``apply_optimizer_in_backward``). With several ids a bag, rows also time launch
variants through :mod:`robe_torchrec.ops.tuning`, their outputs compared with the default's.

Each row: CUDA events around ``inner`` calls, samples interleaved round-robin (each round
starting one row later), medians; the host's time to issue the calls beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

#: lr, eps, beta1, beta2, weight decay of the fused rows
_HPARAMS = [0.01, 1e-8, 0.9, 0.999, 0.0]
_LR = _HPARAMS[0]


@dataclasses.dataclass
class Scenario:
    name: str
    batch: int
    dim: int
    cardinalities: List[int]
    ids_per_bag: int
    block_sizes: List[int]
    compression: float


@dataclasses.dataclass
class Row:
    name: str
    forward: Callable[[], object]
    train: Optional[Callable[[], object]] = None
    reps: Optional[int] = None
    forward_ms: List[float] = dataclasses.field(default_factory=list)
    train_ms: List[float] = dataclasses.field(default_factory=list)
    host_ms: List[float] = dataclasses.field(default_factory=list)
    first_ms: float = float("nan")
    note: str = ""

    def median(self, which: str) -> float:
        samples = getattr(self, f"{which}_ms")
        return statistics.median(samples) if samples else float("nan")


class Lookup:
    """The ids of a scenario and the tensors every row shares."""

    def __init__(self, s: Scenario, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.s, self.device = s, device
        bags = s.batch * len(s.cardinalities)
        self.lengths = torch.full((bags,), s.ids_per_bag, dtype=torch.int64)
        ids = [torch.randint(0, c, (s.batch * s.ids_per_bag,), generator=g)
               for c in s.cardinalities]
        self.ids = torch.cat(ids).to(device)
        row_offsets = torch.tensor([0] + list(s.cardinalities[:-1])).cumsum(0)
        self.global_ids = torch.cat([i + o for i, o in zip(ids, row_offsets.tolist())]).to(device)
        self.offsets = torch.zeros(bags + 1, dtype=torch.int64)
        self.offsets[1:] = self.lengths.cumsum(0)
        self.offsets = self.offsets.to(device)
        self.bag_of_id = torch.arange(bags, device=device).repeat_interleave(
            self.lengths.to(device))
        self.output_dim = s.dim * len(s.cardinalities)
        self.grad = torch.randn(s.batch, self.output_dim, generator=g).to(device)


def full_table_rows(lk: Lookup) -> List[Row]:
    s = lk.s
    rows_total = sum(s.cardinalities)
    table = torch.empty(rows_total, s.dim, device=lk.device).uniform_(-0.01, 0.01)
    # the gradient of bag (t, b) is columns [t*D, (t+1)*D) of sample b's output gradient
    bag_grad = lk.grad.view(s.batch, len(s.cardinalities), s.dim).transpose(0, 1).reshape(
        -1, s.dim).contiguous()
    id_grad = bag_grad if s.ids_per_bag == 1 else None

    def forward():
        return F.embedding_bag(lk.global_ids, table, lk.offsets[:-1], mode="sum")

    def train():
        forward()
        rows = id_grad if id_grad is not None else bag_grad.index_select(0, lk.bag_of_id)
        table.index_add_(0, lk.global_ids, rows, alpha=-_LR)

    starts = torch.tensor([0] + list(s.cardinalities)).cumsum(0).tolist()
    bags = [torch.nn.EmbeddingBag.from_pretrained(table[a:b], freeze=False, mode="sum",
                                                  sparse=True)
            for a, b in zip(starts[:-1], starts[1:])]
    per_table = lk.ids.view(len(bags), -1)
    per_offsets = lk.offsets[:s.batch]
    grads = list(bag_grad.view(len(bags), s.batch, s.dim))

    def forward_26():
        return [bag(x, per_offsets) for bag, x in zip(bags, per_table)]

    def train_26():
        for bag in bags:
            bag.weight.grad = None
        torch.autograd.backward(forward_26(), grads)

    return [Row("full table, one lookup (+ in-place SGD rows)", forward, train),
            Row("26 x nn.EmbeddingBag (+ sparse backward)", forward_26, train_26)]


def _triton(device: torch.device):
    """The Triton kernels for ``device``'s tensors: CUDA always reaches them; CPU tensors
    (the CI smoke run, Triton's interpreter) only when asked."""
    from robe_torchrec.ops import cpu_backend

    return contextlib.nullcontext() if device.type == "cuda" else cpu_backend("triton")


def robe_arrays(lk: Lookup, block_size: int):
    from robe_torchrec.hashing import HashMode, hash_params
    from robe_torchrec.ops.meta import BoundsCheck, Pooling, build_table_meta

    s, n = lk.s, len(lk.s.cardinalities)
    memory_size = max(int(sum(s.cardinalities) * s.dim / s.compression), block_size)
    meta = build_table_meta([s.dim] * n, [0] * n, [memory_size] * n,
                            torch.tensor([0] + list(s.cardinalities[:-1])).cumsum(0).tolist(),
                            list(s.cardinalities), [int(Pooling.SUM)] * n, device=lk.device)
    weights = torch.empty(memory_size, device=lk.device).uniform_(-0.01, 0.01)
    flat = (lk.ids, lk.offsets, None, meta, lk.output_dim, block_size,
            int(HashMode.REFERENCE), hash_params(HashMode.REFERENCE, seed=1024),
            int(BoundsCheck.ERROR))
    return weights, flat


def robe_rows(lk: Lookup, block_size: int, variants: Dict[str, dict]) -> List[Row]:
    from robe_torchrec.ops.meta import Optimizer
    from robe_torchrec.ops.tuning import tuned

    weights, flat = robe_arrays(lk, block_size)
    values, offsets, _, meta, _, _, hash_mode, params, _ = flat
    rows = []
    for label, tuning in variants.items():
        fused = weights.clone()
        state = torch.zeros_like(fused)

        # the default row enters no tuning block: its host time is the op's alone
        launch = (lambda t=tuning: tuned(**t)) if tuning else contextlib.nullcontext

        def forward(launch=launch, w=weights):
            with torch.no_grad(), launch(), _triton(lk.device):
                return torch.ops.robe.forward(w, *flat)

        def train(launch=launch, optimizer=Optimizer.SGD, w=fused, state=state):
            with torch.no_grad(), launch(), _triton(lk.device):
                torch.ops.robe.forward(w, *flat)
                torch.ops.robe.backward_fused_(
                    lk.grad, w, state, state.new_empty(0), values, offsets, None, meta,
                    block_size, hash_mode, params, int(optimizer), _HPARAMS, 1)

        suffix = f", {label}" if label else ""
        rows.append(Row(f"ROBE-Z Z={block_size}{suffix} (+ fused SGD)", forward, train))
        if not label:
            from robe_torchrec.ops import triton_kernels

            def direct(w=weights):
                with torch.no_grad(), _triton(lk.device):
                    return triton_kernels.forward(w, *flat)

            rows.append(Row(f"ROBE-Z Z={block_size} forward, Triton wrapper called directly "
                            "(host split)", direct))
            adagrad_w, adagrad_state = weights.clone(), torch.zeros_like(weights)
            rows.append(Row(f"ROBE-Z Z={block_size} (+ fused Adagrad)", forward,
                            lambda: train(optimizer=Optimizer.ADAGRAD, w=adagrad_w,
                                          state=adagrad_state)))
    return rows


def reference_row(lk: Lookup, block_size: int, reps: int) -> Row:
    from robe_torchrec.ops import reference

    weights, flat = robe_arrays(lk, block_size)

    def forward():
        with torch.no_grad():
            return reference.forward(weights, *flat)

    return Row(f"pure-PyTorch ROBE-Z Z={block_size}", forward, None, reps=reps)


def floor_rows(lk: Lookup, block_size: int) -> List[Row]:
    out = torch.empty(lk.s.batch, lk.output_dim, device=lk.device)
    rows = [Row("floor: output write", out.zero_)]
    if lk.s.ids_per_bag > 1:
        rows.append(l2_read_row(lk, block_size))
    return rows


def l2_read_row(lk: Lookup, block_size: int) -> Row:
    """The forward's pooling pass from block starts stored beforehand, without the hash and
    the input checks: what reading the touched blocks from L2 and pooling them costs,
    whatever computes their addresses."""
    from robe_torchrec.ops import triton_kernels as tk

    weights, flat = robe_arrays(lk, block_size)
    values, offsets, _, meta, output_dim, _, hash_mode, params, _ = flat
    starts = tk.hash_starts(weights, values, offsets, meta, lk.s.dim, block_size, hash_mode,
                            params)

    def forward():
        return tk.forward_from_starts(weights, values, offsets, meta, output_dim, lk.s.dim,
                                      block_size, starts)

    return Row(f"floor: L2 block reads + pooling, Z={block_size}", forward)


def time_rows(rows: Sequence[Row], timer, reps: int, inner: int, warmup: int) -> None:
    for row in rows:
        fn = row.train or row.forward
        row.first_ms = timer(fn, 1)
        for _ in range(warmup):
            row.forward()
            if row.train:
                row.train()
    for rep in range(reps):
        for row in list(rows[rep % len(rows):]) + list(rows[:rep % len(rows)]):
            if row.reps is not None and rep >= row.reps:
                continue
            n = inner if row.reps is None else 1
            row.forward_ms.append(timer(row.forward, n))
            row.host_ms.append(timer.host_ms)
            if row.train:
                row.train_ms.append(timer(row.train, n))
    from robe_torchrec.ops import raise_pending_checks

    raise_pending_checks()


def check_variants_agree(rows: Sequence[Row]) -> List[str]:
    """Each variant's forward against its Z's default row: relative max difference."""
    notes = []
    defaults = {r.name.split(",")[0].split(" (")[0]: r for r in rows
                if r.name.startswith("ROBE-Z") and r.name.endswith("(+ fused SGD)")
                and "," not in r.name}
    for r in rows:
        if r.name.startswith("ROBE-Z") and "," in r.name:
            base = defaults.get(r.name.split(",")[0])
            if base is None:
                continue
            a, b = base.forward(), r.forward()
            diff = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
            r.note = f"max rel. diff to default {diff:.1e}"
            notes.append(f"{r.name}: {r.note}")
    return notes


def scenario_table(rows: Sequence[Row], peer: Row) -> List[str]:
    def fmt(x: float, d: int = 3) -> str:
        return "n/a" if x != x else f"{x:.{d}f}"

    out = ["| row | forward ms | / peer | host us a call | train ms | / peer | first ms | note |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r.name} | {fmt(r.median('forward'))} | "
            f"{fmt(r.median('forward') / peer.median('forward'), 2)} | "
            f"{fmt(r.median('host') * 1e3, 0)} | {fmt(r.median('train'))} | "
            f"{fmt(r.median('train') / peer.median('train'), 2)} | {fmt(r.first_ms, 1)} | "
            f"{r.note} |")
    return out


def targets(rows: Sequence[Row], s: Scenario) -> List[str]:
    peer = rows[0]
    by_name = {r.name: r for r in rows}
    out_floor = by_name["floor: output write"].median("forward")
    lines = ["| target | value | goal | verdict |", "|---|---|---|---|"]

    def add(what: str, value: float, goal: float, unit: str = "x") -> None:
        verdict = "met" if value <= goal else "missed"
        lines.append(f"| {what} | {value:.2f}{unit} | <= {goal:g}{unit} | {verdict} |")

    for z in s.block_sizes:
        fwd = by_name[f"ROBE-Z Z={z} (+ fused SGD)"]
        adagrad = by_name[f"ROBE-Z Z={z} (+ fused Adagrad)"]
        add(f"Z={z} forward / full-table forward", fwd.median("forward") / peer.median("forward"), 0.5)
        add(f"Z={z} forward + fused SGD / full table + SGD rows",
            fwd.median("train") / peer.median("train"), 0.5)
        add(f"Z={z} forward + fused Adagrad / full table + SGD rows",
            adagrad.median("train") / peer.median("train"), 0.5)
        if s.ids_per_bag == 1:
            add(f"Z={z} forward / output-write floor", fwd.median("forward") / out_floor, 2.0)
            add(f"Z={z} host time a forward call", fwd.median("host") * 1e3, 40, " us")
        else:
            l2 = by_name.get(f"floor: L2 block reads + pooling, Z={z}")
            if l2 is not None:
                add(f"Z={z} forward / L2 block-read floor",
                    fwd.median("forward") / l2.median("forward"), 3.0)
    return lines


def run_scenario(s: Scenario, device: torch.device, timer, reps: int, inner: int,
                 warmup: int, variants: Dict[str, dict], reference_reps: int) -> List[str]:
    lk = Lookup(s, device)
    rows = full_table_rows(lk)
    for z in s.block_sizes:
        rows += robe_rows(lk, z, variants if z == s.block_sizes[0] else {"": {}})
    if s.ids_per_bag == 1 and reference_reps:
        rows.append(reference_row(lk, s.block_sizes[0], reference_reps))
    for z in s.block_sizes if s.ids_per_bag > 1 else s.block_sizes[:1]:
        rows += [r for r in floor_rows(lk, z) if z == s.block_sizes[0] or "L2" in r.name]
    time_rows(rows, timer, reps, inner, warmup)
    notes = check_variants_agree(rows)
    # the interpreter runs every program in Python: a couple of calls say enough there
    calls = 300 if device.type == "cuda" else 2
    profile = host_profile(lk, s.block_sizes[0], calls) if s.ids_per_bag == 1 else []
    cards = s.cardinalities
    lines = [f"### {s.name}", "",
             f"Batch {s.batch}, dim {s.dim}, {len(cards)} features ({sum(cards):,} rows), "
             f"{s.ids_per_bag} id(s) a bag ({lk.ids.numel():,} ids), ROBE array "
             f"{s.compression:g}x smaller than the tables (reference hash). Peer: the first "
             f"row. Medians of {reps} samples of {inner} calls.", ""]
    lines += scenario_table(rows, rows[0]) + [""] + targets(rows, s)
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    lines += [""] + profile
    del lk, rows
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return lines + [""]


def profile_calls(fn: Callable[[], object], calls: int, top: int) -> List[str]:
    """``cProfile`` of ``calls`` calls of ``fn`` (after one to warm up): the ``top`` entries
    with the most time of their own, as lines of text."""
    import cProfile
    import io
    import pstats

    fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def host_profile(lk: Lookup, block_size: int, calls: int = 300, top: int = 14) -> List[str]:
    """Where the host's time of a forward call goes: ``cProfile`` over ``calls`` calls of
    the registered op (no grad), the entries with the most time of their own."""
    from robe_torchrec.ops import raise_pending_checks

    weights, flat = robe_arrays(lk, block_size)
    with torch.no_grad(), _triton(lk.device):
        body = profile_calls(lambda: torch.ops.robe.forward(weights, *flat), calls, top)
    raise_pending_checks()
    return ([f"### Host time of a forward call, Z={block_size}, {lk.s.ids_per_bag} id(s) a bag",
             "", f"cProfile over {calls} calls of `torch.ops.robe.forward` (no grad; the "
             "profiler itself slows every Python call):", "", "```"] + body[:top + 8]
            + ["```", ""])


def single_table_sweep(device: torch.device, timer, reps: int, inner: int,
                       sizes: Sequence[int], compressions: Sequence[float],
                       batch: int = 10240, dim: int = 128, block_size: int = 32) -> List[str]:
    """The paper's single-table setting: one table, one id a bag, plain lookup beside ROBE-Z
    at each compression."""
    lines = ["### One table (the paper's appendix setting)", "",
             f"Batch {batch}, dim {dim}, one id a bag, Z = {block_size}; forward ms (median "
             f"of {reps} x {inner} calls), host us a call in brackets. The paper: plain "
             "lookup 0.12 ms, ROBE-Z 0.27 ms on its GPU.", "",
             "| rows n | plain lookup | " + " | ".join(f"ROBE-Z {c:g}x" for c in compressions)
             + " |", "|---|---|" + "---|" * len(compressions)]
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**34
    for n in sizes:
        s = Scenario(f"one table {n}", batch, dim, [n], 1, [block_size], 1.0)
        lk = Lookup(s, device)
        rows = []
        if n * dim * 4 < 0.6 * free:
            table = torch.empty(n, dim, device=device)
            rows.append(Row("plain", lambda t=table, lk=lk: F.embedding_bag(
                lk.global_ids, t, lk.offsets[:-1], mode="sum")))
        for c in compressions:
            weights, flat = robe_arrays(_with_compression(lk, c), block_size)
            rows.append(Row(f"{c:g}", lambda w=weights, f=flat: torch.ops.robe.forward(w, *f)))
        with torch.no_grad(), _triton(device):
            time_rows(rows, timer, reps, inner, warmup=2)
        cells = [] if rows[0].name == "plain" else ["n/a (table > GPU memory)"]
        cells += [f"{r.median('forward'):.3f} ({r.median('host') * 1e3:.0f})" for r in rows]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
        del lk, rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines + [""]


def _with_compression(lk: Lookup, compression: float) -> Lookup:
    copy = Lookup.__new__(Lookup)
    copy.__dict__.update(lk.__dict__)
    copy.s = dataclasses.replace(lk.s, compression=compression)
    return copy
