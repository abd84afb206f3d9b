"""The train-pipeline factory: ``pipelines.make_pipeline`` once it exists (issue #4),
TorchRec's own pipelines until then.

Example::

    >>> pipeline = make_pipeline("sparse_dist", dmp, optimizer, torch.device("cpu"))
    >>> loss, logits, labels = pipeline.progress(batches)   # StopIteration when exhausted
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineFusedSparseDist,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
)

from robe_torchrec.train.config import PIPELINES, ConfigError

_TORCHREC = {
    "plain": TrainPipelineBase,
    "sparse_dist": TrainPipelineSparseDist,
    "fused_sparse_dist": TrainPipelineFusedSparseDist,
    "semi_sync": TrainPipelineSemiSync,
}


def make_pipeline(name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                  device: torch.device, **options: Any) -> TrainPipeline:
    """A TrainPipeline by name ("plain", "sparse_dist", "fused_sparse_dist", "semi_sync")."""
    if name not in PIPELINES:
        raise ConfigError(f"pipeline.name: unknown pipeline {name!r}; choose one of "
                          f"{', '.join(PIPELINES)}")
    try:
        from pipelines import make_pipeline as factory  # issue #4's pipelines
    except ImportError:
        factory = None
    if factory is not None:
        return factory(name, model, optimizer, device, **options)
    return _TORCHREC[name](model, optimizer, device, **options)
