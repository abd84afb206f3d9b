"""What the CPU step benchmark's questions share (:mod:`benchmarks.cpu_ops`): sizes,
batches, losses, the runner interface, the floors (an embedding that only writes its output
from a cache-resident source and reads its gradient once), table helpers and the machine's
description."""

from __future__ import annotations

import ctypes
import math
import os
import platform
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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




def fmt(value: Optional[float], prefix: str = "") -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{prefix}{value:.1f}"
    if abs(value) >= 1:
        return f"{prefix}{value:.2f}"
    return f"{prefix}{value:.3f}"



def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)




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
