"""ROBE-Z compressed embedding tables for TorchRec.

Example::

    >>> from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
    >>> ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=1000, block_size=32))
    >>> ebc.layout.array_sizes           # RobeLayout: where every table and feature lives

The ops (:mod:`robe_torchrec.ops`: the registered ``torch.ops.robe`` ops, their Triton and
reference implementations, the fused optimizers) need torch alone (Triton for CUDA tensors),
so a machine without torchrec/fbgemm can still import them. The module, its layout, optimizer
and sharder need torchrec: without it they raise an ``ImportError`` that says so when used.

Importing this package with torchrec present calls :func:`install`, which makes every change
robe_torchrec makes to TorchRec's (and torch's) behaviour, and returns their names
(:mod:`robe_torchrec.installation` says what each does and why).
"""

from robe_torchrec.config import RobeConfig
from robe_torchrec.hashing import HashMode
from robe_torchrec.installation import install
from robe_torchrec.ops.args import LayoutArgs, LookupArgs

try:
    import torchrec  # noqa: F401  (fbgemm_gpu too: torchrec imports it)
except ImportError as _exc:  # torch-only environments (a bare GPU image): the ops only
    _TORCHREC_ERROR = _exc
else:
    _TORCHREC_ERROR = None
    from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
    from robe_torchrec.embedding_collection import RobeEmbeddingCollection
    from robe_torchrec.layout import FeatureLayout, RobeLayout, TableLayout
    from robe_torchrec.optim import RobeFusedOptimizer

    # the one place robe_torchrec changes TorchRec: the DMP default sharders, RowWiseAdagrad
    # on ROBE arrays, the unsharded-module checks... (robe_torchrec.installation.CHANGES)
    install()
    from robe_torchrec import distributed  # noqa: F401  isort: skip  (loaded by install())

#: the names that need torchrec, and the module each comes from
_NEEDS_TORCHREC = {"RobeEmbeddingBagCollection": "embedding_bag",
                   "RobeEmbeddingCollection": "embedding_collection", "FeatureLayout": "layout",
                   "RobeLayout": "layout", "TableLayout": "layout", "RobeFusedOptimizer": "optim",
                   "distributed": "distributed"}


def __getattr__(name: str):
    # only reached when torchrec failed to import: the eager imports above define the rest
    if name in _NEEDS_TORCHREC:
        raise ImportError(
            f"robe_torchrec.{name} needs torchrec (and fbgemm_gpu), which failed to import "
            f"({_TORCHREC_ERROR}); install torchrec, or use robe_torchrec.ops, which needs "
            "torch alone") from _TORCHREC_ERROR
    raise AttributeError(f"module 'robe_torchrec' has no attribute {name!r}")


__all__ = ["FeatureLayout", "HashMode", "LayoutArgs", "LookupArgs", "RobeConfig",
           "RobeEmbeddingBagCollection",
           "RobeEmbeddingCollection", "RobeFusedOptimizer", "RobeLayout", "TableLayout",
           "install"]
__version__ = "0.1.0"
