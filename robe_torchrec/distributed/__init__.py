"""Sharding ``RobeEmbeddingBagCollection`` with TorchRec (``DistributedModelParallel``).

:func:`robe_torchrec.install` (run by ``import robe_torchrec``) adds
:class:`RobeEmbeddingBagCollectionSharder` to the sharders ``DistributedModelParallel`` uses
when given none (:mod:`robe_torchrec.distributed.defaults`), and makes DMP and TorchRec's
``shard`` / ``shard_modules`` refuse to leave a ROBE module unsharded
(:mod:`robe_torchrec.distributed.unsharded`). Importing this package changes nothing more.

Example::

    >>> import robe_torchrec.distributed
    >>> apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.05})
    >>> model = DistributedModelParallel(model)            # plans and shards the ROBE module
    >>> model = DistributedModelParallel(model, env, device,
    ...                                  sharders=robe_torchrec.distributed.get_default_sharders())
"""

from robe_torchrec.distributed.defaults import get_default_sharders, install_default_sharder
from robe_torchrec.distributed.fp_sharder import RobeFeatureProcessedEmbeddingBagCollectionSharder
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

from robe_torchrec.distributed.unsharded import (
    UnshardedRobeModuleError,
    install_ddp_check,
    install_dmp_check,
    install_fp_sharder_check,
    install_shard_check,
)

__all__ = [
    "RobeEmbeddingBagCollectionSharder",
    "RobeEmbeddingCollectionSharder",
    "RobeFeatureProcessedEmbeddingBagCollectionSharder",
    "ShardedRobeEmbeddingBagCollection",
    "ShardedRobeEmbeddingCollection",
    "ShardedRobeFusedOptimizer",
    "UnshardedRobeModuleError",
    "get_default_sharders",
    "install_default_sharder",
    "install_ddp_check",
    "install_dmp_check",
    "install_fp_sharder_check",
    "install_shard_check",
    "planner_sharding_types",
    "robe_sharding_constraints",
]
