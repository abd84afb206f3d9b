"""The speed half of :mod:`benchmarks.gpu_check`: at the paper's setting (batch 10240, dim 128,
the 26 Criteo Kaggle tables, ids uniform, SUM, float32), one id a bag and several, the ROBE-Z
op (its checks included, deferred as on CUDA; training = forward + ``robe::backward_fused_``)
against the full-table lookup TorchRec users have (the 26 tables as one table in one
``F.embedding_bag``, its training row an in-place SGD row update) and the floors: writing the
output, and reading and pooling every block from starts hashed beforehand (by our kernel,
and by ``F.embedding_bag`` over the array as a table of blocks). With several ids
a bag, launch variants through :mod:`robe_torchrec.ops.tuning`, outputs compared. Beside the
default: the mix hash, and on CUDA the forward and the fused step replayed from CUDA graphs
(the device's time with no host work a call, what ``torch.compile(mode="reduce-overhead")``
gives a model; its output compared too). Rows are timed round-robin
(:class:`benchmarks.common.DeviceTimer`), medians, host time beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from benchmarks.common import DeviceTimer, fmt, table
from robe_torchrec.hashing import HashMode, hash_params
from robe_torchrec.ops import cpu_backend, raise_pending_checks, reference, triton_kernels
from robe_torchrec.ops.meta import BoundsCheck, Optimizer, Pooling, build_table_meta
from robe_torchrec.ops.tuning import tuned

#: lr, eps, beta1, beta2, weight decay of the fused rows
HPARAMS = [0.01, 1e-8, 0.9, 0.999, 0.0]


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
    #: its forward computes what its Z's default row does (compare_variants checks it)
    compared: bool = True
    #: why its first calls failed (then it is not timed)
    error: str = ""

    def median(self, which: str) -> float:
        samples = getattr(self, f"{which}_ms")
        return statistics.median(samples) if samples else float("nan")

    def json(self) -> Dict[str, object]:
        return {"name": self.name, "forward_ms": self.median("forward"),
                "train_ms": self.median("train"), "host_us": self.median("host") * 1e3,
                "first_ms": self.first_ms, "note": self.note}


class Lookup:
    """A scenario's ids, laid out for every row, and an upstream gradient."""

    def __init__(self, s: Scenario, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.s, self.device = s, device
        bags = s.batch * len(s.cardinalities)
        ids = [torch.randint(0, c, (s.batch * s.ids_per_bag,), generator=g)
               for c in s.cardinalities]
        self.row_offsets = torch.tensor([0] + list(s.cardinalities[:-1])).cumsum(0).tolist()
        self.ids = torch.cat(ids).to(device)
        self.global_ids = torch.cat([i + o for i, o in zip(ids, self.row_offsets)]).to(device)
        self.offsets = (torch.arange(bags + 1) * s.ids_per_bag).to(device)
        self.bag_of_id = torch.arange(bags, device=device).repeat_interleave(s.ids_per_bag)
        self.output_dim = s.dim * len(s.cardinalities)
        self.grad = torch.randn(s.batch, self.output_dim, generator=g).to(device)

    def robe(self, block_size: int, compression: Optional[float] = None,
             hash_mode: HashMode = HashMode.REFERENCE):
        """``(weights, args)``: a ROBE array and the arguments of ``robe::forward`` after it.
        The same array at every call with the same sizes, so rows built apart compare."""
        s, n = self.s, len(self.s.cardinalities)
        memory = max(int(sum(s.cardinalities) * s.dim / (compression or s.compression)), block_size)
        meta = build_table_meta([s.dim] * n, [0] * n, [memory] * n, self.row_offsets,
                                list(s.cardinalities), [int(Pooling.SUM)] * n, device=self.device)
        draw = torch.Generator(self.device).manual_seed(memory)
        weights = torch.empty(memory, device=self.device).uniform_(-0.01, 0.01, generator=draw)
        return weights, (self.ids, self.offsets, None, meta, self.output_dim, block_size,
                         int(hash_mode), hash_params(hash_mode, seed=1024),
                         int(BoundsCheck.ERROR))


def triton_path(device: torch.device):
    """CUDA tensors always reach the Triton kernels; CPU tensors (Triton's interpreter) ask."""
    return contextlib.nullcontext() if device.type == "cuda" else cpu_backend("triton")


def full_table_rows(lk: Lookup, per_table: bool = True) -> List[Row]:
    """The main peer, one ``F.embedding_bag`` over the tables as one (what FBGEMM's TBE does
    in one kernel), and the second, one ``nn.EmbeddingBag`` call a table sharing its rows."""
    s = lk.s
    table_ = torch.empty(sum(s.cardinalities), s.dim, device=lk.device).uniform_(-0.01, 0.01)
    # the gradient of bag (t, b) is columns [t*D, (t+1)*D) of sample b's output gradient
    bag_grad = lk.grad.view(s.batch, -1, s.dim).transpose(0, 1).reshape(-1, s.dim).contiguous()

    def forward():
        return F.embedding_bag(lk.global_ids, table_, lk.offsets[:-1], mode="sum")

    def train():
        forward()
        rows = bag_grad if s.ids_per_bag == 1 else bag_grad.index_select(0, lk.bag_of_id)
        table_.index_add_(0, lk.global_ids, rows, alpha=-HPARAMS[0])

    rows = [Row("full table, one lookup (+ in-place SGD rows)", forward, train)]
    if per_table:
        bags = [torch.nn.EmbeddingBag.from_pretrained(table_[a:a + c], freeze=False,
                                                      mode="sum", sparse=True)
                for a, c in zip(lk.row_offsets, s.cardinalities)]
        ids, offsets = lk.ids.view(len(bags), -1), lk.offsets[:s.batch]
        grads = list(bag_grad.view(len(bags), s.batch, s.dim))

        def forward_each():
            return [bag(x, offsets) for bag, x in zip(bags, ids)]

        def train_each():
            for bag in bags:
                bag.weight.grad = None
            torch.autograd.backward(forward_each(), grads)

        rows.append(Row(f"{len(bags)} x nn.EmbeddingBag (+ sparse backward)", forward_each,
                        train_each))
    return rows


def fused_step(lk: Lookup, args: tuple, w: torch.Tensor, state: torch.Tensor,
               optimizer: Optimizer = Optimizer.SGD) -> None:
    """``robe::forward`` of ``args`` on ``w``, then ``robe::backward_fused_`` of the
    scenario's gradient (updates ``w`` and ``state``)."""
    values, offsets, _, meta, _, z, hash_mode, params, _ = args
    torch.ops.robe.forward(w, *args)
    torch.ops.robe.backward_fused_(lk.grad, w, state, state.new_empty(0), values, offsets, None,
                                   meta, z, hash_mode, params, int(optimizer), HPARAMS, 1)


def robe_rows(lk: Lookup, z: int, variants: Dict[str, dict],
              hash_mode: HashMode = HashMode.REFERENCE) -> List[Row]:
    weights, args = lk.robe(z, hash_mode=hash_mode)
    rows = []
    for label, tuning in variants.items():
        w, state = weights.clone(), torch.zeros_like(weights)
        # the default row enters no tuning block: its host time is the op's alone
        launch = (lambda t=tuning: tuned(**t)) if tuning else contextlib.nullcontext

        def forward(launch=launch):
            with torch.no_grad(), launch(), triton_path(lk.device):
                return torch.ops.robe.forward(weights, *args)

        def train(launch=launch, optimizer=Optimizer.SGD, w=w, state=state):
            with torch.no_grad(), launch(), triton_path(lk.device):
                fused_step(lk, args, w, state, optimizer)

        suffix = f", {label}" if label else ""
        rows.append(Row(f"ROBE-Z Z={z}{suffix} (+ fused SGD)", forward, train))
        if not label:
            w_a, state_a = weights.clone(), torch.zeros_like(weights)
            rows.append(Row(f"ROBE-Z Z={z} (+ fused Adagrad)", forward,
                            lambda: train(optimizer=Optimizer.ADAGRAD, w=w_a, state=state_a)))
    return rows


def mix_hash_row(lk: Lookup, z: int) -> Row:
    """The default launch on the mix hash (cheaper arithmetic than the reference hash's
    64-bit remainders; other embeddings, so its output is not compared)."""
    row = robe_rows(lk, z, {"mix hash": {}}, HashMode.MIX)[0]
    row.compared, row.note = False, "another hash: output not compared"
    return row


def captured(fn: Callable[[], object]) -> Tuple["torch.cuda.CUDAGraph", object]:
    """``(graph, output)``: ``fn`` run once on a side stream (torch asks for a warm-up off the
    capturing stream), then captured in a CUDA graph; replaying it rewrites ``output``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        output = fn()
    return graph, output


def graph_row(lk: Lookup, z: int) -> Row:
    """The default forward, and the forward with fused SGD, each captured once in a CUDA
    graph and replayed: no host work a call but the replay's. The forward returns the
    graph's output, which :func:`compare_variants` checks against the eager forward."""
    weights, args = lk.robe(z)
    w, state = weights.clone(), torch.zeros_like(weights)
    forward_graph, output = captured(lambda: torch.ops.robe.forward(weights, *args))
    train_graph, _ = captured(lambda: fused_step(lk, args, w, state))

    def forward() -> torch.Tensor:
        forward_graph.replay()
        return output

    return Row(f"ROBE-Z Z={z}, replayed CUDA graphs (+ fused SGD)", forward, train_graph.replay)


def floor_rows(lk: Lookup, z: int, output: bool) -> List[Row]:
    rows = []
    if output:
        out = torch.empty(lk.s.batch, lk.output_dim, device=lk.device)
        rows.append(Row("floor: output write", out.zero_))
    if lk.s.ids_per_bag > 1:  # the pooling pass alone, from starts hashed beforehand
        weights, (values, offsets, _, meta, output_dim, _, hash_mode, params, _) = lk.robe(z)
        starts = triton_kernels.hash_starts(weights, values, offsets, meta, lk.s.dim, z,
                                            hash_mode, params)
        rows.append(Row(f"floor: L2 block reads + pooling, Z={z}",
                        lambda: triton_kernels.forward_from_starts(
                            weights, values, offsets, meta, output_dim, lk.s.dim, z, starts)))
        rows.append(block_bag_row(lk, z, weights, starts))
    return rows


def block_bag_row(lk: Lookup, z: int, weights: torch.Tensor, starts: torch.Tensor) -> Row:
    """PyTorch's own gather-and-pool on the same reads: ``F.embedding_bag`` over the array
    seen as a ``[M / Z, Z]`` table, one bag per (bag, block of the row) holding the blocks
    its ids hash to, moved down to a multiple of Z (an unaligned block can touch one more
    32-byte sector). The output stays in (block, bag) order: a floor, not a drop-in."""
    num_bags, per_bag = lk.offsets.numel() - 1, lk.s.ids_per_bag
    num_blocks = starts.shape[1]
    table_ = weights[:weights.numel() // z * z].view(-1, z)
    rows_of = (starts.long() // z).clamp(max=table_.shape[0] - 1)
    indices = rows_of.view(num_bags, per_bag, num_blocks).transpose(1, 2).reshape(-1)
    bag_offsets = torch.arange(num_bags * num_blocks, device=lk.device) * per_bag
    return Row(f"floor: F.embedding_bag of the same blocks, [M/Z, Z] table, Z={z}",
               lambda: F.embedding_bag(indices, table_, bag_offsets, mode="sum"))


def time_rows(rows: Sequence[Row], timer: DeviceTimer, reps: int, inner: int, warmup: int) -> None:
    """Time every row, interleaved. A row whose first calls raise (a launch variant that does
    not compile on this GPU, say) keeps the error in :attr:`Row.error` and is left out, so
    that it costs the section no other row."""
    for row in rows:
        try:
            row.first_ms = timer(row.train or row.forward, 1)
            for _ in range(warmup):
                row.forward()
                if row.train:
                    row.train()
            if row.train:  # the first call timed the step only
                row.forward()
        except Exception as exc:  # noqa: BLE001  reported in the section's notes
            row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            row.note = "did not run (see the notes)"
    for rep in range(reps):
        for row in list(rows[rep % len(rows):]) + list(rows[:rep % len(rows)]):
            if row.error or (row.reps is not None and rep >= row.reps):
                continue
            n = inner if row.reps is None else 1
            row.forward_ms.append(timer(row.forward, n))
            row.host_ms.append(timer.host_ms)
            if row.train:
                row.train_ms.append(timer(row.train, n))
    raise_pending_checks()


def compare_variants(rows: Sequence[Row]) -> None:
    """Each launch variant's forward against its Z's default row (relative max difference)."""
    robe = [r for r in rows if r.name.startswith("ROBE-Z") and r.name.endswith("(+ fused SGD)")
            and r.compared and not r.error]
    defaults = {r.name.split(" (")[0]: r for r in robe if "," not in r.name}
    for r in (r for r in robe if "," in r.name):
        default = defaults.get(r.name.split(",")[0])
        if default is None:  # the default row did not run
            continue
        a, b = default.forward(), r.forward()
        diff = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
        r.note = f"max rel. diff to default {diff:.1e}"


#: how much faster than the default a variant must run to be named the faster launch
#: (samples on a busy host move by a few percent)
FASTER_BY = 0.05


def fastest_variants(rows: Sequence[Row], z: int,
                     variants: Dict[str, dict]) -> List[Dict[str, object]]:
    """For the forward and the fused-SGD step at ``Z = z``: the launch variant (of
    ``variants``, label -> tuning) whose median beats the default row's by the widest margin,
    if by at least :data:`FASTER_BY`, with its tuning: what to make the default next."""
    by_name = {r.name: r for r in rows}
    default = by_name.get(f"ROBE-Z Z={z} (+ fused SGD)")
    found = []
    for measure in ("forward", "train"):
        if default is None or math.isnan(default.median(measure)):  # not timed
            continue
        best: Dict[str, object] = {"Z": z, "measure": measure, "variant": "", "tuning": {},
                                   "ratio": 1.0}
        for label, tuning in variants.items():
            row = by_name.get(f"ROBE-Z Z={z}, {label} (+ fused SGD)") if label else None
            if row is None:
                continue
            ratio = row.median(measure) / default.median(measure)
            if ratio <= 1.0 - FASTER_BY and ratio < best["ratio"]:
                best.update(variant=label, tuning=dict(tuning), ratio=ratio)
        found.append(best)
    return found


def fastest_lines(found: Sequence[Dict[str, object]]) -> List[str]:
    """:func:`fastest_variants` in a sentence a measure."""
    words = {"forward": "forward", "train": "forward + fused SGD"}
    lines = []
    for f in found:
        if f["variant"]:
            tuning = ", ".join(f"{k}={v!r}" for k, v in f["tuning"].items())
            lines.append(f"- Fastest launch at Z={f['Z']}, {words[f['measure']]}: "
                         f"`{f['variant']}`, {f['ratio']:.2f}x the default's time "
                         f"(`tuned({tuning})`).")
        else:
            lines.append(f"- Fastest launch at Z={f['Z']}, {words[f['measure']]}: the default "
                         f"(no variant {FASTER_BY:.0%} faster).")
    return lines


def targets(rows: Sequence[Row], s: Scenario) -> List[Dict[str, object]]:
    peer, by_name = rows[0], {r.name: r for r in rows}
    out = []

    def add(what: str, value: float, goal: float, unit: str = "x") -> None:
        out.append({"target": what, "value": value, "goal": goal, "unit": unit,
                    "met": value <= goal})

    for z in s.block_sizes:
        fwd = by_name[f"ROBE-Z Z={z} (+ fused SGD)"]
        adagrad = by_name[f"ROBE-Z Z={z} (+ fused Adagrad)"]
        add(f"Z={z} forward / full-table forward",
            fwd.median("forward") / peer.median("forward"), 0.5)
        add(f"Z={z} forward + fused SGD / full table + SGD rows",
            fwd.median("train") / peer.median("train"), 0.5)
        add(f"Z={z} forward + fused Adagrad / full table + SGD rows",
            adagrad.median("train") / peer.median("train"), 0.5)
        if s.ids_per_bag == 1:
            add(f"Z={z} forward / output-write floor",
                fwd.median("forward") / by_name["floor: output write"].median("forward"), 2.0)
            add(f"Z={z} host time a forward call", fwd.median("host") * 1e3, 40, " us")
        elif f"floor: L2 block reads + pooling, Z={z}" in by_name:
            l2 = by_name[f"floor: L2 block reads + pooling, Z={z}"]
            add(f"Z={z} forward / L2 block-read floor",
                fwd.median("forward") / l2.median("forward"), 3.0)
    return out


def scenario_rows(lk: Lookup, variants: Dict[str, dict],
                  reference_reps: int) -> Tuple[List[Row], List[str]]:
    """``(rows, notes)``: every row of a scenario, the peers first; ``variants`` are timed at
    its first Z. The CUDA-graph row only on CUDA (a failed capture is a note, not an error)."""
    s = lk.s
    rows = full_table_rows(lk)
    for i, z in enumerate(s.block_sizes):
        rows += robe_rows(lk, z, variants if i == 0 else {"": {}})
    rows.append(mix_hash_row(lk, s.block_sizes[0]))
    notes = []
    if lk.device.type == "cuda":
        try:
            rows.append(graph_row(lk, s.block_sizes[0]))
        except Exception as exc:  # noqa: BLE001  reported; a failed capture spoils no other row
            notes.append(f"- The CUDA-graph row did not run: {type(exc).__name__}: {exc}")
    if s.ids_per_bag == 1 and reference_reps:
        weights, args = lk.robe(s.block_sizes[0])
        rows.append(Row(f"pure-PyTorch ROBE-Z Z={s.block_sizes[0]}",
                        lambda: reference.forward(weights.detach(), *args), reps=reference_reps))
    for i, z in enumerate(s.block_sizes):
        rows += floor_rows(lk, z, output=i == 0)
    return rows, notes


def run_scenario(s: Scenario, device: torch.device, timer: DeviceTimer, reps: int, inner: int,
                 warmup: int, variants: Dict[str, dict], reference_reps: int):
    """``(lines, result)``: one scenario's table and targets."""
    lk = Lookup(s, device)
    rows, notes = scenario_rows(lk, variants, reference_reps)
    time_rows(rows, timer, reps, inner, warmup)
    notes += [f"- `{r.name}` did not run: {r.error}" for r in rows if r.error]
    compare_variants(rows)
    found = targets(rows, s)
    fastest = fastest_variants(rows, s.block_sizes[0], variants)
    peer = rows[0]
    cells = [[r.name, fmt(r.median("forward"), 3),
              fmt(r.median("forward") / peer.median("forward")),
              fmt(r.median("host") * 1e3, 0), fmt(r.median("train"), 3),
              fmt(r.median("train") / peer.median("train")), fmt(r.first_ms, 1), r.note]
             for r in rows]
    lines = [f"### {s.name}", "",
             f"Batch {s.batch}, dim {s.dim}, {len(s.cardinalities)} features "
             f"({sum(s.cardinalities):,} rows), {s.ids_per_bag} id(s) a bag "
             f"({lk.ids.numel():,} ids), "
             f"ROBE array {s.compression:g}x smaller than the tables (reference hash). Peer: the "
             f"first row. Medians of {reps} samples of {inner} calls.", "",
             *table(["row", "forward ms", "/ peer", "host us a call", "train ms", "/ peer",
                     "first ms", "note"], cells), "",
             *table(["target", "value", "goal", "verdict"],
                    [[t["target"], f"{t['value']:.2f}{t['unit']}", f"<= {t['goal']:g}{t['unit']}",
                      "met" if t["met"] else "missed"] for t in found]), "",
             *fastest_lines(fastest), "", *notes]
    return lines, {"scenario": s.name, "rows": [r.json() for r in rows], "targets": found,
                   "fastest": fastest}


def single_table(device: torch.device, timer: DeviceTimer, reps: int, inner: int,
                 sizes: Sequence[int], compressions: Sequence[float], batch: int = 10240,
                 dim: int = 128, z: int = 32) -> Tuple[List[str], List[Dict[str, object]]]:
    """The paper's single-table setting (its appendix): one table, one id a bag, the plain
    lookup beside ROBE-Z at each compression; forward ms, host us a call in brackets."""
    lines = ["### One table (the paper's setting)", "",
             f"Batch {batch}, dim {dim}, one id a bag, Z = {z}; forward ms (median of {reps} x "
             f"{inner} calls), host us a call in brackets. The paper: plain lookup 0.12 ms, "
             "ROBE-Z 0.27 ms on its GPU.", ""]
    cells, results = [], []
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**34
    for n in sizes:
        lk = Lookup(Scenario(f"one table, {n} rows", batch, dim, [n], 1, [z], 1.0), device)
        fits = n * dim * 4 < 0.6 * free
        rows = full_table_rows(lk, per_table=False) if fits else []
        for c in compressions:
            weights, args = lk.robe(z, c)
            rows.append(Row(f"ROBE-Z {c:g}x", lambda w=weights, a=args: _forward(w, a, device)))
        time_rows(rows, timer, reps, inner, warmup=2)
        medians = [(r.median("forward"), r.median("host") * 1e3) for r in rows]
        cells.append([f"{n:,}", *([] if fits else ["n/a (over 60% of free memory)"]),
                      *(f"{ms:.3f} ({us:.0f})" for ms, us in medians)])
        results += [{**r.json(), "table_rows": n} for r in rows]
        del lk, rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    heads = ["rows n", "plain lookup", *(f"ROBE-Z {c:g}x" for c in compressions)]
    return lines + table(heads, cells) + [""], results


def _forward(weights: torch.Tensor, args: tuple, device: torch.device) -> torch.Tensor:
    with torch.no_grad(), triton_path(device):
        return torch.ops.robe.forward(weights, *args)
