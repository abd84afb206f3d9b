"""Variable batch size per feature (VBE): a ``KeyedJaggedTensor`` whose features have
different strides (``stride_per_key_per_rank``), as production TorchRec input pipelines send.

The ROBE ops take ``T * B`` bags, one batch size for all features. A VBE KJT is padded to its
largest stride with empty bags (:func:`pad_variable_strides`); the pooled module then lays its
``[B_max, dim]`` output out as TorchRec's ``EmbeddingBagCollection`` does, each feature's rows
picked by the KJT's ``inverse_indices`` (:func:`expand_variable_strides`). The unpooled module
needs neither: it returns each feature's ids, whatever its stride.

Sharded, a pooled lookup returns what fbgemm's TBE returns for VBE input and TorchRec's VBE
output dist takes (:func:`flatten_variable_strides`): one flat tensor, per source rank the
features' bags of that rank; TorchRec then applies the inverse indices.

Example::

    >>> kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5]),
    ...     lengths=torch.tensor([1, 2, 1, 0, 1]), stride_per_key_per_rank=[[2], [3]],
    ...     inverse_indices=(["f1", "f2"], torch.tensor([[0, 1, 1], [0, 1, 2]])))
    >>> pad_variable_strides(kjt).lengths()
    tensor([1, 2, 0, 1, 0, 1])
"""

from __future__ import annotations

import itertools
from typing import List

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec.ops.small_copies import ints_on_device


def pad_variable_strides(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``features`` with every feature's bags padded by empty ones to the largest stride
    (values and weights unchanged); a KJT of one stride is returned as it is."""
    if not features.variable_stride_per_key():
        return features
    strides = features.stride_per_key()
    width = max(strides)
    lengths = features.lengths()
    # bag i, the b-th of feature f (which starts at bag start[f]), goes to f * width + b,
    # that is i + (f * width - start[f]): positions computed on the device from the strides
    # and those shifts, without a boolean mask (whose nonzero would wait for the device)
    starts = [0, *itertools.accumulate(strides)][:-1]
    shifts = [f * width - start for f, start in enumerate(starts)]
    steps = ints_on_device(strides + shifts, torch.int64, lengths.device)
    total = lengths.numel()
    if torch.compiler.is_compiling():  # a trace may hold the lengths' size as an unknown
        # (no message: strict torch.export fails on a _check given one)
        torch._check(total == sum(strides))
    if total != sum(strides):
        raise ValueError(f"a KeyedJaggedTensor with strides {strides} per feature holds "
                         f"{sum(strides)} bags, but its lengths have {total} entries")
    position = torch.arange(total, device=lengths.device) + torch.repeat_interleave(
        steps[len(strides):], steps[:len(strides)], output_size=total)
    padded = lengths.new_zeros(len(strides) * width)
    padded[position] = lengths
    return KeyedJaggedTensor(keys=features.keys(), values=features.values(),
                             weights=features.weights_or_none(), lengths=padded,
                             stride=width)


def expand_variable_strides(pooled: torch.Tensor, features: KeyedJaggedTensor,
                            feature_names: List[str], dims: List[int]) -> torch.Tensor:
    """The ``[B_max, sum(dims)]`` output of a padded VBE lookup laid out as TorchRec's
    ``EmbeddingBagCollection`` lays it out: row ``r`` of feature ``f`` is the bag
    ``inverse_indices[f][r]`` (``[B, sum(dims)]``, ``B`` the inverse indices' width).
    ``pooled`` is returned as it is for a KJT of one stride."""
    if not features.variable_stride_per_key():
        return pooled
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        raise ValueError(
            "RobeEmbeddingBagCollection: a KeyedJaggedTensor with a variable batch size per "
            "feature needs inverse_indices (as TorchRec's EmbeddingBagCollection does) to lay "
            "out its KeyedTensor: build it with KeyedJaggedTensor(..., "
            "stride_per_key_per_rank=..., inverse_indices=(keys, [F, B] tensor))")
    keys, rows = inverse
    missing = [f for f in feature_names if f not in keys]
    if missing:
        raise ValueError(f"RobeEmbeddingBagCollection: inverse_indices has no rows for "
                         f"features {missing} (it has {list(keys)})")
    columns = torch.split(pooled, dims, dim=1)
    return torch.cat([col.index_select(0, rows[keys.index(f)].to(torch.int64))
                      for f, col in zip(feature_names, columns)], dim=1)


def flatten_variable_strides(pooled: torch.Tensor, stride_per_key_per_rank: List[List[int]],
                             dims: List[int]) -> torch.Tensor:
    """The ``[B_max, sum(dims)]`` output of a padded VBE lookup as TorchRec's sharded
    ``EmbeddingBagCollection`` takes a lookup's VBE output (fbgemm's TBE layout): 1-D, rank
    by rank, within a rank feature by feature, each feature's bags of that rank as
    ``[stride, dim]`` rows; feature ``f``'s bags are rank-major in its padded column.

    Example::

        >>> pooled = torch.arange(12.).view(3, 4)   # 2 features of dim 2, strides 3 and 1
        >>> flatten_variable_strides(pooled, [[2, 1], [1, 0]], [2, 2])
        tensor([ 0.,  1.,  4.,  5.,  2.,  3.,  8.,  9.])
    """
    columns = torch.split(pooled, dims, dim=1)
    starts = [0] * len(dims)
    pieces = []
    for rank in range(len(stride_per_key_per_rank[0]) if stride_per_key_per_rank else 0):
        for f, column in enumerate(columns):
            count = stride_per_key_per_rank[f][rank]
            pieces.append(column[starts[f]:starts[f] + count].reshape(-1))
            starts[f] += count
    return torch.cat(pieces) if pieces else pooled.new_empty(0)


def order_inverse_indices(features: KeyedJaggedTensor,
                          feature_order: List[str]) -> KeyedJaggedTensor:
    """``features`` with its ``inverse_indices`` reduced to the rows of ``feature_order``, in
    that order (other fields unchanged); returned as it is when they already are, when some
    are missing (TorchRec reports that), or when ``features`` is not a VBE KJT with inverse
    indices.

    Why: TorchRec's sharded ``EmbeddingBagCollection`` builds the MEAN divisor of row-wise
    tables from the inverse indices' rows taken in the KJT's key order whenever both name
    as many features; it reorders them only when the counts differ. A KJT whose keys come in
    another order than the module's features then gets the divisor of the wrong feature
    (an ``IndexError``, or a wrong mean). Ordered here, the rows are the right ones.

    Example::

        >>> kjt.keys(), kjt.inverse_indices()[0]
        (['i', 'u'], ['i', 'u'])
        >>> order_inverse_indices(kjt, ["u", "i"]).inverse_indices()[0]
        ['u', 'i']
    """
    if not isinstance(features, KeyedJaggedTensor) or not features.variable_stride_per_key():
        return features  # (TorchRec's input dist also takes a TensorDict, never VBE)
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        return features
    keys, rows = inverse
    if list(keys) == list(feature_order) or any(f not in keys for f in feature_order):
        # missing rows: left for TorchRec to report
        return features
    index = ints_on_device([keys.index(f) for f in feature_order], torch.int64, rows.device)
    return KeyedJaggedTensor(
        keys=features.keys(), values=features.values(), weights=features.weights_or_none(),
        lengths=features.lengths(), offsets=features.offsets_or_none(),
        stride_per_key_per_rank=features.stride_per_key_per_rank(),
        inverse_indices=(list(feature_order), rows.index_select(0, index)))
