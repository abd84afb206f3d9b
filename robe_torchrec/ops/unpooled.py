"""The unpooled lookup (one embedding per id) as the pooled op with one id per bag.

A bag holding one id pooled with SUM (no per-sample weight) is that id's embedding, so the
unpooled lookup runs ``robe::forward`` itself: the C++, Triton and reference kernels, the fake
kernels, autograd and the fused optimizers in backward serve it unchanged, and a ROBE bag of
one id gives exactly the vector the unpooled module gives (by construction, tested).

The op takes ``T * B`` bags, one ``B`` for all features, but features hold different numbers
of ids. :func:`unpooled_args` therefore gives feature ``f`` (``n_f`` ids) the bags
``f * B .. f * B + n_f - 1`` with ``B = max n_f``, the rest empty; the op writes
``[B, T * dim]`` and :func:`gather_unpooled` picks each id's row and feature's columns into
``[N, dim]`` (one gather; none for one feature, where it is the identity). The padding costs
``T * max n_f - N`` zero rows: nothing when the features hold as many ids each (see
``benchmarks/results/unpooled_ops.md``).

Example::

    >>> args, index = unpooled_args(values, counts=[3, 1], layout=layout_args)
    >>> rows = gather_unpooled(args.forward(weights), index, dim=8)    # [4, 8]
    >>> rows = robe_unpooled_lookup(weights, values, [3, 1], layout_args)   # the same
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from robe_torchrec.ops.args import LayoutArgs, LookupArgs
from robe_torchrec.ops.small_copies import ints_on_device


def unpooled_args(values: Tensor, counts: List[int],
                  layout: LayoutArgs) -> Tuple[LookupArgs, Optional[Tensor]]:
    """``(LookupArgs, index)`` of the unpooled lookup of ``values`` (feature-major, ``counts[f]``
    ids of feature ``f``): one id per bag, bags padded to ``max(counts)`` per feature.
    ``index`` is ``None`` when the op's output already is ``[N, dim]`` (one feature).

    ``layout`` must be that of features of one dim with SUM pooling (the unpooled module's);
    its ``output_dim`` is replaced by ``T * dim``.
    """
    num_features = len(counts)
    if values.dim() != 1 or values.numel() != sum(counts):
        raise ValueError(f"robe_unpooled_lookup: values must be 1-D with sum(counts) = "
                         f"{sum(counts)} ids, got shape {tuple(values.shape)}")
    if layout.table_meta.shape[1] != num_features:
        raise ValueError(f"robe_unpooled_lookup: {num_features} counts for a table_meta of "
                         f"{layout.table_meta.shape[1]} features")
    width = max(counts) if counts else 0
    dim = layout.output_dim // max(num_features, 1)
    device = values.device
    # offsets in the values' dtype, as the op takes them (it refuses other value dtypes)
    index_dtype = values.dtype if values.dtype in (torch.int32, torch.int64) else torch.int64
    # (from pinned memory on CUDA: a copy from pageable memory would wait for the device)
    count_t = ints_on_device(counts, index_dtype, device)
    starts = torch.cumsum(count_t, 0) - count_t
    # bag (f, b) holds id starts[f] + b while b < counts[f], else nothing
    position = torch.arange(width, dtype=count_t.dtype, device=device)
    offsets = (starts[:, None] + torch.minimum(position[None, :], count_t[:, None])).flatten()
    # (cumsum and sum promote to int64)
    offsets = torch.cat([offsets, count_t.sum().reshape(1)]).to(index_dtype)
    args = LookupArgs(values, offsets, None,
                      layout._replace(output_dim=num_features * dim))
    if num_features == 1:
        return args, None
    # id i of feature f is bag b = i - starts[f]: row b, columns of feature f
    # output_size given: the op need not read the counts' sum back from the device
    feature = torch.repeat_interleave(torch.arange(num_features, device=device), count_t,
                                      output_size=values.numel())
    local = torch.arange(values.numel(), device=device) - starts.to(torch.int64)[feature]
    return args, local * num_features + feature


def gather_unpooled(pooled: Tensor, index: Optional[Tensor], dim: int) -> Tensor:
    """``[N, dim]``: each id's row of the op's ``[B, T * dim]`` output (``index`` from
    :func:`unpooled_args`)."""
    if index is None:
        return pooled
    return pooled.reshape(-1, dim).index_select(0, index)


def robe_unpooled_lookup(weights: Tensor, values: Tensor, counts: List[int],
                         layout: LayoutArgs) -> Tensor:
    """One embedding per id, ``[N, dim]``, differentiable in ``weights``: the unpooled lookup
    through ``torch.ops.robe.forward`` (see the module docstring).

    Example::

        >>> rows = robe_unpooled_lookup(ec.weight, kjt.values(), kjt.length_per_key(),
        ...                             ec.layout.op_args(ec.table_meta))
    """
    args, index = unpooled_args(values, counts, layout)
    dim = layout.output_dim // max(len(counts), 1)
    return gather_unpooled(args.forward(weights), index, dim)
