"""ROBE-Z compressed embedding tables for TorchRec.

Example::

    >>> from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
    >>> ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=1000, block_size=32))
"""

from robe_torchrec.config import RobeConfig
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.hashing import HashMode
from robe_torchrec.optim import RobeFusedOptimizer

__all__ = ["HashMode", "RobeConfig", "RobeEmbeddingBagCollection", "RobeFusedOptimizer"]
__version__ = "0.1.0"
