"""The arguments of a ROBE lookup as one typed structure (as FBGEMM's ``lookup_args``).

The ops registered with ``torch.library`` keep flat signatures (the dispatcher needs them);
Python code passes a :class:`LookupArgs` instead of 9 positional slots, and calls the ops
through its methods, which spread the fields into each op's slots in one place.

* :class:`LayoutArgs`: what the layout fixes (``table_meta``, ``output_dim``, the hash and the
  bounds check), built once per module or sharded lookup
  (:meth:`robe_torchrec.layout.RobeLayout.op_args`).
* :class:`LookupArgs`: one batch (``values``, ``offsets``, ``per_sample_weights``) plus its
  :class:`LayoutArgs`.

Example::

    >>> static = LayoutArgs(table_meta=meta, output_dim=24, block_size=4, hash_mode=0,
    ...                     hash_params=[A, B, C], bounds_check=0)
    >>> args = LookupArgs(values, offsets, None, static)
    >>> pooled = args.forward(weights)                  # torch.ops.robe.forward(weights, ...)
    >>> grad = args.backward_dense(grad_output, weights)
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch
from torch import Tensor


class LayoutArgs(NamedTuple):
    """Op arguments fixed by the layout (see :mod:`robe_torchrec.ops.meta` for each)."""

    table_meta: Tensor  # [NUM_META_FIELDS, T] int64
    output_dim: int  # columns of the pooled output: sum of the features' dims
    block_size: int  # Z
    hash_mode: int  # HashMode
    hash_params: List[int]
    bounds_check: int  # BoundsCheck


class LookupArgs(NamedTuple):
    """One batch of a lookup: ``torch.ops.robe.forward(weights, *args.flat())``."""

    values: Tensor  # [N] int32/int64, feature-major as a KeyedJaggedTensor holds them
    offsets: Tensor  # [T * B + 1], same dtype as values
    per_sample_weights: Optional[Tensor]  # [N] or None
    layout: LayoutArgs

    @classmethod
    def from_flat(cls, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                  *layout: object) -> "LookupArgs":
        """From ``robe::forward``'s arguments after ``weights``."""
        return cls(values, offsets, per_sample_weights, LayoutArgs(*layout))  # type: ignore[arg-type]

    def flat(self) -> tuple:
        """``robe::forward``'s arguments after ``weights``, in its order."""
        return (self.values, self.offsets, self.per_sample_weights, *self.layout)

    def forward(self, weights: Tensor) -> Tensor:
        """Pooled lookup ``[B, output_dim]`` (differentiable in weights and per-sample weights)."""
        return torch.ops.robe.forward(weights, *self.flat())

    def backward_dense(self, grad_output: Tensor, weights: Tensor) -> Tensor:
        """Gradient of the flat weights."""
        s = self.layout
        return torch.ops.robe.backward_dense(
            grad_output, weights, self.values, self.offsets, self.per_sample_weights,
            s.table_meta, s.block_size, s.hash_mode, s.hash_params)

    def per_sample_weights_grad(self, grad_output: Tensor, weights: Tensor) -> Tensor:
        """Gradient of the per-sample weights, in their dtype."""
        s = self.layout
        assert self.per_sample_weights is not None
        return torch.ops.robe.per_sample_weights_grad(
            grad_output, weights, self.values, self.offsets, s.table_meta, s.block_size,
            s.hash_mode, s.hash_params).to(self.per_sample_weights.dtype)

    def backward_fused_(self, grad_output: Tensor, weights: Tensor, state1: Tensor,
                        state2: Tensor, optimizer: int, hparams: List[float], step: int) -> None:
        """Scatter the gradient into ``weights`` and apply the optimizer, in place."""
        s = self.layout
        torch.ops.robe.backward_fused_(
            grad_output, weights, state1, state2, self.values, self.offsets,
            self.per_sample_weights, s.table_meta, s.block_size, s.hash_mode, s.hash_params,
            optimizer, hparams, step)

    def counted_backward_fused_(self, grad_output: Tensor, weights: Tensor, state1: Tensor,
                                state2: Tensor, step: Optional[Tensor], optimizer: int,
                                hparams: List[float], lr: Optional[Tensor] = None) -> None:
        """:meth:`backward_fused_` whose step count is the tensor ``step``, advanced by one
        inside the op, and whose rate, where ``lr`` is given, is that tensor's one float,
        read in place of ``hparams[0]`` (what a compiled backward needs: no host read of
        the count, no guard on the rate)."""
        s = self.layout
        torch.ops.robe.counted_backward_fused_(
            grad_output, weights, state1, state2, step, optimizer, hparams, self.values,
            self.offsets, self.per_sample_weights, s.table_meta, s.block_size, s.hash_mode,
            s.hash_params, lr)
