"""Pure-PyTorch ROBE-Z ops: the test oracle every kernel is checked against.

Same signatures as the registered ``torch.ops.robe.*`` ops (see :mod:`robe_torchrec.ops`).
Written for clarity, one feature at a time, and runs in any dtype (float64 for gradcheck).
It is also the "vectorised pure-PyTorch ROBE-Z" row of the CPU benchmark.

Example::

    >>> out = reference.forward(weights, values, offsets, None, meta, output_dim=24,
    ...                         block_size=4, hash_mode=0, hash_params=[A, B, C], bounds_check=0)
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from robe_torchrec.hashing import block_starts
from robe_torchrec.ops import meta as m
from robe_torchrec.ops.validation import check_inputs


def _feature_slices(values: torch.Tensor, offsets: torch.Tensor, table_meta: torch.Tensor):
    """Yield, per feature: (t, values, sample id of each value, bag lengths, meta column)."""
    num_features = table_meta.shape[1]
    batch = (offsets.numel() - 1) // num_features
    offsets = offsets.to(torch.int64)
    for t in range(num_features):
        bag_offsets = offsets[t * batch : (t + 1) * batch + 1]
        lengths = bag_offsets[1:] - bag_offsets[:-1]
        vals = values[bag_offsets[0] : bag_offsets[-1]].to(torch.int64)
        samples = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths)
        yield t, vals, samples, lengths, [int(v) for v in table_meta[:, t].tolist()], (
            int(bag_offsets[0]),
            int(bag_offsets[-1]),
        )


def element_indices(
    vals: torch.Tensor, col: List[int], block_size: int, hash_mode: int, hash_params: List[int]
) -> torch.Tensor:
    """Flat indices ``[n, D]`` into ``weights`` of every element of every looked-up row."""
    dim = col[m.DIM]
    num_blocks = math.ceil(dim / block_size)
    starts = block_starts(
        vals + col[m.ROW_OFFSET], num_blocks, col[m.W_SIZE], block_size, hash_mode, hash_params
    )
    j = torch.arange(dim, device=vals.device)
    return col[m.W_OFFSET] + starts[:, j // block_size] + (j % block_size)


def _row_scales(
    per_sample_weights: Optional[torch.Tensor],
    span: Tuple[int, int],
    samples: torch.Tensor,
    lengths: torch.Tensor,
    pooling: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Scale of each looked-up row: its per-sample weight, divided by the bag size for MEAN."""
    scale = torch.ones(samples.numel(), dtype=dtype, device=samples.device)
    if per_sample_weights is not None:
        scale = scale * per_sample_weights[span[0] : span[1]].to(dtype)
    if pooling == m.Pooling.MEAN:
        scale = scale / lengths.clamp(min=1).to(dtype)[samples]
    return scale


def forward(
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
) -> torch.Tensor:
    check_inputs(weights, values, offsets, per_sample_weights, table_meta, output_dim,
                 block_size, hash_mode, hash_params, bounds_check)
    batch = (offsets.numel() - 1) // table_meta.shape[1]
    out = weights.new_zeros(batch, output_dim)
    for t, vals, samples, lengths, col, span in _feature_slices(values, offsets, table_meta):
        idx = element_indices(vals, col, block_size, hash_mode, hash_params)
        scale = _row_scales(per_sample_weights, span, samples, lengths, col[m.POOLING], weights.dtype)
        rows = weights[idx] * scale[:, None]
        lo = col[m.OUT_OFFSET]
        out[:, lo : lo + col[m.DIM]].index_add_(0, samples, rows)
    return out


def backward_dense(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> torch.Tensor:
    grad_weights = torch.zeros_like(weights)
    for t, vals, samples, lengths, col, span in _feature_slices(values, offsets, table_meta):
        idx = element_indices(vals, col, block_size, hash_mode, hash_params)
        scale = _row_scales(per_sample_weights, span, samples, lengths, col[m.POOLING], weights.dtype)
        lo = col[m.OUT_OFFSET]
        rows = grad_output[samples, lo : lo + col[m.DIM]].to(weights.dtype) * scale[:, None]
        grad_weights.index_add_(0, idx.reshape(-1), rows.reshape(-1))
    return grad_weights


def per_sample_weights_grad(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> torch.Tensor:
    """``d loss / d per_sample_weights[i]``: the looked-up row of value i dotted with its bag's
    output gradient (divided by the bag size for MEAN)."""
    grad = weights.new_zeros(values.numel())
    for t, vals, samples, lengths, col, span in _feature_slices(values, offsets, table_meta):
        idx = element_indices(vals, col, block_size, hash_mode, hash_params)
        lo = col[m.OUT_OFFSET]
        dots = (weights[idx] * grad_output[samples, lo : lo + col[m.DIM]].to(weights.dtype)).sum(1)
        if col[m.POOLING] == m.Pooling.MEAN:
            dots = dots / lengths.clamp(min=1).to(weights.dtype)[samples]
        grad[span[0] : span[1]] = dots
    return grad


def apply_optimizer_(
    weights: torch.Tensor,
    grad: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    optimizer: int,
    hparams: List[float],
    step: int,
) -> None:
    """One dense step of SGD / Adagrad / Adam, the formulas of ``torch.optim`` (defaults:
    no momentum, ``lr_decay=0``, ``amsgrad=False``, L2 ``weight_decay``), written out here as
    the oracle; training uses :func:`robe_torchrec.ops.dense_update.apply_dense_update_`."""
    lr, eps, beta1, beta2, weight_decay = hparams
    if weight_decay != 0.0:
        grad = grad + weight_decay * weights
    if optimizer == m.Optimizer.SGD:
        weights.add_(grad, alpha=-lr)
    elif optimizer == m.Optimizer.ADAGRAD:
        state1.addcmul_(grad, grad)
        weights.addcdiv_(grad, state1.sqrt().add_(eps), value=-lr)
    elif optimizer == m.Optimizer.ADAM:
        state1.lerp_(grad, 1.0 - beta1)
        state2.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias1 = 1.0 - beta1**step
        bias2_sqrt = math.sqrt(1.0 - beta2**step)
        denom = (state2.sqrt() / bias2_sqrt).add_(eps)
        weights.addcdiv_(state1, denom, value=-lr / bias1)
    else:
        raise ValueError(f"robe: unknown fused optimizer {optimizer}")


def backward_fused_(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    optimizer: int,
    hparams: List[float],
    step: int,
) -> None:
    grad = backward_dense(grad_output, weights, values, offsets, per_sample_weights,
                          table_meta, block_size, hash_mode, hash_params)
    apply_optimizer_(weights, grad, state1, state2, optimizer, hparams, step)
