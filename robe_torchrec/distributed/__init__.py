"""Sharding ``RobeEmbeddingBagCollection`` with TorchRec (``DistributedModelParallel``).

Example::

    >>> from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder
    >>> sharder = RobeEmbeddingBagCollectionSharder()
    >>> apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.05})
    >>> model = DistributedModelParallel(model, env, device, sharders=[sharder, *defaults])
"""

from robe_torchrec.distributed.sharder import (
    RobeEmbeddingBagCollectionSharder,
    ShardedRobeEmbeddingBagCollection,
    ShardedRobeFusedOptimizer,
    robe_sharding_constraints,
)

__all__ = [
    "RobeEmbeddingBagCollectionSharder",
    "ShardedRobeEmbeddingBagCollection",
    "ShardedRobeFusedOptimizer",
    "robe_sharding_constraints",
]
