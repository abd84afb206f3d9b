"""Pure-PyTorch ROBE-Z ops: the test oracle every kernel is checked against.

Same signatures as the registered ``torch.ops.robe.*`` ops (see :mod:`robe_torchrec.ops`).
Written for clarity, one feature at a time, and runs in any dtype (float64 for gradcheck).
As the kernels, it computes in :func:`~robe_torchrec.ops.meta.accumulation_dtype` (float32 for
float16/bfloat16 weights, whose pooled output is float32) and the fused update reads
low-precision weights, steps in float32 and writes them back rounded. It is also the "vectorised pure-PyTorch ROBE-Z" row of the CPU benchmark.

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
from robe_torchrec.ops.validation import (check_backward_inputs, check_inputs,
                                          check_optimizer_args, check_static, with_rate)


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
    acc = m.accumulation_dtype(weights.dtype)
    out = weights.new_zeros(batch, output_dim, dtype=acc)
    for t, vals, samples, lengths, col, span in _feature_slices(values, offsets, table_meta):
        idx = element_indices(vals, col, block_size, hash_mode, hash_params)
        scale = _row_scales(per_sample_weights, span, samples, lengths, col[m.POOLING], acc)
        rows = weights[idx].to(acc) * scale[:, None]
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
    check_backward_inputs(grad_output, weights, values, offsets, per_sample_weights, table_meta,
                          block_size, hash_mode, hash_params)
    acc = m.accumulation_dtype(weights.dtype)
    grad_weights = torch.zeros_like(weights, dtype=acc)
    for t, vals, samples, lengths, col, span in _feature_slices(values, offsets, table_meta):
        idx = element_indices(vals, col, block_size, hash_mode, hash_params)
        scale = _row_scales(per_sample_weights, span, samples, lengths, col[m.POOLING], acc)
        lo = col[m.OUT_OFFSET]
        rows = grad_output[samples, lo : lo + col[m.DIM]].to(acc) * scale[:, None]
        grad_weights.index_add_(0, idx.reshape(-1), rows.reshape(-1))
    return grad_weights.to(weights.dtype)


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
    check_backward_inputs(grad_output, weights, values, offsets, None, table_meta, block_size,
                          hash_mode, hash_params)
    acc = m.accumulation_dtype(weights.dtype)
    grad = weights.new_zeros(values.numel(), dtype=acc)
    for t, vals, samples, lengths, col, span in _feature_slices(values, offsets, table_meta):
        idx = element_indices(vals, col, block_size, hash_mode, hash_params)
        lo = col[m.OUT_OFFSET]
        dots = (weights[idx].to(acc) * grad_output[samples, lo : lo + col[m.DIM]].to(acc)).sum(1)
        if col[m.POOLING] == m.Pooling.MEAN:
            dots = dots / lengths.clamp(min=1).to(acc)[samples]
        grad[span[0] : span[1]] = dots
    return grad.to(weights.dtype)


def apply_optimizer_(
    weights: torch.Tensor,
    grad: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    optimizer: int,
    hparams: List[float],
    step: int,
    block_size: int = 0,
) -> None:
    """One dense step of SGD / Adagrad / Adam, the formulas of ``torch.optim`` (defaults:
    no momentum, ``lr_decay=0``, ``amsgrad=False``, L2 ``weight_decay``), or of torchrec's
    ``RowWiseAdagrad`` over rows of ``block_size`` elements (see
    :class:`~robe_torchrec.ops.meta.Optimizer`), written out here as the oracle; training uses
    :func:`robe_torchrec.ops.dense_update.apply_dense_update_`."""
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
    elif optimizer == m.Optimizer.ROWWISE_ADAGRAD:
        rows = row_means(grad * grad, block_size)
        state1.add_(rows)
        std = (state1.sqrt() + eps).repeat_interleave(block_size)[: weights.numel()]
        weights.addcdiv_(grad, std, value=-lr)
    else:
        raise ValueError(f"robe: unknown fused optimizer {optimizer}")


def row_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean of each row of ``block_size`` consecutive elements of the 1-D ``x`` (the last row
    over its own, possibly fewer, elements)."""
    if block_size < 1:
        raise ValueError(f"robe: row-wise Adagrad needs block_size >= 1, got {block_size}")
    rows = m.rowwise_state_size(x.numel(), block_size)
    padded = x.new_zeros(rows * block_size)
    padded[: x.numel()] = x
    counts = torch.full((rows,), float(block_size), dtype=x.dtype, device=x.device)
    counts[-1:] = x.numel() - (rows - 1) * block_size
    return padded.view(rows, block_size).sum(1) / counts


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
    lr: Optional[torch.Tensor] = None,
) -> None:
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    hparams = with_rate(hparams, lr, weights)
    check_optimizer_args(weights, state1, state2, optimizer, hparams, step, block_size)
    # low-precision weights are read, stepped in float32 and written back rounded
    work = weights.to(m.accumulation_dtype(weights.dtype))
    grad = backward_dense(grad_output, work, values, offsets, per_sample_weights,
                          table_meta, block_size, hash_mode, hash_params)
    apply_optimizer_(work, grad, state1, state2, optimizer, hparams, step, block_size)
    if work is not weights:
        weights.copy_(work)
