"""``make_pipeline(name, model, optimizer, device, **options)``: pick a train pipeline by
name, so that a training app can switch with one config value.

Example::

    >>> from robe_torchrec.pipelines import make_pipeline
    >>> pipeline = make_pipeline("fused_sparse_dist", dmp_model, dense_opt,
    ...                          torch.device("cpu"), embedding_lookup_after_opt=True)
    >>> it = iter(dataloader)
    >>> loss, logits, labels = pipeline.progress(it)  # DLRMTrain output; StopIteration at the end
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional, Type

import torch
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipeline

from robe_torchrec.pipelines.fused_sparse_dist import FusedSparseDistPipeline
from robe_torchrec.pipelines.plain import PlainPipeline
from robe_torchrec.pipelines.semi_sync import SemiSyncPipeline
from robe_torchrec.pipelines.sparse_dist import SparseDistPipeline

PIPELINES: Dict[str, Type[TrainPipeline]] = {
    "plain": PlainPipeline,
    "sparse_dist": SparseDistPipeline,
    "fused_sparse_dist": FusedSparseDistPipeline,
    "semi_sync": SemiSyncPipeline,
}


def make_pipeline(name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                  device: torch.device, **options) -> TrainPipeline:
    """Build the pipeline called ``name`` (``"plain"``, ``"sparse_dist"``,
    ``"fused_sparse_dist"``, ``"semi_sync"``). ``options`` go to its constructor, e.g.
    ``emb_lookup_stream``, ``embedding_lookup_after_opt`` (FusedSparseDist),
    ``start_batch``, ``stash_gradients`` (SemiSync), ``execute_all_batches`` (TorchRec's).

    Raises ``ValueError`` for an unknown name or for options the pipeline does not take, and
    :class:`robe_torchrec.pipelines.guards.PipelineModelError` when FusedSparseDist or SemiSync would
    train the model wrong.
    """
    try:
        cls = PIPELINES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline {name!r}; choose one of {sorted(PIPELINES)}") from None
    if cls is PlainPipeline and options:
        raise ValueError(f"the 'plain' pipeline takes no options, got {sorted(options)}")
    try:
        return cls(model, optimizer, device, **options)
    except TypeError as e:  # an option the constructor does not know
        raise ValueError(f"pipeline {name!r}: {e}") from e


def run_to_end(pipeline: TrainPipeline, batches: Iterator,
               on_output: Optional[Callable[[Any], None]] = None) -> int:
    """``pipeline.progress(batches)`` until the iterator is exhausted (a pipeline signals
    that with StopIteration once its queued batches are done); each step's output goes to
    ``on_output``. Returns the number of steps."""
    steps = 0
    while True:
        try:
            output = pipeline.progress(batches)
        except StopIteration:
            return steps
        steps += 1
        if on_output is not None:
            on_output(output)
