"""The table-metadata tensor every ROBE op takes, and the enums the ops receive as ints.

One op call serves ``T`` features at once (as FBGEMM's TBE does). The inputs are laid out
feature-major, exactly as a ``KeyedJaggedTensor`` holds them:

* ``values``  ``[N]`` int32/int64: ids of feature 0 for all bags, then feature 1, ...
* ``offsets`` ``[T * B + 1]`` same dtype as ``values``: bag ``(t, b)`` is
  ``values[offsets[t * B + b] : offsets[t * B + b + 1]]``.
* ``per_sample_weights`` ``[N]`` float or ``None``.
* ``table_meta`` ``[NUM_META_FIELDS, T]`` int64, contiguous, one column per feature:

  ============  ===================================================================
  OUT_OFFSET    first column of this feature in the ``[B, output_dim]`` output
  DIM           embedding dim ``D_t`` of the feature
  W_OFFSET      first element of the feature's array inside the flat ``weights``
  W_SIZE        size ``M_t`` of that array (the hash maps into ``[0, M_t)``)
  ROW_OFFSET    added to every id to form the hash key (shared layout: rows of the
                tables before this one; otherwise 0)
  NUM_ROWS      ``num_embeddings`` of the table, the exclusive upper bound on ids
                when bounds are checked
  POOLING       :class:`Pooling` of the feature
  ============  ===================================================================

Example::

    >>> meta = build_table_meta(dims=[16, 8], weight_offsets=[0, 0], weight_sizes=[1000, 1000],
    ...                         row_offsets=[0, 50], num_rows=[50, 70], poolings=[0, 1])
    >>> meta.shape
    torch.Size([7, 2])
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch

OUT_OFFSET, DIM, W_OFFSET, W_SIZE, ROW_OFFSET, NUM_ROWS, POOLING = range(7)
NUM_META_FIELDS = 7


class Pooling(enum.IntEnum):
    SUM = 0
    MEAN = 1


class BoundsCheck(enum.IntEnum):
    """What the kernels do with ids outside ``[0, num_embeddings)``."""

    #: raise an error naming the id, its position and its feature (the default)
    ERROR = 0
    #: hash any id as it is (raw 64-bit ids); the reference hash still rejects keys it
    #: cannot compute without overflow
    UNBOUNDED = 1


class Optimizer(enum.IntEnum):
    """Optimizers the fused backward applies in place (dense semantics, as torch.optim).

    ``ROWWISE_ADAGRAD`` is torchrec's ``RowWiseAdagrad`` (FBGEMM's EXACT_ROWWISE_ADAGRAD) with
    a ROBE array's *row* defined as one aligned chunk of ``block_size`` floats of the flat
    ``weights`` the op updates: element ``i`` belongs to row ``i // block_size`` (the last row
    holds the ``M % block_size`` leftover elements if any), so ``sum`` has
    :func:`rowwise_state_size` entries. Each step adds the *mean* over the row of the squared
    (weight-decayed) gradient to the row's ``sum`` (FBGEMM and torchrec average over the
    embedding dim) and scales the whole row's update by ``lr / (sqrt(sum) + eps)``. A row is
    a unit of memory, not a lookup: a looked-up block starts at a hashed offset and usually
    straddles two rows, which is why the rows are fixed chunks and not the blocks.
    """

    SGD = 0
    ADAGRAD = 1
    ADAM = 2
    ROWWISE_ADAGRAD = 3


#: order of the floats in the fused backward's ``hparams`` argument
HPARAM_NAMES = ("lr", "eps", "beta1", "beta2", "weight_decay")


def rowwise_state_size(numel: int, block_size: int) -> int:
    """Rows (entries of ``sum``) of :attr:`Optimizer.ROWWISE_ADAGRAD` for ``numel`` weights."""
    return -(-int(numel) // int(block_size))


def accumulation_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in, and that outputs and optimizer state are kept in, for
    weights stored in ``weight_dtype``: float64 for float64, float32 otherwise (as FBGEMM's TBE
    keeps fp16 tables with fp32 outputs and fp32 optimizer state)."""
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def build_table_meta(
    dims: Sequence[int],
    weight_offsets: Sequence[int],
    weight_sizes: Sequence[int],
    row_offsets: Sequence[int],
    num_rows: Sequence[int],
    poolings: Sequence[int],
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Assemble ``table_meta`` from per-feature lists (output offsets are the running dims)."""
    out_offsets, total = [], 0
    for d in dims:
        out_offsets.append(total)
        total += int(d)
    columns = [out_offsets, dims, weight_offsets, weight_sizes, row_offsets, num_rows, poolings]
    if len({len(c) for c in columns}) != 1:
        raise ValueError("build_table_meta: every per-feature list must have the same length")
    return torch.tensor([[int(v) for v in c] for c in columns], dtype=torch.int64, device=device)
