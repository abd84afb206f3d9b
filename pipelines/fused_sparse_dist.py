"""FusedSparseDist: the embedding lookup of batch i+1 starts right after the backward of
batch i, overlapping the dense optimizer step of batch i.

Correct only when every embedding is updated inside backward by a fused optimizer (then the
lookup of batch i+1 already sees batch i's update and does not depend on the dense
optimizer) and there are no feature processors: the constructor refuses other models (see
:mod:`robe_torchrec.pipelines.guards`). Under those conditions the weights are bit-identical to
SparseDist's and the plain loop's (``tests/pipelines/test_parity.py``).

Where the lookup runs (options as in TorchRec PR #2916):

* ``emb_lookup_stream``: ``"data_dist"`` (default; the next input dist queues behind the
  lookup, smaller memory), ``"new"`` (a stream of its own), ``"current"`` (the compute
  stream, no overlap). CUDA only; on CPU there are no streams.
* ``embedding_lookup_after_opt``: start the lookup before (default) or after the dense
  optimizer step. On CUDA "before" lets the side-stream lookup run next to the optimizer.

On CPU there are no streams: the work runs in the same order, with nothing overlapped. (A
worker thread running the lookup during the optimizer step was tried and measured slower,
so it is not offered: ``pipelines/results/compare_cpu_overlap.md``.)

Example::

    >>> pipeline = FusedSparseDistPipeline(dmp_model, dense_optimizer, torch.device("cuda"),
    ...                                    emb_lookup_stream="new")
    >>> loss, logits, labels = pipeline.progress(dataloader_iter)
"""

from __future__ import annotations

import time
from typing import Iterator, List, Optional

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.train_pipeline import TrainPipelineFusedSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext

from robe_torchrec.pipelines.forwards import CpuSafeInSyncEmbeddingPipelinedForward, compute_stream
from robe_torchrec.pipelines.guards import check_pipeline_model, uses_streams
from robe_torchrec.torchrec_compat import start_embedding_lookup

_STREAM_CHOICES = ("data_dist", "new", "current")


class FusedSparseDistPipeline(TrainPipelineFusedSparseDist):
    """TorchRec's ``TrainPipelineFusedSparseDist``, made to run on CPU, with the lookup of the
    next batch started right after the backward (before or after the dense optimizer).

    Args:
        model: a DMP-wrapped model whose forward(batch) returns ``(losses, output)``.
        optimizer: the dense optimizer (must not hold embedding parameters).
        device: ``cuda`` uses streams; ``cpu`` runs everything in order.
        emb_lookup_stream: ``"data_dist"`` | ``"new"`` | ``"current"`` (CUDA).
        embedding_lookup_after_opt: start the next lookup after the dense optimizer step.
        **kwargs: passed to ``TrainPipelineFusedSparseDist`` (``execute_all_batches``, ...).
    """

    _pipelined_forward_type = CpuSafeInSyncEmbeddingPipelinedForward

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, emb_lookup_stream: str = "data_dist",
                 embedding_lookup_after_opt: bool = False, **kwargs) -> None:
        if emb_lookup_stream not in _STREAM_CHOICES:
            raise ValueError(f"emb_lookup_stream must be one of {_STREAM_CHOICES}, "
                             f"got {emb_lookup_stream!r}")
        check_pipeline_model(model, optimizer, "FusedSparseDist")
        super().__init__(model, optimizer, device, emb_lookup_stream=emb_lookup_stream,
                         **kwargs)
        # progress() below is ours and steps this optimizer itself: TorchRec's own step
        # helper exists only from torchrec 1.8 on
        self._dense_optimizer = optimizer
        if not uses_streams(device):
            # TorchRec keeps torch.cpu.current_stream() for "current"; CPU has no streams
            self._emb_lookup_stream = None
        self._lookup_after_opt = embedding_lookup_after_opt
        self._segment_seconds: Optional[List[float]] = None

    def time_segments(self) -> List[float]:
        """Time, from now on, the segment this pipeline's options reorder or overlap: the
        dense optimizer step and the start of the next batch's lookup. Returns the list
        that fills with one duration in seconds per training step (on CUDA the device is
        synchronised after the segment, so only call it to measure)."""
        self._segment_seconds = []
        return self._segment_seconds

    def start_embedding_lookup(self, batch, context: EmbeddingTrainPipelineContext) -> None:
        """Start the lookup and output dist of ``batch`` (its input dist has completed)."""
        if batch is None or context.embedding_a2a_requests:
            return
        with record_function(f"## start_embedding_lookup {context.index} ##"):
            target = compute_stream(self._device)
            if self._emb_lookup_stream is not None and target is not None:
                # the lookup must read the weights the fused backward just wrote on the
                # compute stream; TorchRec's version does not order the two streams
                self._emb_lookup_stream.wait_stream(target)
            with self._stream_context(self._emb_lookup_stream):
                for module in self._pipelined_modules:
                    start_embedding_lookup(module, context, source_stream=self._data_dist_stream,
                                           target_stream=target,
                                           stream_context=self._stream_context)

    def wait_embedding_lookup(self) -> None:
        if self._emb_lookup_stream is not None:
            super().wait_embedding_lookup()

    def _dense_optimizer_step(self) -> None:
        with record_function(f"## optimizer {self.contexts[0].index} ##"):
            self._dense_optimizer.step()

    def _optimizer_and_next_lookup(self) -> None:
        nxt = (self.batches[1], self.contexts[1]) if len(self.batches) >= 2 else None
        if nxt is None:
            self._dense_optimizer_step()
        elif self._lookup_after_opt:
            self._dense_optimizer_step()
            self.start_embedding_lookup(*nxt)
        else:
            self.start_embedding_lookup(*nxt)
            self._dense_optimizer_step()

    def progress(self, dataloader_iter: Iterator):
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        self._set_module_context(self.contexts[0])
        # the first batch (or one after eval/reset) has no lookup in flight yet
        self.start_embedding_lookup(self.batches[0], self.contexts[0])
        if self._model.training:
            with record_function("## zero_grad ##"):
                self._dense_optimizer.zero_grad()
        self._wait_for_batch()
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        self.enqueue_batch(dataloader_iter)  # batch i+2
        self.wait_embedding_lookup()
        with record_function(f"## forward {self.contexts[0].index} ##"):
            losses, output = self._model_fwd(self.batches[0])
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])
        if self._model.training:
            self._backward(losses)
            # the fused optimizer has updated every embedding inside backward
            start = time.perf_counter()
            self._optimizer_and_next_lookup()
            if self._segment_seconds is not None:
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)
                self._segment_seconds.append(time.perf_counter() - start)
        self.dequeue_batch()
        return output
