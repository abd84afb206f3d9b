"""CPU benchmark of one training step: full table, FBGEMM TBE, pure-PyTorch ROBE-Z, our C++ ops.

The setup of the seed benchmarks (seeds 000/001): batch 32768, a *pair model* (two lookups of
one id per sample into one table / ROBE array, SUM pooling, dim 64; every row does them as one
call over 2B bags, so all rows compute the same loss on the same [2B, D] layout), ids uniform in
``[0, 1_562_500)``, loss ``sum(e1 * e2)`` over the two pooled embeddings. Rows, for each of
SGD, Adagrad and Adam:

* ``full table``: ``nn.EmbeddingBag(1_562_500, 64)`` (100M floats, 381.5 MB), sparse gradients
  (``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam``) and dense gradients (``SGD`` / ``Adagrad``
  / ``Adam``);
* ``fbgemm TBE``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU (``HOST`` / ``CPU``)
  with its fused optimizer (whatever FBGEMM supports on CPU; the others are ``n/a`` with
  FBGEMM's own error message);
* ``pytorch ROBE-Z``: :mod:`robe_torchrec.ops.reference` (the vectorised pure-PyTorch ROBE-Z),
  dense gradient + ``torch.optim``, arrays of 262,144 and 2,621,440 floats, Z = 32;
* ``ours``: the C++ ops (``cpu_backend("cpp")``), dense gradient + ``torch.optim`` and fused
  (the package's :func:`robe_torchrec.fused_lookup.fused_lookup`, whose
  ``robe::backward_fused_`` applies the optimizer inside backward), same arrays, Z = 32, plus
  Z = 8 rows at 2,621,440 floats;
* ``floor``: the step floor of each array size: the same loss and ``torch.optim`` optimizer
  around an embedding whose forward only writes its output from a cache-resident source
  (the forward floor) and whose backward only reads its gradient once.

Every row runs with each loss of ``--losses``: ``sum(e1*e2)`` (the seed benchmarks') and
``sum(outputs)`` (whose backward is little more than the embedding's own). Each row reports
its forward and total over the floor's; a separate section times our forward alone against
the forward floor for both hashes, Z = 8 and 32 and both arrays, interleaved; another sets
our backward against one read of its gradient. The targets against the floors (forward <=
1.5x its floor at 1 thread, 2 threads <= 0.6x our 1-thread forward, step <= 1.5x the step
floor with ``sum(outputs)``) are reported met or missed with margins; the 2-thread target
beside the machine's own 2-thread scaling (a compute-bound matmul, same loop).

The forward section also profiles each case at 1 thread, in the same interleaved loop: the
C++ kernel's hashing alone (``cpu.forward_hash_only``), its hashing + gathers without the
output stores (``cpu.forward_gather_only``), a read of every cache line its gathers touch
(:func:`read_lines`), its dense-gradient backward and one read of that gradient. From them
the report splits the forward into hash / gather / store, sets it against the floor of the
algorithm (store + hash + lines) and says what stands between the kernel and the floor.

Columns (milliseconds, median over ``--iters`` iterations after ``--warmup``):

* ``forward``: the embedding call alone (one call covers both features);
* ``hashing`` / ``lookup`` / ``other``: the split of the forward. Pure-PyTorch ROBE-Z: timed
  exactly, hashing = ``reference.element_indices`` of both features, lookup = the reference's
  gather + pool with those indices, other = forward - hashing - lookup (input validation,
  slicing). Ours with the C++ kernel: hashing = ``cpu.forward_hash_only`` (the kernel's own
  hash pass, without prefetches, gathers and output writes), lookup = forward - hashing
  (marked ``~``). Ours with another backend (testing only; marked ``~``): lookup = the same
  pooled lookup from precomputed block starts (``F.embedding`` over a stride-1 ``as_strided``
  view of the array, which copies whole Z-float blocks: exact for one id per bag), hashing =
  forward - lookup (clipped at 0);
* ``backward``: loss + ``loss.backward()`` (gradient computation; includes the update for fused
  rows);
* ``optimizer``: ``optimizer.step()`` + ``zero_grad(set_to_none=True)`` (0 when fused);
* ``total``: the median of the per-iteration sum forward + backward + optimizer;
* ``model MB``: the learned weights (optimizer state not counted).

Every row uses the same pre-generated batches. The rows of one loss and optimizer whose
arrays hold at most 10M floats (floors, pytorch ROBE-Z, ours) are built together and timed
interleaved, one train step of each in turn (in alternating order), so the load of other
processes hits a row and its floor alike; full tables (hundreds of MB each) run alone. All
thread counts run in one process, so every ratio in the "targets" sections comes from one run.

Run::

    python -m benchmarks.cpu_ops                      # threads 1 and 2
    python -m benchmarks.cpu_ops --quick              # tiny sizes (smoke test)
    python -m benchmarks.cpu_ops --out benchmarks/results/cpu_ops.md
    python -m benchmarks.cpu_ops --rows floor ours    # only what the floor targets need
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from robe_torchrec.fused_lookup import fused_lookup
from robe_torchrec.hashing import HashMode, block_starts, hash_params
from robe_torchrec.ops import LayoutArgs, LookupArgs, cpu_backend
from robe_torchrec.ops import meta as m
from robe_torchrec.ops import reference
from robe_torchrec.optim import RobeFusedOptimizer

OPTIMIZERS = ("sgd", "adagrad", "adam")
LR = 1e-3
ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
HASH_SEED = 1024

# targets checked in the "targets" section
FWD_SPEEDUP_VS_PYTORCH = 40.0
STEP_SPEEDUP_VS_PYTORCH = 20.0
FWD_RATIO_VS_FULL = 0.5
STEP_RATIO_VS_FULL = 0.2
HASHING_SHARE = 0.2


@dataclass(frozen=True)
class Sizes:
    batch: int
    num_embeddings: int
    dim: int
    robe_sizes: Tuple[int, ...]
    block_size: int
    small_block_size: int
    small_block_array: int


FULL_SIZES = Sizes(32768, 1_562_500, 64, (262_144, 2_621_440), 32, 8, 2_621_440)
QUICK_SIZES = Sizes(256, 20_000, 64, (4_096, 16_384), 32, 8, 16_384)


class Unavailable(Exception):
    """A row that cannot run here (the reason goes to the table)."""


@dataclass
class Batch:
    values: Tensor   # [2B] int64: feature 0's ids, then feature 1's
    offsets: Tensor  # [2B + 1] int64: one id per bag


def make_batches(sizes: Sizes, count: int, seed: int = 0) -> List[Batch]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        values = torch.randint(0, sizes.num_embeddings, (2 * sizes.batch,), generator=gen)
        offsets = torch.arange(2 * sizes.batch + 1, dtype=torch.int64)
        batches.append(Batch(values, offsets))
    return batches


LOSSES = ("pair", "sum")
INTERLEAVE_MAX_FLOATS = 10_000_000  # rows of arrays up to this size are timed interleaved
LOSS_TEXT = {"pair": "sum(e1*e2)", "sum": "sum(outputs)"}


def pair_loss(first: Tensor, second: Tensor) -> Tensor:
    return (first * second).sum()


def loss_of(name: str, out: Tensor, halves: Callable[[Tensor], Tuple[Tensor, Tensor]]) -> Tensor:
    """``pair``: sum(e1 * e2) over the two pooled embeddings; ``sum``: sum(outputs), whose
    gradient is all ones, so the embedding's own backward is most of the step's."""
    if name == "pair":
        return pair_loss(*halves(out))
    return out.sum()


def mb(floats: int) -> float:
    return floats * 4 / 2**20


# ---------------------------------------------------------------------------------------
# the rows
# ---------------------------------------------------------------------------------------

class Runner:
    """One model + optimizer; the timing loop calls forward, backward, step, extra."""

    size_floats: int = 0
    split: str = ""  # "exact" | "estimate" | "" (no hashing/lookup split)
    loss: str = "pair"  # one of LOSSES, set by run_specs

    def prepare(self, batches: Sequence[Batch]) -> None:
        pass

    def forward(self, batch: Batch) -> Tensor:
        raise NotImplementedError

    def halves(self, out: Tensor) -> Tuple[Tensor, Tensor]:
        """The two lookups' pooled embeddings in ``out`` (default: [2B, D], feature-major)."""
        half = out.shape[0] // 2
        return out[:half], out[half:]

    def backward(self, out: Tensor) -> None:
        loss_of(self.loss, out, self.halves).backward()

    def step(self) -> None:
        pass

    def extra(self, index: int, batch: Batch) -> Dict[str, float]:
        """Split timings (seconds) of the forward, measured outside the train step."""
        return {}

    def finite(self) -> bool:
        return True


