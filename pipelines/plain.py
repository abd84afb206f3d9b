"""The textbook training loop as a ``TrainPipeline``: no overlap of any kind.

It exists so that a training app can switch pipelines by name, and as the reference the
overlapping pipelines are compared with (the parity tests run it on the same DMP model).

Example::

    >>> pipeline = PlainPipeline(model, dense_optimizer, torch.device("cpu"))
    >>> it = iter(dataloader)
    >>> while True:
    ...     try:
    ...         loss, logits, labels = pipeline.progress(it)  # DLRMTrain output
    ...     except StopIteration:
    ...         break
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.train_pipeline import TrainPipeline


class PlainPipeline(TrainPipeline):
    """next batch, forward, backward, optimizer step; in that order, one batch at a time.

    Args:
        model: returns ``(losses, output)`` from ``forward(batch)`` (e.g. ``DLRMTrain``); may
            be DMP-wrapped or not.
        optimizer: the dense optimizer (embeddings with a fused optimizer update themselves
            inside backward).
        device: where the batch is moved before the forward.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        super().__init__()
        self._model = model
        self._optimizer = optimizer
        self._device = device
        self._index = 0

    def progress(self, dataloader_iter: Iterator) -> object:
        batch = next(dataloader_iter)  # StopIteration ends training, as in TorchRec
        # Pipelineable.to: how TorchRec batches (Batch, KJT, tensors) move, public API
        batch = batch.to(device=self._device, non_blocking=False)
        # zero_grad before the forward, where TrainPipelineSparseDist puts it, so that the
        # gradients a caller may read after progress() are the same in every pipeline
        if self._model.training:
            self._optimizer.zero_grad()
        with record_function(f"## forward {self._index} ##"):
            losses, output = self._model(batch)
        if self._model.training:
            with record_function(f"## backward {self._index} ##"):
                torch.sum(losses, dim=0).backward()
            with record_function(f"## optimizer {self._index} ##"):
                self._optimizer.step()
        self._index += 1
        return output

    def reset(self) -> None:
        self._index = 0
