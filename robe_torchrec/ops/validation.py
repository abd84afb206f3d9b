"""Vectorised input checks shared by the reference and Triton paths.

The C++ kernel performs the same checks inside its own loops (for free) and raises the
same messages; every message starts with ``robe:`` and names the feature index, so the
module can translate it to a feature name. Each check is a handful of whole-tensor ops;
no Python loop runs over ids.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from robe_torchrec.hashing import HashMode, reference_key_limit
from robe_torchrec.ops import meta as m

INDEX_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_static(
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
) -> None:
    """Checks on dtypes and shapes only (no data read, no device sync)."""
    if weights.dim() != 1 or weights.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"robe: weights must be a 1-D float tensor, got {weights.dtype} "
                         f"of shape {tuple(weights.shape)}")
    if values.dtype not in INDEX_DTYPES:
        raise ValueError(f"robe: values (ids) must be int32 or int64, got {values.dtype}")
    if offsets.dtype != values.dtype:
        raise ValueError(f"robe: offsets dtype {offsets.dtype} must equal values dtype {values.dtype}")
    if values.dim() != 1 or offsets.dim() != 1:
        raise ValueError("robe: values and offsets must be 1-D")
    if table_meta.dtype != torch.int64 or table_meta.dim() != 2 or table_meta.shape[0] != m.NUM_META_FIELDS:
        raise ValueError(f"robe: table_meta must be int64 [{m.NUM_META_FIELDS}, T]")
    num_features = table_meta.shape[1]
    if num_features == 0 or (offsets.numel() - 1) % num_features != 0 or offsets.numel() < 1:
        raise ValueError(f"robe: offsets has {offsets.numel()} entries; expected T * B + 1 "
                         f"with T = {num_features} features")
    if per_sample_weights is not None:
        if not per_sample_weights.dtype.is_floating_point:
            raise ValueError(f"robe: per_sample_weights must be floating point, got "
                             f"{per_sample_weights.dtype}")
        if per_sample_weights.shape != values.shape:
            raise ValueError(f"robe: per_sample_weights has {per_sample_weights.numel()} entries "
                             f"but values has {values.numel()}")
    if block_size < 1:
        raise ValueError(f"robe: block_size must be >= 1, got {block_size}")
    HashMode(hash_mode)


def check_inputs(
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    output_dim: int,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    bounds_check: int,
) -> None:
    """All checks, including the data-dependent ones (offsets, id bounds, NaN weights)."""
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    num_features = table_meta.shape[1]
    batch = (offsets.numel() - 1) // num_features
    meta_cpu = table_meta.cpu()
    dims = meta_cpu[m.DIM]
    if int((meta_cpu[m.OUT_OFFSET] + dims).max()) > output_dim:
        raise ValueError(f"robe: output_dim {output_dim} is smaller than the features' dims")
    sizes = meta_cpu[m.W_SIZE]
    if bool((sizes < block_size).any()) or int((meta_cpu[m.W_OFFSET] + sizes).max()) > weights.numel():
        raise ValueError(f"robe: every ROBE array must hold at least block_size={block_size} "
                         f"floats and lie inside weights ({weights.numel()} floats)")
    if hash_mode == HashMode.MIX and int((sizes - block_size + 1).max()) >= 2**32:
        raise ValueError("robe: the mix hash needs memory_size - block_size + 1 < 2**32")

    offs = offsets.to(torch.int64)
    if int(offs[0]) != 0:
        raise ValueError(f"robe: offsets[0] must be 0, got {int(offs[0])}")
    if int(offs[-1]) != values.numel():
        raise ValueError(f"robe: offsets[-1] = {int(offs[-1])} but values has {values.numel()} "
                         f"entries (lengths do not match values)")
    lengths = offs[1:] - offs[:-1]
    if lengths.numel() and bool((lengths < 0).any()):
        bag = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"robe: offsets decrease at bag {bag} (feature {bag // max(batch, 1)}, "
                         f"sample {bag % max(batch, 1)}): {int(offs[bag])} -> {int(offs[bag + 1])}")
    if per_sample_weights is not None and values.numel():
        bad = ~torch.isfinite(per_sample_weights)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0])
            raise ValueError(f"robe: per_sample_weights[{pos}] is {float(per_sample_weights[pos])}; "
                             "weights must be finite")
    if values.numel() == 0:
        return
    # Feature of every value: features own contiguous runs of values.
    feature_ends = offs[torch.arange(1, num_features + 1, device=offs.device) * batch]
    feature = torch.bucketize(torch.arange(values.numel(), device=values.device), feature_ends, right=True)
    vals = values.to(torch.int64)
    if bounds_check == m.BoundsCheck.ERROR:
        upper = table_meta[m.NUM_ROWS].to(values.device)[feature]
        _raise_first(vals, (vals < 0) | (vals >= upper), feature,
                     lambda t: f"is out of range [0, {int(meta_cpu[m.NUM_ROWS, t])})")
    elif hash_mode == HashMode.REFERENCE:
        max_blocks = int(((dims + block_size - 1) // block_size).max())
        limit = reference_key_limit(max_blocks, hash_params)
        keys = vals + table_meta[m.ROW_OFFSET].to(values.device)[feature]
        _raise_first(vals, (vals < 0) | (keys >= limit), feature,
                     lambda t: f"cannot be hashed by the reference hash (keys must lie in [0, {limit}); "
                               "use hash='mix' for arbitrary 64-bit ids)")


def _raise_first(vals: torch.Tensor, bad: torch.Tensor, feature: torch.Tensor, describe) -> None:
    if bool(bad.any()):
        pos = int(torch.nonzero(bad)[0])
        t = int(feature[pos])
        raise ValueError(f"robe: id {int(vals[pos])} at position {pos} of feature {t} {describe(t)}")
