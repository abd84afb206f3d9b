"""Train pipelines for TorchRec models with ROBE-Z (or stock) embeddings.

The SparseDist, FusedSparseDist and SemiSync variants land with issue #4; until then this
package is empty and TorchRec's own ``torchrec.distributed.train_pipeline`` is the one to use.
"""
