"""The train-pipeline factory of the ``pipeline`` config group: ``robe_torchrec.pipelines.make_pipeline``
(plain, sparse_dist, fused_sparse_dist, semi_sync), with the config's errors.

Example::

    >>> pipeline = make_pipeline("sparse_dist", dmp, dense_optimizer, torch.device("cpu"))
    >>> loss, logits, labels = pipeline.progress(batches)   # StopIteration when exhausted
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipeline

from robe_torchrec.pipelines import make_pipeline as factory
from robe_torchrec.train.config import ConfigError


def make_pipeline(name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                  device: torch.device, **options: Any) -> TrainPipeline:
    """A TrainPipeline by name. ``optimizer`` is the dense optimizer only: embeddings are
    updated inside backward, and FusedSparseDist / SemiSync refuse a model whose embedding
    parameters the optimizer they step would also update."""
    try:
        return factory(name, model, optimizer, device, **options)
    except ValueError as e:  # e.g. an option the pipeline does not take
        raise ConfigError(f"pipeline={name}: {e}") from e
