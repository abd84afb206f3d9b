"""SemiSync: the dense forward/backward of batch i runs while the embedding work of batch
i+1 proceeds, so batch i+1 reads embeddings that do not yet have batch i's update (one step
stale). Not bit-identical to the other pipelines; how far it drifts is measured in
``tests/pipelines/test_parity.py`` and ``pipelines/results/compare_cpu.md``.

* ``start_batch``: batches before it train synchronously (as SparseDist); TorchRec's
  default 900 is kept, short runs should pass a small value.
* ``stash_gradients``: also delay the dense update by one step, so dense and embedding
  parameters are equally stale ("true" semi-sync); without it the dense optimizer steps
  as soon as its gradients exist.

Like FusedSparseDist it refuses models with feature processors or with embeddings not
updated by a fused optimizer (:mod:`robe_torchrec.pipelines.guards`).

Example::

    >>> pipeline = SemiSyncPipeline(dmp_model, dense_optimizer, torch.device("cpu"),
    ...                             start_batch=10, stash_gradients=False)
    >>> loss, logits, labels = pipeline.progress(dataloader_iter)
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync
from torchrec.distributed.train_pipeline.pipeline_context import (
    EmbeddingTrainPipelineContext,
    TrainPipelineContext,
)

from robe_torchrec.pipelines.forwards import CpuSafeEmbeddingPipelinedForward, compute_stream
from robe_torchrec.pipelines.guards import check_pipeline_model
from robe_torchrec.torchrec_compat import start_embedding_lookup, wait_for_events

DEFAULT_START_BATCH = 900  # TorchRec's


class SemiSyncPipeline(TrainPipelineSemiSync):
    """TorchRec's ``TrainPipelineSemiSync`` made to run on CPU (no streams, no
    ``record_stream``, no implicit CUDA device), refusing models it would train wrong.

    Args:
        model: a DMP-wrapped model whose forward(batch) returns ``(losses, output)``.
        optimizer: the dense optimizer (must not hold embedding parameters).
        device: ``cuda`` uses TorchRec's streams and events; ``cpu`` runs in order.
        start_batch: first batch trained semi-synchronously.
        stash_gradients: delay the dense update by one step as well.
        **kwargs: passed to ``TrainPipelineSemiSync``.
    """

    _pipelined_forward_type = CpuSafeEmbeddingPipelinedForward

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, start_batch: int = DEFAULT_START_BATCH,
                 stash_gradients: bool = False, **kwargs) -> None:
        check_pipeline_model(model, optimizer, "SemiSync")
        kwargs.setdefault("strict", True)
        super().__init__(model, optimizer, device, start_batch=start_batch,
                         stash_gradients=stash_gradients, **kwargs)

    def set_next_batch_index(self, index: int) -> None:
        """Number the next batch ``index``. A run resumed from a checkpoint at step ``index``
        calls this, so that ``start_batch`` falls on the same step as in the run it continues
        (batches are numbered from 0 when the pipeline is built). Only between batches."""
        if self.batches:
            raise RuntimeError("set_next_batch_index: batches are in flight; call it before "
                               "the first progress() or after the data ran out")
        self._next_index = index

    def start_embedding_lookup(self, batch, context: EmbeddingTrainPipelineContext) -> None:
        if batch is None:
            return
        with record_function(f"## start_embedding_lookup {context.index} ##"):
            target = compute_stream(self._device)
            wait_for_events(batch, context, target)
            for module in self._pipelined_modules:
                start_embedding_lookup(module, context, source_stream=self._data_dist_stream,
                                       target_stream=target,
                                       stream_context=self._stream_context)
                event = torch.get_device_module(self._device).Event()
                event.record()
                context.events.append(event)

    def _mlp_forward(self, batch, context: TrainPipelineContext) -> Tuple[torch.Tensor, object]:
        with record_function(f"## forward {context.index} ##"):
            wait_for_events(batch, context, compute_stream(self._device))
            return self._model_fwd(batch)
