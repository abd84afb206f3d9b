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

import itertools
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
    num_ids = values.numel()
    if values.dim() != 1 or num_ids != sum(counts):
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
    # What the features' counts give, worked out on the host (a few ints a feature) and
    # copied in one go, so that the device runs a handful of ops a batch: each feature's
    # first id, and a last feature past the end, holding no id from id N on, whose first bag
    # is the offsets' final entry N; and the shift that turns id i of feature f into its
    # row of the op's output seen as [B * T, dim], i * T - (starts[f] * T - f).
    starts = list(itertools.accumulate(counts, initial=0))
    shifts = [start * num_features - f for f, start in enumerate(starts[:-1])]
    # (from pinned memory on CUDA: a copy from pageable memory would wait for the device)
    table = ints_on_device([*counts, 0, *starts, *shifts], torch.int64, device)
    count_t, start_t = table[:num_features + 1], table[num_features + 1:2 * num_features + 2]
    if width:
        # bag (f, b) holds id starts[f] + b while b < counts[f], else nothing
        bags = (torch.minimum(torch.arange(width, device=device), count_t[:, None])
                + start_t[:, None])
        offsets = bags.view(-1)[:num_features * width + 1].to(index_dtype)
    else:  # no bag: only the final entry
        offsets = torch.zeros(1, dtype=index_dtype, device=device)
    args = LookupArgs(values, offsets, None, layout._replace(output_dim=num_features * dim))
    if num_features == 1:
        return args, None
    # output_size given: the op need not read the counts' sum back from the device
    shift = torch.repeat_interleave(table[2 * num_features + 2:], count_t[:num_features],
                                    output_size=num_ids)
    return args, torch.arange(0, num_ids * num_features, num_features, device=device) - shift


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