def optimizer_spec(name: str) -> Tuple[Type[torch.optim.Optimizer], Dict[str, object]]:
    """The dense ``torch.optim`` class and kwargs of ``name`` (the fused rows get the same)."""
    if name == "sgd":
        return torch.optim.SGD, {"lr": LR}
    if name == "adagrad":
        return torch.optim.Adagrad, {"lr": LR, "eps": ADAGRAD_EPS}
    if name == "adam":
        return torch.optim.Adam, {"lr": LR, "betas": ADAM_BETAS, "eps": ADAM_EPS}
    raise ValueError(name)


def torch_optimizer(name: str, params, sparse: bool) -> torch.optim.Optimizer:
    if name == "adam" and sparse:
        return torch.optim.SparseAdam(params, lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS)
    optimizer_class, kwargs = optimizer_spec(name)
    return optimizer_class(params, **kwargs)


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
# the floors
# ---------------------------------------------------------------------------------------

FLOOR_SOURCE_ROWS = 256  # 64 KB at dim 64: the floor's source stays in L1/L2
LINE_FLOATS = 16  # floats per 64-byte cache line
LINES_PER_BAG = 64  # the line-read floor pools this many lines per output row
# The machine's own 2-thread scaling, timed in the forward section's loop: a compute-bound
# matmul (its operands fit in L2) runs at 0.50x its 1-thread time on two free cores, and
# slower when the host shares a VM's two vCPUs. A reference, not a bound: a kernel that waits
# on memory can gain more from a second thread than one that computes.
COMPUTE_REFERENCE = "compute reference"
COMPUTE_REFERENCE_SIZE = 512


