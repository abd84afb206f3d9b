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
) -> OpCase:
    """A case with mixed dims, empty bags and random bag sizes in ``[0, max_bag]``."""
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
    lengths = torch.randint(0, max_bag + 1, (num_features * batch,), generator=g)
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
