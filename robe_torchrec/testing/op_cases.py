"""Random op inputs shared by the kernel tests: every kernel sees the same kinds of case."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from robe_torchrec.hashing import HashMode, hash_params
from robe_torchrec.ops.meta import BoundsCheck, build_table_meta


@dataclasses.dataclass
class OpCase:
    weights: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: Optional[torch.Tensor]
    table_meta: torch.Tensor
    output_dim: int
    block_size: int
    hash_mode: int
    hash_params: List[int]
    bounds_check: int = int(BoundsCheck.ERROR)

    @property
    def batch(self) -> int:
        return (self.offsets.numel() - 1) // self.table_meta.shape[1]

    def forward_args(self):
        return (self.weights, self.values, self.offsets, self.per_sample_weights, self.table_meta,
                self.output_dim, self.block_size, self.hash_mode, self.hash_params, self.bounds_check)

    def backward_args(self, grad_output: torch.Tensor):
        return (grad_output, self.weights, self.values, self.offsets, self.per_sample_weights,
                self.table_meta, self.block_size, self.hash_mode, self.hash_params)

    def psw_grad_args(self, grad_output: torch.Tensor):
        return (grad_output, self.weights, self.values, self.offsets, self.table_meta,
                self.block_size, self.hash_mode, self.hash_params)

    def to(self, device) -> "OpCase":
        """The same case with its tensors on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return OpCase(**moved)

    def grad(self, seed: int = 0) -> torch.Tensor:
        """A random output gradient ``[B, output_dim]`` (the same on every device)."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.batch, self.output_dim, generator=g,
                           dtype=self.weights.dtype).to(self.weights.device)


def random_case(
    seed: int,
    *,
    dims: Optional[List[int]] = None,
    batch: int = 7,
    max_bag: int = 6,
    block_size: int = 4,
    hash_mode: int = int(HashMode.REFERENCE),
    shared: bool = True,
    weighted: bool = False,
    index_dtype: torch.dtype = torch.int64,
    dtype: torch.dtype = torch.float32,
    memory_size: int = 997,
    pooling: Optional[List[int]] = None,
    num_rows: Optional[List[int]] = None,
    empty_fraction: float = 0.2,
    fixed_bags: bool = False,
) -> OpCase:
    """A case with mixed dims, empty bags and random bag sizes in ``[0, max_bag]``
    (``fixed_bags``: ``max_bag`` ids in every bag not emptied)."""
    g = torch.Generator().manual_seed(seed)
    dims = dims or [8, 5, 16, 3]
    num_features = len(dims)
    num_rows = num_rows or [int(torch.randint(5, 5000, (1,), generator=g)) for _ in dims]
    pooling = pooling if pooling is not None else [t % 2 for t in range(num_features)]
    if shared:
        weight_offsets, weight_sizes = [0] * num_features, [memory_size] * num_features
        row_offsets = [sum(num_rows[:t]) for t in range(num_features)]
        total = memory_size
    else:
        weight_sizes = [memory_size // num_features + 13 * t for t in range(num_features)]
        weight_offsets = [sum(weight_sizes[:t]) for t in range(num_features)]
        row_offsets = [0] * num_features
        total = sum(weight_sizes)
    lengths = (torch.full((num_features * batch,), max_bag) if fixed_bags else
               torch.randint(0, max_bag + 1, (num_features * batch,), generator=g))
    lengths[torch.rand(lengths.shape, generator=g) < empty_fraction] = 0
    values = torch.cat([
        torch.randint(0, num_rows[t], (int(lengths[t * batch:(t + 1) * batch].sum()),), generator=g)
        for t in range(num_features)
    ])
    offsets = torch.zeros(num_features * batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    psw = torch.rand(values.numel(), generator=g, dtype=dtype) * 2 - 0.5 if weighted else None
    meta = build_table_meta(dims, weight_offsets, weight_sizes, row_offsets, num_rows, pooling)
    return OpCase(
        weights=torch.randn(total, generator=g, dtype=dtype),
        values=values.to(index_dtype),
        offsets=offsets.to(index_dtype),
        per_sample_weights=psw,
        table_meta=meta,
        output_dim=sum(dims),
        block_size=block_size,
        hash_mode=int(hash_mode),
        hash_params=hash_params(HashMode(hash_mode), seed=1024 + seed),
    )


def case_matrix() -> List[dict]:
    """Keyword sets that together cover the op contract (ids dtypes, layouts, hashes, ...)."""
    cases = []
    for i, (mode, shared, weighted, idt, bs) in enumerate([
        (HashMode.REFERENCE, True, False, torch.int64, 4),
        (HashMode.REFERENCE, False, True, torch.int32, 3),
        (HashMode.MIX, True, True, torch.int64, 8),
        (HashMode.MIX, False, False, torch.int32, 1),
        (HashMode.REFERENCE, True, True, torch.int32, 32),
        (HashMode.MIX, True, False, torch.int64, 5),
    ]):
        cases.append(dict(seed=100 + i, hash_mode=int(mode), shared=shared, weighted=weighted,
                          index_dtype=idt, block_size=bs))
    # long bags (thousands of ids) and wide dims
    cases.append(dict(seed=200, dims=[64, 128], batch=3, max_bag=3000, block_size=32,
                      hash_mode=int(HashMode.MIX), memory_size=4099, empty_fraction=0.0))
    # every bag empty
    cases.append(dict(seed=201, max_bag=0))
    return cases


def rowwise_adagrad_brute_force(weights: torch.Tensor, grad: torch.Tensor, state: torch.Tensor,
                                block_size: int, lr: float, eps: float, weight_decay: float):
    """Row-wise Adagrad written out element by element in Python floats (float64), from its
    definition in :class:`robe_torchrec.ops.meta.Optimizer`: row ``r`` is elements
    ``[r * Z, r * Z + Z)``, its ``sum`` grows by the mean of the squared decayed gradient."""
    w, s = weights.tolist(), state.tolist()
    g = [gi + weight_decay * wi for gi, wi in zip(grad.tolist(), w)]
    for r in range(len(s)):
        row = range(r * block_size, min((r + 1) * block_size, len(w)))
        s[r] += sum(g[i] * g[i] for i in row) / len(row)
        for i in row:
            w[i] -= lr * g[i] / (s[r] ** 0.5 + eps)
    return torch.tensor(w, dtype=torch.float64), torch.tensor(s, dtype=torch.float64)


#: (block_size, shared, weighted, weight_decay): rows that divide the array or leave a short
#: last row, one array or one per feature
ROWWISE_CASES = [(3, False, True, 0.0), (8, True, False, 0.01), (5, True, True, 0.0),
                 (1, False, False, 0.01)]


def fused_steps(impl, case: OpCase, optimizer: int, hparams: List[float], states, steps: int = 3,
                weights: Optional[torch.Tensor] = None):
    """Apply ``steps`` fused steps of ``impl`` (a module with ``backward_fused_``) to a copy of
    the case's weights (or ``weights``) and the given state tensors (updated in place);
    returns the weights. The grad_output of step k is seeded with k."""
    w = (case.weights if weights is None else weights).clone()
    for step in range(1, steps + 1):
        g = torch.randn(case.batch, case.output_dim, generator=torch.Generator().manual_seed(step),
                        dtype=torch.float64 if w.dtype == torch.float64 else torch.float32)
        g = g.to(w.device)
        impl.backward_fused_(g, w, *states, case.values, case.offsets, case.per_sample_weights,
                             case.table_meta, case.block_size, case.hash_mode, case.hash_params,
                             int(optimizer), hparams, step)
    return w