def read_lines(lines: Tensor, weights: Tensor) -> Tensor:
    """The gathers' memory floor: read the array's 64-byte lines ``lines`` (each once per
    entry) with torch's embedding_bag (FBGEMM's prefetching kernel on CPU), pooling
    :data:`LINES_PER_BAG` lines per output row so that its own output stays small."""
    table = weights.detach()[: weights.numel() // LINE_FLOATS * LINE_FLOATS].view(-1, LINE_FLOATS)
    offsets = torch.arange(0, lines.numel(), LINES_PER_BAG)
    return F.embedding_bag(lines, table, offsets, mode="sum")


def floor_forward(source: Tensor, rows: int) -> Tensor:
    """The forward floor: a fresh [rows, D] float output written from the cache-resident
    ``source`` (what any lookup must at least do: allocate and write its output)."""
    out = source.new_empty(rows, source.shape[1])
    k = math.gcd(rows, source.shape[0])
    out.view(rows // k, k, -1).copy_(source[:k].expand(rows // k, k, source.shape[1]))
    return out


class _FloorLookup(torch.autograd.Function):
    """An embedding whose forward is :func:`floor_forward` and whose backward reads its
    gradient once (one sum) and hands the optimizer an all-zero gradient but for one entry."""

    @staticmethod
    def forward(ctx, weights: Tensor, source: Tensor, rows: int) -> Tensor:  # type: ignore[override]
        ctx.numel = weights.numel()
        return floor_forward(source, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        grad_weights = grad.new_zeros(ctx.numel)
        grad_weights[0] = grad.sum()
        return grad_weights, None, None


class Floor(Runner):
    """The step floor: the same loss and optimizer (``torch.optim``, on an array of
    ``memory`` floats) as the other rows around the :class:`_FloorLookup` embedding. Its
    ``read`` split is one read of a materialised [2B, D] gradient (``sum``)."""

    def __init__(self, sizes: Sizes, optimizer: str, memory: int):
        self.rows = 2 * sizes.batch
        self.source = torch.randn(FLOOR_SOURCE_ROWS, sizes.dim)
        self.weights = nn.Parameter(torch.zeros(memory))
        self.opt = torch_optimizer(optimizer, [self.weights], sparse=False)
        self.size_floats = memory
        self._grad = torch.randn(self.rows, sizes.dim)

    def forward(self, batch: Batch) -> Tensor:
        return _FloorLookup.apply(self.weights, self.source, self.rows)

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def extra(self, index: int, batch: Batch) -> Dict[str, float]:
        t0 = time.perf_counter()
        float(self._grad.sum())
        return {"read": time.perf_counter() - t0}


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


def fmt(value: Optional[float], prefix: str = "") -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{prefix}{value:.1f}"
    if abs(value) >= 1:
        return f"{prefix}{value:.2f}"
    return f"{prefix}{value:.3f}"


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


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


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


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def machine_lines() -> List[str]:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = usable_cpus()
    try:
        import fbgemm_gpu

        fbgemm = getattr(fbgemm_gpu, "__version__", "?")
    except Exception:  # noqa: BLE001
        fbgemm = "not importable"
    return [
        f"- CPU: {model}; {os.cpu_count()} logical CPUs, {usable} usable by this process",
        f"- torch {torch.__version__}, fbgemm_gpu {fbgemm}, Python {platform.python_version()}, "
        f"{platform.platform()}",
    ]


def keep_freed_memory() -> str:
    """Ask glibc's malloc to keep freed blocks of up to 32 MiB in the process instead of
    returning them to the system, and says what it did (for the report). Every forward, ours
    and the floor's, allocates a fresh 16 MiB output: whether that costs thousands of page
    faults (each a page the kernel zeroes) depended on the allocator's history, and moved the
    1-thread forward floor between 1.6 and 6.2 ms from run to run. A training loop reaches the
    same steady state; PyTorch's CPU guides recommend jemalloc or tcmalloc for it."""
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        return "allocator left as is (not glibc): fresh outputs may page-fault, timings vary more"
    return ("glibc malloc keeps freed blocks up to 32 MiB (M_MMAP_THRESHOLD 32 MiB, "
            "M_TRIM_THRESHOLD 1 GiB): fresh outputs reuse memory as in a training loop")


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def contention_warning(load_start: str) -> List[str]:
    """A warning line when other processes were already busy when the run started."""
    try:
        load = float(load_start.split()[0])
    except (ValueError, IndexError):
        return []
    if load < 0.5:
        return []
    return [f"- **warning**: 1-minute load average {load:.2f} at start on {usable_cpus()} usable "
            "CPUs: other processes shared the cores, so timings are noisy (multi-thread rows "
            "most: their threads compete with that load)"]


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_ops",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch.set_num_threads values (default: 1 2; --quick: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 10; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="warmup iterations (default 3; quick 1)")
    p.add_argument("--forward-iters", type=int, default=None,
                   help="timed iterations of the forward-floor section (default 3 x --iters)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, a few seconds)")
    p.add_argument("--hash", default="reference", choices=["reference", "mix"],
                   help="ROBE hash for the ROBE rows (default: the paper's)")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--rows", nargs="+", default=["floor", "full", "fbgemm", "pytorch", "ours"],
                   choices=["floor", "full", "fbgemm", "pytorch", "ours"],
                   help="row groups to run (the forward-floor section runs with 'ours')")
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES,
                   help="pair: sum(e1*e2); sum: sum(outputs) (default: both)")
    p.add_argument("--ours-backend", default="cpp", choices=["cpp", "triton", "reference"],
                   help="implementation behind the 'ours' rows (default cpp; others for testing)")
    p.add_argument("--out", default=None, help="also write a markdown report to this file (and its numbers to the .json beside it)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> str:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    threads = args.threads or ([1] if args.quick else [1, 2])
    iters = args.iters if args.iters is not None else (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    hash_mode = HashMode.parse(args.hash)
    allocator = keep_freed_memory()
    torch.manual_seed(0)
    start = datetime.datetime.now(datetime.timezone.utc)
    load_start = loadavg()
    batches = make_batches(sizes, count=max(1, min(warmup + iters, 8)))

    fwd: Dict[Tuple[int, str], float] = {}
    profiles: List[ForwardProfile] = []  # at 1 thread
    profiles_by_threads: Dict[int, List[ForwardProfile]] = {}
    if "ours" in args.rows:
        t0 = time.perf_counter()
        fwd = time_forwards(sizes, threads, batches, warmup, args.forward_iters or 3 * iters,
                            args.ours_backend)
        profiles_by_threads = {k: forward_profiles(fwd, sizes, k) for k in threads}
        profiles = profiles_by_threads.get(1, [])
        print(f"[{time.perf_counter() - t0:6.1f}s] forward floor section", file=sys.stderr, flush=True)
    results: List[Result] = []
    for opt, loss in [(o, x) for x in args.losses for o in args.optimizers]:
        specs = [dataclasses.replace(spec, loss=loss)
                 for spec in row_specs(sizes, opt, args.rows, hash_mode, args.ours_backend)]
        # rows of ROBE-sized arrays run interleaved; full tables (hundreds of MB each) alone
        small = [spec for spec in specs if spec.floats <= INTERLEAVE_MAX_FLOATS]
        groups = [small] + [[spec] for spec in specs if spec.floats > INTERLEAVE_MAX_FLOATS]
        for group in filter(None, groups):
            t0 = time.perf_counter()
            rs = run_specs(group, threads, batches, sizes, warmup, iters)
            results.extend(rs)
            for r in rs:
                status = r.unavailable or f"total {r.phases.get('total', float('nan')):.1f} ms"
                print(f"[{time.perf_counter() - t0:6.1f}s] {r.spec.key} {opt} {loss} "
                      f"{r.threads}t: {status}", file=sys.stderr, flush=True)
    # the tables list rows in row_specs' order within each (loss, optimizer)
    order = {(loss, opt): i for i, (opt, loss) in enumerate(
        [(o, x) for x in args.losses for o in args.optimizers])}
    results.sort(key=lambda r: order[(r.spec.loss, r.spec.optimizer)])

    load_end = loadavg()
    command = "python -m benchmarks.cpu_ops " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    setup = (f"batch {sizes.batch}, pair model (two lookups of one id per sample into one table or array, done as one call over 2B bags for every row, SUM), "
             f"dim {sizes.dim}, ids uniform in [0, {sizes.num_embeddings:,}), losses "
             f"{', '.join(LOSS_TEXT[x] for x in args.losses)}, "
             f"lr {LR}; ROBE hash {hash_mode.name.lower()} (seed {HASH_SEED}); "
             f"{warmup} warmup + {iters} timed iterations, medians, {len(batches)} distinct batches")
    report = "\n".join([
        "# CPU op benchmark: one training step of the pair model",
        "",
        f"- date: {start.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command}`",
        *machine_lines(),
        f"- load average (1/5/15 min) at start: {load_start}, at end: {load_end}",
        *contention_warning(load_start),
        f"- allocator: {allocator}",
        f"- setup: {setup}",
        "",
        "Columns in ms. forward = the embedding call; hashing/lookup/other = its split "
        "(pytorch ROBE-Z: hashing and gather + pool timed apart, other = the rest; ours: "
        "hashing = the C++ kernel's forward_hash_only (its hash pass: loops, id checks, hashes "
        "and tile buffers, without prefetches, gathers and output writes), `~` lookup = "
        "forward - hashing); backward = loss + autograd backward "
        "(includes the update for fused rows); optimizer step = step + zero_grad; "
        "total = forward + backward + optimizer step (median of per-iteration sums); CPU "
        "total = the calling thread's CPU time for the step (at 1 thread all of its work, and "
        "not inflated by time spent descheduled: on a busy machine wall time inflates a call "
        "longer than a scheduler slice more than a short one, which biases wall-time ratios "
        "against the slower row; at 2 threads it misses the worker thread's share). "
        "forward / floor and total / floor: the row's forward over the forward floor's, its "
        "total over the step floor's (the `floor` row of the same loss, optimizer, threads and "
        "array; rows of another size: the smallest array's floor).",
        "",
        "## Forward against its floor",
        "",
        "The forward floor writes a fresh [2B, D] float output from a cache-resident "
        f"[{FLOOR_SOURCE_ROWS}, D] source (`floor_forward`). Our forward (C++ kernel, dense, "
        "no autograd) in each case; every iteration runs the floor and all cases at every "
        "thread count back to back, medians in ms.",
        "",
        forward_floor_section(fwd, threads, sizes) if fwd else "(not run: needs the 'ours' rows)",
        "",
        f"Bytes per forward: the output is {2 * sizes.batch * sizes.dim * 4 / 2**20:.1f} MiB, "
        "written once (the floor's whole work); the gathers read "
        f"{2 * sizes.batch * sizes.dim * 4 / 2**20:.1f} MiB of weights in "
        f"{2 * sizes.batch:,} x dim/Z random blocks of Z floats (each block spans 1-3 cache "
        "lines, anywhere in the array). hashing = `forward_hash_only` (the kernel's hash pass: "
        "loops, id checks, hashes and tile buffers, without prefetches, gathers and output "
        "writes); the rest of CPU ms is the gathers, "
        "the pooling and the stores.",
        "",
        "## Where the forward's time goes (profile, 1 thread)",
        "",
        "CPU ms at 1 thread, medians, timed in the loop of the section above (each iteration "
        "runs every entry back to back, so the array is as cold for each as for the forward). "
        "store floor = the forward floor; hash only = `forward_hash_only`; hash + gather = "
        "`forward_gather_only` (the forward without its output stores: hashes, gathers and "
        "pools every row, then adds it to a cache-resident sum). hash = hash only; gather = "
        "hash + gather - hash only; store = forward - (hash + gather) (shares of the forward in "
        "brackets); overlap = store floor + (hash + gather) - forward: how much of the store "
        "floor's time the forward hides (negative: its stores cost more than the floor's).",
        "",
        forward_profile_section(profiles) if profiles else "(not run: needs the C++ kernel)",
        "",
        "### What stands between the kernel and the floor",
        "",
        stands_between_section(profiles),
        "",
        "## Backward profile (1 thread)",
        "",
        "CPU ms at 1 thread, same loop: the dense-gradient op (`robe::backward_dense`, no "
        "autograd, no loss) for a fixed [2B, D] output gradient, one read of that gradient "
        "(`sum`), and the forward's hashing alone (the backward hashes the same (id, block) "
        "pairs). rest = backward - hash only - read once: zeroing the array's gradient and "
        "scattering into it; line reads = the forward's (the scatter reads and writes the "
        "same lines).",
        "",
        backward_profile_section(fwd, sizes),
        "",
        "## Step rows",
        "",
        results_tables(results, threads, sizes),
        "",
        "## Backward against one read of its gradient",
        "",
        "own backward = our backward - the floor's backward (same loss, optimizer, threads, "
        "array: it holds the loss's own backward and one read of the gradient) + read once "
        "(one `sum` over a materialised [2B, D] float gradient, timed in the floor row).",
        "",
        backward_read_section(results, sizes),
        "",
        "## Targets against the floors (same run)",
        "",
        floor_targets_section(fwd, results, threads, sizes),
        "",
        *([scaling, ""] if (scaling := machine_scaling_summary(fwd, threads, sizes)) else []),
        "### What stands between the step and its floor",
        "",
        "ms: CPU time at 1 thread, wall time at 2 (as the targets). serial floor = the step "
        "floor + hash only + 2 x line reads (the profile's, same array, Z and hash, timed at "
        "the row's threads in the forward section's loop): the hashing, the gathers' line "
        "reads and the scatter's read-modify-write of the same lines, none of which the step "
        "floor does. overlapped floor = the step floor with the forward at the largest of its "
        "store floor, hashing and line reads, and the scatter's lines hidden under the "
        "gradient's one read. At 2 threads these parts are timed on 2 threads, so the floor "
        "takes whatever the two cores and their shared memory give them.",
        "",
        step_floors_section(step_floors(profiles_by_threads, fwd, results, sizes, hash_mode)),
        "",
        *([] if not {"full", "pytorch"} & set(args.rows) else [
            "## Targets against the other rows (same run, loss sum(e1*e2))",
            "",
            targets_section(results, threads, sizes),
            "",
        ]),
    ])
    print(report, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        data = json_report(command, start, (load_start, load_end), fwd, profiles, results)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.out} and its .json", file=sys.stderr)
    return report


def json_report(command: str, start: datetime.datetime, load: Tuple[str, str],
                fwd: Dict[Tuple[int, str], float], profiles: Sequence[ForwardProfile],
                results: Sequence[Result]) -> Dict[str, object]:
    """The report's numbers (ms) for scripts: the forward section's medians keyed
    "<threads>t <name>" (``cpu ...``: CPU time), the profile per case, and every step row."""
    return {
        "command": command, "date": start.isoformat(), "load_average": {"start": load[0], "end": load[1]},
        "machine": machine_lines(),
        "forward": {f"{k}t {name}": ms for (k, name), ms in fwd.items()},
        "profile": [dict(case=p.case.name, **{f.name: getattr(p, f.name) for f in
                                              dataclasses.fields(p) if f.name != "case"})
                    for p in profiles],
        "rows": [dict(key=r.spec.key, model=r.spec.model, loss=r.spec.loss, optimizer=r.spec.optimizer,
                      gradient=r.spec.gradient, floats=r.spec.floats, block_size=r.spec.block_size,
                      threads=r.threads, phases=r.phases, split=r.split, notes=r.notes,
                      unavailable=r.unavailable) for r in results],
    }


if __name__ == "__main__":
    main()
