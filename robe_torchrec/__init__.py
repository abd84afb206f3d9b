"""ROBE-Z compressed embedding tables for TorchRec.

Example::

    >>> from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
    >>> ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=1000, block_size=32))
    >>> ebc.layout.array_sizes           # RobeLayout: where every table and feature lives
"""

from robe_torchrec.config import RobeConfig
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.embedding_collection import RobeEmbeddingCollection
from robe_torchrec.hashing import HashMode
from robe_torchrec.layout import FeatureLayout, RobeLayout, TableLayout
from robe_torchrec.ops.args import LayoutArgs, LookupArgs
from robe_torchrec.optim import RobeFusedOptimizer

# Registers the ROBE sharder with DistributedModelParallel's default sharders, so that
# DistributedModelParallel(model) shards a ROBE module with nothing more to import.
from robe_torchrec import distributed  # noqa: E402,F401  isort: skip

__all__ = ["FeatureLayout", "HashMode", "LayoutArgs", "LookupArgs", "RobeConfig",
           "RobeEmbeddingBagCollection",
           "RobeEmbeddingCollection", "RobeFusedOptimizer", "RobeLayout", "TableLayout"]
__version__ = "0.1.0"
