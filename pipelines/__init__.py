"""Train pipelines for TorchRec models with ROBE-Z (or stock) embeddings, selectable by name.

* ``"plain"``: next batch, forward, backward, optimizer step; no overlap.
* ``"sparse_dist"``: TorchRec's TrainPipelineSparseDist (input dist of the next batch
  overlaps this batch's forward/backward).
* ``"fused_sparse_dist"``: also starts the next batch's embedding lookup right after this
  batch's fused backward, overlapping the dense optimizer step. Same numbers as the above.
* ``"semi_sync"``: the next batch's embedding lookup overlaps this batch's dense
  forward/backward (embeddings one step stale). Slightly different numbers.

Example::

    >>> from robe_torchrec.pipelines import make_pipeline
    >>> pipeline = make_pipeline("sparse_dist", dmp_model, dense_opt, torch.device("cpu"))
    >>> it = iter(dataloader)
    >>> loss, logits, labels = pipeline.progress(it)  # DLRMTrain output
"""

from robe_torchrec.pipelines.factory import PIPELINES, make_pipeline, run_to_end
from robe_torchrec.pipelines.fused_sparse_dist import FusedSparseDistPipeline
from robe_torchrec.pipelines.guards import PipelineModelError, check_pipeline_model
from robe_torchrec.pipelines.plain import PlainPipeline
from robe_torchrec.pipelines.semi_sync import SemiSyncPipeline
from robe_torchrec.pipelines.sparse_dist import SparseDistPipeline

__all__ = [
    "PIPELINES",
    "FusedSparseDistPipeline",
    "PipelineModelError",
    "PlainPipeline",
    "SemiSyncPipeline",
    "SparseDistPipeline",
    "check_pipeline_model",
    "make_pipeline",
    "run_to_end",
]
