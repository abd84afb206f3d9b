"""Sharding TorchRec's ``FeatureProcessedEmbeddingBagCollection`` around a ROBE module.

A TorchRec model with position-weighted features wraps its ``EmbeddingBagCollection`` in a
``FeatureProcessedEmbeddingBagCollection`` (FP-EBC): the feature processors (for example
``PositionWeightedModuleCollection``) turn each id's position in its bag into a per-sample
weight, and the collection pools with those weights. Swapping the inner collection for a
``RobeEmbeddingBagCollection(..., is_weighted=True)`` works unsharded as it is. Sharded,
TorchRec's ``FeatureProcessedEmbeddingBagCollectionSharder`` hands the inner collection to an
``EmbeddingBagCollectionSharder``, which cannot plan or shard a ROBE module (the planner
stops on a missing ``embedding_bags``).

:class:`RobeFeatureProcessedEmbeddingBagCollectionSharder` is that sharder with the inner
sharder chosen per module: :class:`~robe_torchrec.distributed.RobeEmbeddingBagCollectionSharder`
for a ROBE collection, TorchRec's otherwise (then it plans and shards exactly as TorchRec's
does). TorchRec's ``ShardedFeatureProcessedEmbeddingBagCollection`` does the rest: feature
processors after the input dist, the inner sharded module's ``compute`` and output dist,
and its fused optimizer. :func:`~robe_torchrec.distributed.get_default_sharders` (and
therefore ``DistributedModelParallel(model)`` without ``sharders=``) holds this sharder in
place of TorchRec's, and :func:`robe_torchrec.install` makes TorchRec's own refuse a ROBE
collection with an error naming that fix
(:func:`robe_torchrec.distributed.unsharded.install_fp_sharder_check`).

Example::

    >>> ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=100), is_weighted=True)
    >>> fp = FeatureProcessedEmbeddingBagCollection(
    ...     ebc, PositionWeightedModuleCollection({"f0": 20}))
    >>> dmp = DistributedModelParallel(Model(fp))   # default sharders: this one inside
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import (
    FeatureProcessedEmbeddingBagCollectionSharder,
    ShardedFeatureProcessedEmbeddingBagCollection,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

from robe_torchrec.array_module import RobeArrayModule
from robe_torchrec.distributed.sharder import (RobeEmbeddingBagCollectionSharder,
                                               planner_sharding_types)


def inner_collection(module: FeatureProcessedEmbeddingBagCollection) -> nn.Module:
    """The collection an FP-EBC pools with. TorchRec keeps it in ``_embedding_bag_collection``
    with no public accessor; its own sharder reads that attribute too."""
    return module._embedding_bag_collection


def holds_robe(module: nn.Module) -> bool:
    """Whether ``module`` is an FP-EBC whose collection is a ROBE module."""
    return (isinstance(module, FeatureProcessedEmbeddingBagCollection)
            and isinstance(inner_collection(module), RobeArrayModule))


class RobeFeatureProcessedEmbeddingBagCollectionSharder(
        FeatureProcessedEmbeddingBagCollectionSharder):
    """TorchRec's FP-EBC sharder whose inner collection may be a ``RobeEmbeddingBagCollection``
    (see the module docstring).

    The planner asks :meth:`sharding_types` and :meth:`compute_kernels` (which take no
    module) right after :meth:`shardable_parameters` for the same module; they answer for the
    inner collection that call saw. A ROBE collection is offered the types under which it
    computes what it computes unsharded (data-parallel, and table-wise for per-table arrays);
    never row-wise, which TorchRec's planner does not offer inside an FP-EBC either (without
    explicit constraints), and which is untested there: a plan that asks for it is refused.

    Args:
        ebc_sharder: the sharder of a stock inner collection (TorchRec's default when None).
        robe_sharder: the sharder of a ROBE inner collection (a default
            :class:`RobeEmbeddingBagCollectionSharder` with this sharder's codecs when None);
            its ``fused_params`` give the in-backward optimizer when sharding, where
            ``apply_optimizer_in_backward`` was not called.
        qcomm_codecs_registry: as TorchRec's sharders.

    Example::

        >>> sharder = RobeFeatureProcessedEmbeddingBagCollectionSharder()
        >>> DistributedModelParallel(model, sharders=[sharder, *other_sharders])
    """

    def __init__(self, ebc_sharder: Optional[EmbeddingBagCollectionSharder] = None,
                 robe_sharder: Optional[RobeEmbeddingBagCollectionSharder] = None,
                 qcomm_codecs_registry: Optional[Dict[str, object]] = None) -> None:
        super().__init__(ebc_sharder=ebc_sharder, qcomm_codecs_registry=qcomm_codecs_registry)
        self.robe_sharder = robe_sharder or RobeEmbeddingBagCollectionSharder(
            qcomm_codecs_registry=self.qcomm_codecs_registry)
        #: the ROBE types of the module last passed to shardable_parameters; None: a stock one
        self._robe_types: Optional[List[str]] = None

    def sharder_for(self, module: FeatureProcessedEmbeddingBagCollection
                    ) -> Optional[RobeEmbeddingBagCollectionSharder]:
        """The ROBE sharder when ``module`` holds a ROBE collection, else None (TorchRec's
        path)."""
        return self.robe_sharder if holds_robe(module) else None

    def shard(self, module: FeatureProcessedEmbeddingBagCollection,
              params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedFeatureProcessedEmbeddingBagCollection:
        robe = self.sharder_for(module)
        if robe is None:
            return super().shard(module, params, env, device, module_fqn)
        allowed = planner_sharding_types(inner_collection(module).layout)
        refused = {t: p.sharding_type for t, p in params.items()
                   if p.sharding_type not in allowed}
        if refused:
            raise ValueError(
                f"RobeFeatureProcessedEmbeddingBagCollectionSharder: the plan shards tables of "
                f"the ROBE collection inside a FeatureProcessedEmbeddingBagCollection as "
                f"{refused}; inside it only {allowed} are supported (row-wise there is "
                "untested). Plan it with get_default_sharders() or use those types")
        return ShardedFeatureProcessedEmbeddingBagCollection(
            module, params, ebc_sharder=robe, env=env,
            device=device if device is not None else torch.device("cuda"),
            module_fqn=module_fqn)

    def shardable_parameters(self, module: FeatureProcessedEmbeddingBagCollection
                             ) -> Dict[str, nn.Parameter]:
        robe = self.sharder_for(module)
        if robe is None:
            self._robe_types = None
            return super().shardable_parameters(module)
        self._robe_types = planner_sharding_types(inner_collection(module).layout)
        return robe.shardable_parameters(inner_collection(module))

    def sharding_types(self, compute_device_type: str) -> List[str]:
        if self._robe_types is not None:
            return list(self._robe_types)
        return super().sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if self._robe_types is not None:
            return self.robe_sharder.compute_kernels(sharding_type, compute_device_type)
        return super().compute_kernels(sharding_type, compute_device_type)
