"""SparseDist: TorchRec's ``TrainPipelineSparseDist`` (the input dist of batch i+1 overlaps
the forward/backward of batch i). It already runs on CPU; the subclass only gives it a
name in this package and the same constructor shape as the other variants.

Example::

    >>> pipeline = SparseDistPipeline(dmp_model, dense_optimizer, torch.device("cpu"))
    >>> output = pipeline.progress(iter(dataloader))
"""

from __future__ import annotations

from torchrec.distributed.train_pipeline import TrainPipelineSparseDist


class SparseDistPipeline(TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` unchanged (CUDA: memcpy and data-dist streams; CPU: none)."""
