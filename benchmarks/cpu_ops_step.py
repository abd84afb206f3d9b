"""One training step of each implementation against the others and the floor: the rows of
:mod:`benchmarks.cpu_ops` (full table, FBGEMM TBE, pure-PyTorch ROBE-Z, ours), their
timing loop, tables and targets."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.cpu_ops_common import (
    ADAGRAD_EPS, ADAM_BETAS, ADAM_EPS, Batch, FWD_RATIO_VS_FULL, FWD_SPEEDUP_VS_PYTORCH, Floor,
    HASHING_SHARE, HASH_SEED, LINE_FLOATS, LOSS_TEXT, LR, OPTIMIZERS, Runner, STEP_RATIO_VS_FULL,
    STEP_SPEEDUP_VS_PYTORCH, Sizes, Unavailable, _div, fmt, markdown_table, mb, optimizer_spec,
    torch_optimizer)
from robe_torchrec.fused_lookup import fused_lookup
from robe_torchrec.hashing import HashMode, block_starts, hash_params
from robe_torchrec.ops import LayoutArgs, LookupArgs, cpu_backend
from robe_torchrec.ops import meta as m
from robe_torchrec.ops import reference
from robe_torchrec.optim import RobeFusedOptimizer

class FullTable(Runner):
    def __init__(self, sizes: Sizes, optimizer: str, sparse: bool):
        self.emb = nn.EmbeddingBag(sizes.num_embeddings, sizes.dim, mode="sum", sparse=sparse,
                                   include_last_offset=True)
        self.opt = torch_optimizer(optimizer, self.emb.parameters(), sparse)
        self.size_floats = sizes.num_embeddings * sizes.dim

    def forward(self, batch: Batch) -> Tensor:
        return self.emb(batch.values, batch.offsets)  # [2B, D], feature-major

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def finite(self) -> bool:
        return bool(torch.isfinite(self.emb.weight).all())


def fbgemm_optim(name: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return getattr(EmbOptimType, name)


def build_tbe(num_embeddings: int, dim: int, optim_name: str):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    eps = ADAGRAD_EPS if "ADAGRAD" in optim_name else ADAM_EPS
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(num_embeddings, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        feature_table_map=[0, 0],
        optimizer=fbgemm_optim(optim_name),
        learning_rate=LR,
        eps=eps,
        beta1=ADAM_BETAS[0],
        beta2=ADAM_BETAS[1],
        pooling_mode=PoolingMode.SUM,
    )


def fbgemm_support(optim_name: str) -> Optional[str]:
    """None if FBGEMM's CPU TBE trains with this optimizer, else FBGEMM's reason."""
    try:
        tbe = build_tbe(16, 8, optim_name)
        values = torch.tensor([1, 2, 3, 4])
        tbe(values, torch.arange(5)).sum().backward()
    except ImportError as exc:
        return f"fbgemm_gpu not importable: {exc}"
    except Exception as exc:  # FBGEMM asserts on unsupported optimizers
        text = str(exc).strip().splitlines()
        return text[0] if text else type(exc).__name__
    return None


class Fbgemm(Runner):
    def __init__(self, sizes: Sizes, optim_name: str):
        reason = fbgemm_support(optim_name)
        if reason is not None:
            raise Unavailable(reason)
        self.tbe = build_tbe(sizes.num_embeddings, sizes.dim, optim_name)
        self.dim = sizes.dim
        self.size_floats = sizes.num_embeddings * sizes.dim

    def forward(self, batch: Batch) -> Tensor:
        return self.tbe(batch.values, batch.offsets)  # [B, 2D]

    def halves(self, out: Tensor) -> Tuple[Tensor, Tensor]:
        return out[:, : self.dim], out[:, self.dim :]  # [B, 2D]; backward runs the fused update

    def finite(self) -> bool:
        return all(bool(torch.isfinite(w).all()) for w in self.tbe.split_embedding_weights())


def _cpp_aids() -> bool:
    """Whether the C++ kernel exposes its profiling aids (cpu.forward_hash_only: the
    forward's hashing alone; cpu.forward_gather_only: all but its output stores)."""
    try:
        from robe_torchrec.ops import cpu
    except Exception:  # noqa: BLE001
        return False
    return hasattr(cpu, "forward_hash_only") and hasattr(cpu, "forward_gather_only")


class Robe(Runner):
    """ROBE-Z through torch.ops.robe.* (the backend is picked by the caller's cpu_backend)."""

    def __init__(self, sizes: Sizes, optimizer: str, memory: int, block_size: int,
                 mode: str, hash_mode: HashMode, split: str, backend: str = "reference"):
        self.sizes, self.memory, self.block_size, self.mode = sizes, memory, block_size, mode
        self.hash_mode = hash_mode
        self.params = hash_params(hash_mode, HASH_SEED)
        self.split = split
        if split == "estimate" and backend == "cpp" and _cpp_aids():
            self.split = "kernel"
        d, n = sizes.dim, sizes.num_embeddings
        # The two lookups of a sample read the same array with the same keys, so they are one
        # feature of 2B bags (as the full-table row's single EmbeddingBag call over 2B bags):
        # output [2B, D], and every row computes the same loss on the same layout.
        self.meta = m.build_table_meta(dims=[d], weight_offsets=[0], weight_sizes=[memory],
                                       row_offsets=[0], num_rows=[n], poolings=[m.Pooling.SUM])
        self.layout_args = LayoutArgs(self.meta, d, block_size, int(hash_mode), self.params,
                                      int(m.BoundsCheck.ERROR))
        bound = math.sqrt(1.0 / n)  # the reference DLRM's init
        weights = torch.empty(memory).uniform_(-bound, bound)
        self.size_floats = memory
        if mode == "dense":
            self.weights = nn.Parameter(weights)
            self.opt = torch_optimizer(optimizer, [self.weights], sparse=False)
        else:
            # the package's fused path: robe::backward_fused_ updates inside backward
            self.weights = weights
            self.fused_opt = RobeFusedOptimizer("weight", weights, *optimizer_spec(optimizer))
        self._split_inputs: List[object] = []

    def lookup(self, values: Tensor, offsets: Tensor) -> Tensor:
        return LookupArgs(values, offsets, None, self.layout_args).forward(self.weights)

    def forward(self, batch: Batch) -> Tensor:
        if self.mode == "dense":
            return self.lookup(batch.values, batch.offsets)
        args = LookupArgs(batch.values, batch.offsets, None, self.layout_args)
        return fused_lookup(self.weights, self.fused_opt, args)

    def step(self) -> None:
        if self.mode == "dense":
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def finite(self) -> bool:
        return bool(torch.isfinite(self.weights).all())

    # --- the forward split -------------------------------------------------------------

    def _columns(self) -> List[List[int]]:
        return [[int(v) for v in self.meta[:, t].tolist()] for t in range(self.meta.shape[1])]

    def prepare(self, batches: Sequence[Batch]) -> None:
        b = self.sizes.batch
        if self.split == "estimate":
            # block starts of both features, laid out [B, 2 * blocks] like the output
            blocks = math.ceil(self.sizes.dim / self.block_size)
            for batch in batches:
                starts = block_starts(batch.values, blocks, self.memory, self.block_size,
                                      self.hash_mode, self.params)
                self._split_inputs.append(starts.contiguous())
        elif self.split == "exact":
            self._samples = torch.arange(2 * b)
            self._scale = torch.ones(2 * b)

    def extra(self, index: int, batch: Batch) -> Dict[str, float]:
        with torch.no_grad():
            if self.split == "kernel":
                return {"hashing": self._hash_only(batch)}
            if self.split == "estimate":
                return {"lookup": self._block_gather(self._split_inputs[index])}
            if self.split == "exact":
                return self._reference_split(batch)
        return {}

    def _hash_only(self, batch: Batch) -> float:
        """The C++ forward's loops and hashing without gathers and writes (cpu.forward_hash_only)."""
        from robe_torchrec.ops import cpu

        args = LookupArgs(batch.values, batch.offsets, None, self.layout_args)
        t0 = time.perf_counter()
        cpu.forward_hash_only(self.weights.detach(), *args.flat())
        return time.perf_counter() - t0

    def gather_only(self, batch: Batch) -> Tensor:
        """The C++ forward without its output stores (cpu.forward_gather_only): hashing,
        gathers and pooling; returns the pooled rows' sum, [D]."""
        from robe_torchrec.ops import cpu

        args = LookupArgs(batch.values, batch.offsets, None, self.layout_args)
        return cpu.forward_gather_only(self.weights.detach(), *args.flat())

    def backward_dense(self, batch: Batch, grad: Tensor) -> Tensor:
        """The dense weight gradient of the forward for output gradient ``grad``."""
        args = LookupArgs(batch.values, batch.offsets, None, self.layout_args)
        return args.backward_dense(grad, self.weights.detach())

    def touched_lines(self, batch: Batch) -> Tensor:
        """Index of every 64-byte line of the array each (id, block) gather of ``batch``
        reads, in gather order (a block of Z floats spans 1 to 3 lines)."""
        blocks = math.ceil(self.sizes.dim / self.block_size)
        starts = block_starts(batch.values, blocks, self.memory, self.block_size, self.hash_mode,
                              self.params).reshape(-1)
        first = starts // LINE_FLOATS
        count = (starts + self.block_size - 1) // LINE_FLOATS - first + 1
        lines = torch.repeat_interleave(first, count)
        begin = torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
        return lines + (torch.arange(lines.numel()) - begin)

    def _block_gather(self, starts: Tensor) -> float:
        """The pooled lookup from precomputed block starts (one id per bag: no pooling)."""
        z, w = self.block_size, self.weights.detach()
        t0 = time.perf_counter()
        blocks = w.as_strided((self.memory - z + 1, z), (1, 1))
        out = F.embedding(starts, blocks).reshape(2 * self.sizes.batch, self.sizes.dim)
        t1 = time.perf_counter()
        del out
        return t1 - t0

    def _reference_split(self, batch: Batch) -> Dict[str, float]:
        """Hashing and gather + pool of reference.forward, timed apart (same operations)."""
        b, d, w = self.sizes.batch, self.sizes.dim, self.weights.detach()
        col = self._columns()[0]
        t0 = time.perf_counter()
        idx = reference.element_indices(batch.values, col, self.block_size, int(self.hash_mode),
                                        self.params)
        t1 = time.perf_counter()
        out = w.new_zeros(2 * b, d)
        out.index_add_(0, self._samples, w[idx] * self._scale[:, None])
        t2 = time.perf_counter()
        return {"hashing": t1 - t0, "lookup": t2 - t1}




# ---------------------------------------------------------------------------------------
# row specs
# ---------------------------------------------------------------------------------------

@dataclass
class RowSpec:
    key: str           # stable id used by the targets, e.g. "ours-fused-2621440-z32"
    model: str         # the table's "model" column
    optimizer: str
    gradient: str      # sparse | dense | fused
    floats: int
    block_size: Optional[int]
    build: Callable[[], Runner]
    backend: Optional[str] = None  # cpu_backend for ROBE rows
    note: str = ""
    loss: str = "pair"


def robe_key(kind: str, memory: int, z: int) -> str:
    return f"{kind}-{memory}-z{z}"


def floor_key(memory: int) -> str:
    return f"floor-{memory}"


def row_specs(sizes: Sizes, optimizer: str, groups: Sequence[str], hash_mode: HashMode,
              ours_backend: str) -> List[RowSpec]:
    full = sizes.num_embeddings * sizes.dim
    specs: List[RowSpec] = []
    if "floor" in groups:
        for memory in sizes.robe_sizes:
            specs.append(RowSpec(floor_key(memory), "floor", optimizer, "dense", memory, None,
                                 (lambda memory=memory: Floor(sizes, optimizer, memory)),
                                 note="write the output; backward reads its gradient once"))
    if "full" in groups:
        sparse_note = "torch.optim.SparseAdam" if optimizer == "adam" else ""
        specs.append(RowSpec("full-sparse", "full table", optimizer, "sparse", full, None,
                             lambda: FullTable(sizes, optimizer, sparse=True), note=sparse_note))
        specs.append(RowSpec("full-dense", "full table", optimizer, "dense", full, None,
                             lambda: FullTable(sizes, optimizer, sparse=False)))
    if "fbgemm" in groups:
        names = {"sgd": ["EXACT_SGD"], "adagrad": ["EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"],
                 "adam": ["ADAM", "PARTIAL_ROWWISE_ADAM"]}[optimizer]
        for i, name in enumerate(names):
            key = "fbgemm" if i == 0 else f"fbgemm-{name.lower()}"
            specs.append(RowSpec(key, "fbgemm TBE", optimizer, "fused", full, None,
                                 (lambda name=name: Fbgemm(sizes, name)), note=name))
    if "pytorch" in groups:
        for memory in sizes.robe_sizes:
            specs.append(RowSpec(
                robe_key("pytorch", memory, sizes.block_size), "pytorch ROBE-Z", optimizer,
                "dense", memory, sizes.block_size,
                (lambda memory=memory: Robe(sizes, optimizer, memory, sizes.block_size, "dense",
                                            hash_mode, split="exact")),
                backend="reference"))
    if "ours" in groups:
        configs = [(memory, sizes.block_size) for memory in sizes.robe_sizes]
        configs.append((sizes.small_block_array, sizes.small_block_size))
        note = "" if ours_backend == "cpp" else f"backend={ours_backend} (not the C++ kernel)"
        for memory, z in configs:
            for mode in ("dense", "fused"):
                specs.append(RowSpec(
                    robe_key(f"ours-{mode}", memory, z), "ours", optimizer, mode, memory, z,
                    (lambda memory=memory, z=z, mode=mode: Robe(
                        sizes, optimizer, memory, z, mode, hash_mode, split="estimate",
                        backend=ours_backend)),
                    backend=ours_backend, note=note))
    return specs


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------

@dataclass
class Result:
    spec: RowSpec
    threads: int
    phases: Dict[str, float] = field(default_factory=dict)  # ms, medians
    split: str = ""
    notes: List[str] = field(default_factory=list)
    unavailable: Optional[str] = None


def one_iteration(runner: Runner, batch: Batch, index: int) -> Dict[str, float]:
    """One timed train step of ``runner`` (seconds per phase) and its forward split.
    ``cpu total`` is the calling thread's CPU time for the step: at 1 thread all of the
    step's work, and not inflated by time spent descheduled on a busy machine."""
    c0 = time.thread_time()
    t0 = time.perf_counter()
    out = runner.forward(batch)
    t1 = time.perf_counter()
    runner.backward(out)
    t2 = time.perf_counter()
    runner.step()
    t3 = time.perf_counter()
    c3 = time.thread_time()
    del out
    row = {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "total": t3 - t0,
           "cpu total": c3 - c0}
    row.update(runner.extra(index, batch))
    return row


def backend_of(spec: "RowSpec") -> Callable[[], contextlib.AbstractContextManager]:
    """A fresh context (each is single-use) running the ops on the row's CPU backend."""
    return (lambda: cpu_backend(spec.backend)) if spec.backend else contextlib.nullcontext


def time_runners(runners: Sequence[Tuple[Runner, Callable[[], contextlib.AbstractContextManager]]],
                 batches: Sequence[Batch], warmup: int, iters: int) -> List[Dict[str, float]]:
    """Median ms per phase of each runner; every iteration steps all runners back to back
    (in alternating order, each under its own backend), so load hits them alike."""
    samples: List[Dict[str, List[float]]] = [{} for _ in runners]
    for it in range(warmup + iters):
        index = it % len(batches)
        order = list(range(len(runners)))
        for i in order if it % 2 == 0 else reversed(order):
            runner, backend = runners[i]
            with backend():
                row = one_iteration(runner, batches[index], index)
            if it >= warmup:
                for k, v in row.items():
                    samples[i].setdefault(k, []).append(v)
    return [{k: statistics.median(v) * 1e3 for k, v in s.items()} for s in samples]


def check_against_reference(runner: Runner, batch: Batch, sizes: Sizes) -> Optional[str]:
    """Compare the row's forward with the reference ops on a slice of the batch."""
    if not isinstance(runner, Robe):
        return None
    n = min(sizes.batch, 1024)
    b = sizes.batch
    values = torch.cat([batch.values[:n], batch.values[b : b + n]])
    offsets = torch.arange(2 * n + 1, dtype=torch.int64)
    with torch.no_grad():
        got = runner.lookup(values, offsets)
        with cpu_backend("reference"):
            want = runner.lookup(values, offsets)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return f"MISMATCH vs reference forward (max abs diff {float((got - want).abs().max()):.3g})"
    return None


def _error_text(exc: Exception) -> str:
    if isinstance(exc, Unavailable):
        return str(exc)
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run_specs(specs: Sequence[RowSpec], threads: Sequence[int], batches: Sequence[Batch],
              sizes: Sizes, warmup: int, iters: int) -> List[Result]:
    """Times the rows of ``specs`` together, interleaved iteration by iteration, at each
    thread count; a row that cannot be built or fails is reported and the others go on."""
    results = {id(spec): [Result(spec, k) for k in threads] for spec in specs}
    live: List[Tuple[RowSpec, Runner, Callable[[], contextlib.AbstractContextManager]]] = []

    def fail(spec: RowSpec, exc: Exception) -> None:
        for res in results[id(spec)]:
            res.unavailable = _error_text(exc)

    for spec in specs:
        backend = backend_of(spec)
        try:
            with backend():
                runner = spec.build()
                runner.loss = spec.loss
                runner.prepare(batches)
                warning = check_against_reference(runner, batches[0], sizes)
        except Exception as exc:  # a row failing must not lose the others
            fail(spec, exc)
            continue
        for res in results[id(spec)]:
            res.split = runner.split
            if warning:
                res.notes.append(warning)
        live.append((spec, runner, backend))
    try:
        for j, k in enumerate(threads):
            torch.set_num_threads(k)
            phases = time_runners([(r, b) for _, r, b in live], batches, warmup, iters)
            for (spec, _, _), p in zip(live, phases):
                results[id(spec)][j].phases = p
        for spec, runner, backend in live:
            if not runner.finite():
                for res in results[id(spec)]:
                    res.notes.append("non-finite weights after training")
    except Exception as exc:  # the group's timing failed: report it on every row of the group
        for spec, _, _ in live:
            fail(spec, exc)
    finally:
        big = any(r.size_floats > 10_000_000 for _, r, _ in live)
        live.clear()
        if big:
            gc.collect()
    return [res for spec in specs for res in results[id(spec)]]


# ---------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------

COLUMNS = ("model", "loss", "optimizer", "gradient", "floats", "Z", "forward", "hashing", "lookup",
           "other", "backward", "optimizer step", "total", "forward / floor", "total / floor",
           "CPU total", "CPU total / floor", "model MB", "notes")
TEXT_COLUMNS = ("model", "loss", "optimizer", "gradient", "floats", "Z", "forward / floor",
                "total / floor", "CPU total / floor", "model MB", "notes")





def floor_of(res: Result, floors: Dict[Tuple[int, str, str, int], Result],
             sizes: Sizes) -> Optional[Result]:
    """The floor row of ``res``: same threads, optimizer, loss and array size (rows without
    an array of one of the ROBE sizes: the smallest one's)."""
    memory = res.spec.floats if res.spec.floats in sizes.robe_sizes else min(sizes.robe_sizes)
    return floors.get((res.threads, res.spec.optimizer, res.spec.loss, memory))


def floor_index(results: Sequence[Result]) -> Dict[Tuple[int, str, str, int], Result]:
    return {(r.threads, r.spec.optimizer, r.spec.loss, r.spec.floats): r for r in results
            if r.spec.model == "floor" and r.unavailable is None and r.phases}


def ratio_text(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def result_cells(res: Result, floor: Optional[Result] = None) -> List[str]:
    s = res.spec
    head = [s.model, LOSS_TEXT[s.loss], s.optimizer, s.gradient, f"{s.floats:,}",
            str(s.block_size or "-")]
    notes = [n for n in [s.note] + res.notes if n]
    if res.unavailable is not None:
        return head + ["n/a"] * 11 + [f"{mb(s.floats):.1f}", "; ".join(notes + [res.unavailable])]
    p = res.phases
    hashing = lookup = other = None
    prefix = ""
    if res.split == "exact":
        hashing, lookup = p["hashing"], p["lookup"]
        other = p["forward"] - hashing - lookup
    elif res.split == "kernel":
        hashing = p["hashing"]
        lookup = max(p["forward"] - hashing, 0.0)
        prefix = "~"
    elif res.split == "estimate":
        prefix = "~"
        lookup = p["lookup"]
        hashing = max(p["forward"] - lookup, 0.0)
    optimizer = p["optimizer"] if s.gradient != "fused" else 0.0
    if s.gradient == "fused":
        notes.append("update fused in backward")
    hashing_prefix = "" if res.split == "kernel" else prefix
    fp = floor.phases if floor is not None else {}
    return head + [fmt(p["forward"]), fmt(hashing, hashing_prefix), fmt(lookup, prefix), fmt(other),
                   fmt(p["backward"]), fmt(optimizer), fmt(p["total"]),
                   ratio_text(_div(p["forward"], fp.get("forward"))),
                   ratio_text(_div(p["total"], fp.get("total"))),
                   fmt(p.get("cpu total")), ratio_text(_div(p.get("cpu total"), fp.get("cpu total"))),
                   f"{mb(s.floats):.1f}", "; ".join(notes)]




def results_tables(results: Sequence[Result], threads: Sequence[int], sizes: Sizes) -> str:
    floors = floor_index(results)
    parts = []
    for k in threads:
        rows = [result_cells(r, floor_of(r, floors, sizes)) for r in results if r.threads == k]
        header = [c if c in TEXT_COLUMNS else f"{c} (ms)" for c in COLUMNS]
        parts.append(f"### {k} thread{'s' if k > 1 else ''}\n\n" + markdown_table(header, rows))
    return "\n\n".join(parts)


def targets_section(results: Sequence[Result], threads: Sequence[int], sizes: Sizes) -> str:
    # the targets of this section are stated for the loss sum(e1*e2)
    index = {(r.threads, r.spec.optimizer, r.spec.key): r for r in results
             if r.unavailable is None and r.phases and r.spec.loss == "pair"}

    def get(k, opt, key, phase):
        r = index.get((k, opt, key))
        return None if r is None else r.phases.get(phase)

    table = Targets()
    add = table.add

    z = sizes.block_size
    opts = [o for o in OPTIMIZERS if any(r.spec.optimizer == o for r in results)]
    for k in threads:
        for opt in opts:
            for memory in sizes.robe_sizes:
                ref = robe_key("pytorch", memory, z)
                dense, fused = robe_key("ours-dense", memory, z), robe_key("ours-fused", memory, z)
                case = f"M={memory:,} Z={z}"
                f_ref, f_ours = get(k, opt, ref, "forward"), get(k, opt, dense, "forward")
                add("forward speedup vs pytorch ROBE-Z", case, k, opt,
                    _div(f_ref, f_ours), FWD_SPEEDUP_VS_PYTORCH, True)
                for mode, key in (("dense", dense), ("fused", fused)):
                    add("step speedup vs pytorch ROBE-Z", f"{case}, ours {mode}", k, opt,
                        _div(get(k, opt, ref, "total"), get(k, opt, key, "total")),
                        STEP_SPEEDUP_VS_PYTORCH, True)
                f_full = get(k, opt, "full-sparse", "forward")
                add("forward ratio vs full table (sparse)", case, k, opt,
                    _div(f_ours, f_full), FWD_RATIO_VS_FULL, False)
                for mode, key in (("dense", dense), ("fused", fused)):
                    add("step ratio vs full table (sparse)", f"{case}, ours {mode}", k, opt,
                        _div(get(k, opt, key, "total"), get(k, opt, "full-sparse", "total")),
                        STEP_RATIO_VS_FULL, False)
        # hashing share: the forward does not depend on the optimizer; median over the rows
        for memory, zz in [(mm, z) for mm in sizes.robe_sizes] + [
                (sizes.small_block_array, sizes.small_block_size)]:
            shares = []
            for opt in opts:
                for mode in ("dense", "fused"):
                    r = index.get((k, opt, robe_key(f"ours-{mode}", memory, zz)))
                    if r is None or r.phases.get("forward", 0) <= 0:
                        continue
                    fwd = r.phases["forward"]
                    if r.split == "kernel":
                        shares.append(r.phases["hashing"] / fwd)
                    elif r.split == "estimate":
                        shares.append(max(fwd - r.phases["lookup"], 0.0) / fwd)
            add("our hashing share of forward (~)", f"M={memory:,} Z={zz}", k, "all",
                statistics.median(shares) if shares else None, HASHING_SHARE, False, unit="%")
    return table.render()


class Targets:
    """Rows of target checks: value, goal, verdict and margin (how far past the goal)."""

    def __init__(self) -> None:
        self.rows: List[List[str]] = []
        self.counts = {"PASS": 0, "MISS": 0}

    def add(self, target: str, case: str, k: int, opt: str, value: Optional[float], goal: float,
            higher_is_better: bool, unit: str = "x") -> None:
        if value is None:
            self.rows.append([target, case, str(k), opt, "n/a", "", "n/a", ""])
            return
        margin = value / goal if higher_is_better else (goal / value if value > 0 else math.inf)
        verdict = "PASS" if margin >= 1 else "MISS"
        self.counts[verdict] += 1
        goal_text = (">= " if higher_is_better else "<= ") + (f"{goal:g}{unit}" if unit == "x"
                                                               else f"{goal:.0%}")
        value_text = f"{value:.2f}x" if unit == "x" else f"{value:.1%}"
        self.rows.append([target, case, str(k), opt, value_text, goal_text, verdict, f"{margin:.2f}"])

    def render(self) -> str:
        header = ["target", "case", "threads", "optimizer", "value", "goal", "verdict", "margin"]
        summary = (f"{self.counts['PASS']} PASS, {self.counts['MISS']} MISS. margin = how far "
                   "past the goal (value/goal for speedups, goal/value for ratios and shares): "
                   ">= 1 passes (met), < 1 misses.")
        return summary + "\n\n" + markdown_table(header, self.rows)
