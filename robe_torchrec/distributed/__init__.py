"""Sharding ``RobeEmbeddingBagCollection`` with TorchRec (``DistributedModelParallel``).

Importing this package adds :class:`RobeEmbeddingBagCollectionSharder` to the sharders
``DistributedModelParallel`` uses when given none (see :mod:`robe_torchrec.distributed.defaults`).

Example::

    >>> import robe_torchrec.distributed
    >>> apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.05})
    >>> model = DistributedModelParallel(model)            # plans and shards the ROBE module
    >>> model = DistributedModelParallel(model, env, device,
    ...                                  sharders=robe_torchrec.distributed.get_default_sharders())
"""

from robe_torchrec.distributed.defaults import get_default_sharders, install_default_sharder
from robe_torchrec.distributed.sequence_sharder import (
    RobeEmbeddingCollectionSharder,
    ShardedRobeEmbeddingCollection,
)
from robe_torchrec.distributed.sharder import (
    RobeEmbeddingBagCollectionSharder,
    ShardedRobeEmbeddingBagCollection,
    ShardedRobeFusedOptimizer,
    robe_sharding_constraints,
    planner_sharding_types,
)

from robe_torchrec.distributed.unsharded import UnshardedRobeModuleError, install_dmp_check

install_default_sharder()
install_dmp_check()

__all__ = [
    "RobeEmbeddingBagCollectionSharder",
    "RobeEmbeddingCollectionSharder",
    "ShardedRobeEmbeddingBagCollection",
    "ShardedRobeEmbeddingCollection",
    "ShardedRobeFusedOptimizer",
    "UnshardedRobeModuleError",
    "get_default_sharders",
    "install_default_sharder",
    "install_dmp_check",
    "planner_sharding_types",
    "robe_sharding_constraints",
]
