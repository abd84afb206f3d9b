"""Pipelined forwards of TorchRec's FusedSparseDist and SemiSync that also run on CPU.

TorchRec builds each pipelined forward with the data-dist stream, and when there is none
(CPU) it assumes ``device = cuda``; SemiSync's forward then also calls ``record_stream``
on the embeddings, which CPU tensors reject. These subclasses take the device from the
pipeline instead and skip stream bookkeeping when there is no stream; on CUDA they behave
exactly as TorchRec's.

Example (what the pipelines in this package do)::

    >>> class MyPipeline(TrainPipelineSemiSync):
    ...     _pipelined_forward_type = CpuSafeEmbeddingPipelinedForward
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch
from torchrec.distributed.train_pipeline.runtime_forwards import (
    EmbeddingPipelinedForward,
    InSyncEmbeddingPipelinedForward,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor


def compute_stream(device: torch.device) -> Optional[torch.Stream]:
    """The stream the forward/backward runs on, or ``None`` where there are no streams
    (CPU: TorchRec would pass a ``torch.cpu.Stream`` on to ``record_stream``, which fails)."""
    if device.type in ("cuda", "mtia"):
        return torch.get_device_module(device).current_stream()
    return None


class _DeviceFromStreamOrCpu:
    """Mixin: TorchRec sets ``_device = cuda`` when the forward has no stream; without a
    stream the pipeline is a CPU one (the pipelines create streams for cuda and mtia)."""

    def _fix_device(self) -> None:
        if self._stream is None:  # type: ignore[attr-defined]
            self._device = torch.device("cpu")  # type: ignore[attr-defined]


class CpuSafeInSyncEmbeddingPipelinedForward(_DeviceFromStreamOrCpu,
                                             InSyncEmbeddingPipelinedForward):
    """FusedSparseDist's forward: consumes the lookup started earlier; embeddings keep their
    autograd graph (the fused backward runs inside the dense backward)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fix_device()


class CpuSafeEmbeddingPipelinedForward(_DeviceFromStreamOrCpu, EmbeddingPipelinedForward):
    """SemiSync's forward: consumes the lookup started earlier and detaches the embeddings,
    so the dense backward stops at them and the pipeline runs the embedding backward
    itself."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fix_device()

    def detach_embeddings(self, embeddings: Union[Dict[str, JaggedTensor], KeyedTensor],
                          cur_stream: torch.Stream) -> None:
        if self._stream is not None or not isinstance(embeddings, KeyedTensor):
            # CUDA, or an EmbeddingCollection's dict (no record_stream on that path)
            super().detach_embeddings(embeddings, cur_stream)
            return
        # CPU and a KeyedTensor: the same bookkeeping without record_stream. The pipeline's
        # embedding_backward later feeds the detached tensor's grad into the original one.
        # KeyedTensor has no public setter for its values: TorchRec's own detach_embeddings
        # swaps them the same way, and this must stay in step with it.
        original = embeddings.values()
        leaf = original.detach().requires_grad_()
        leaf.retain_grad()
        embeddings._values = leaf
        self._context.embedding_tensors.append([original])
        self._context.embedding_features.append([list(embeddings.keys())])
        self._context.detached_embedding_tensors.append([leaf])
