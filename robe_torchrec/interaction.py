"""A faster drop-in for TorchRec's DLRM dot interaction (``InteractionArch``) on CPU.

TorchRec's ``InteractionArch`` picks the upper triangle of the ``B x (F+1) x (F+1)`` Gram
matrix with two-index advanced indexing. Its backward is ``index_put_`` with accumulation,
which is serial on CPU, and autograd runs two batched matmuls for the Gram matrix's
gradient. On the app's step (batch 2048, 26 features, dim 16, 1 thread) that interaction was
about 20 ms of a 50-60 ms step, more than the embeddings.

:class:`FastInteractionArch` computes the same output with the same buffer, and a backward
that gathers the gradient into a symmetric matrix (no accumulation) and runs one batched
matmul. The output equals TorchRec's exactly (the same products, gathered); the gradient
differs only by summation order (tested in float64).

Example::

    >>> model = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
    ...              dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 1])
    >>> use_fast_interaction(model)     # swaps model.inter_arch; state_dict keys unchanged
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, InteractionArch


class _UpperTriangleDots(torch.autograd.Function):
    """``bmm(x, x^T)`` flattened, restricted to the strict upper triangle."""

    @staticmethod
    def forward(ctx, combined: torch.Tensor, upper: torch.Tensor, pair_of_cell: torch.Tensor
                ) -> torch.Tensor:
        ctx.save_for_backward(combined, pair_of_cell)
        return torch.bmm(combined, combined.transpose(1, 2)).flatten(1).index_select(1, upper)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        combined, pair_of_cell = ctx.saved_tensors
        batch, n, _ = combined.shape
        # d(x_i . x_j)/dx touches rows i and j: a symmetric gradient (g_ij at (i, j) and
        # (j, i), 0 on the diagonal) and one matmul. It is gathered from the gradient padded
        # with a zero column: on CPU a gather is cheaper than scattering into both triangles.
        padded = torch.cat((grad, grad.new_zeros(batch, 1)), dim=1)
        symmetric = padded.index_select(1, pair_of_cell).view(batch, n, n)
        return torch.bmm(symmetric, combined), None, None


@torch.fx.wrap
def upper_triangle_dots(combined: torch.Tensor, upper: torch.Tensor, pair_of_cell: torch.Tensor
                        ) -> torch.Tensor:
    """``bmm(combined, combined^T).flatten(1)[:, upper]`` with the fast backward. Wrapped for
    torch.fx: TorchRec's train pipelines trace the model, and a traced autograd.Function
    would see proxies instead of tensors."""
    return _UpperTriangleDots.apply(combined, upper, pair_of_cell)


class FastInteractionArch(InteractionArch):
    """TorchRec's ``InteractionArch`` (same constructor, buffer and output), faster backward.

    Example::

        >>> arch = FastInteractionArch(num_sparse_features=26)
        >>> arch(torch.rand(8, 16), torch.rand(8, 26, 16)).shape   # B x (D + F + F choose 2)
        torch.Size([8, 367])
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        n = self.F + 1
        rows, cols = self.triu_indices
        pairs = rows.numel()
        pair_of_cell = torch.full((n * n,), pairs, dtype=torch.int64)  # pairs: the zero column
        pair_of_cell[rows * n + cols] = torch.arange(pairs)
        pair_of_cell[cols * n + rows] = torch.arange(pairs)
        self.register_buffer("_upper_flat", rows * n + cols, persistent=False)
        self.register_buffer("_pair_of_cell", pair_of_cell, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor
                ) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        dots = upper_triangle_dots(combined, self._upper_flat, self._pair_of_cell)
        return torch.cat((dense_features, dots), dim=1)


def use_fast_interaction(model: DLRM) -> DLRM:
    """Replace ``model.inter_arch`` (TorchRec's ``InteractionArch``) by
    :class:`FastInteractionArch` on the same device; returns ``model``. Other interactions
    (``DLRM_DCN``'s cross network, ``DLRM_Projection``'s projections) are not dot products
    and are refused with a ``TypeError``."""
    arch = model.inter_arch
    if type(arch) is not InteractionArch:
        raise TypeError(f"use_fast_interaction: model.inter_arch is {type(arch).__name__}, "
                        "not TorchRec's InteractionArch (the DLRM dot interaction)")
    model.inter_arch = FastInteractionArch(arch.F).to(arch.triu_indices.device)
    return model


def restore_interaction_buffers(model: nn.Module) -> int:
    """Re-create the index buffers of every DLRM dot interaction (TorchRec's
    ``InteractionArch``, :class:`FastInteractionArch`) in ``model``, on the device they are
    on; returns how many interactions were restored.

    The interaction computes which pairs of features it multiplies (``triu_indices``) in its
    constructor, as a non-persistent buffer: a model built on the meta device and then
    materialised (``to_empty`` and ``reset_parameters``, TorchRec's ``init_parameters``, or
    ``DistributedModelParallel``, which fills meta buffers with zeros) keeps garbage or zeros
    there, and no checkpoint holds it. TorchRec's stock ``EmbeddingBagCollection`` DLRM is
    affected alike. Call this after materialising (``model`` may be the DMP).

    Example::

        >>> with torch.device("meta"):
        ...     model = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
        ...                  dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 1])
        >>> init_parameters(model, torch.device("cpu"))    # to_empty + reset_parameters
        >>> restore_interaction_buffers(model)
        1
    """
    restored = 0
    for arch in model.modules():
        if not isinstance(arch, InteractionArch):
            continue
        device = arch.triu_indices.device
        if device.type == "meta":
            raise ValueError(f"restore_interaction_buffers: the {type(arch).__name__} is still "
                             "on the meta device; materialise the model first (to_empty, "
                             "torchrec.distributed.utils.init_parameters or "
                             "DistributedModelParallel)")
        # the constructor is what computes them (FastInteractionArch's from TorchRec's)
        fresh = type(arch)(arch.F)
        for name, buffer in fresh.named_buffers(recurse=False):
            setattr(arch, name, buffer.to(device))
        restored += 1
    return restored


__all__ = ["FastInteractionArch", "restore_interaction_buffers", "use_fast_interaction"]
