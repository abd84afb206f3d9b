"""Sharding ``RobeEmbeddingCollection`` (unpooled) with ``DistributedModelParallel``.

:class:`ShardedRobeEmbeddingCollection` is TorchRec's ``ShardedEmbeddingCollection`` (its
sequence input dist, output dist, ``Dict[str, JaggedTensor]`` assembly and VBE handling) with
ROBE's per-rank lookups, optimizer and state dict, the same as the pooled module's
(:class:`~robe_torchrec.distributed.sharder.RobeShardedArrays`): each lookup returns one
embedding per id. :class:`RobeEmbeddingCollectionSharder` plans it with the pooled sharder's
rules (data-parallel, table-wise for per-table arrays, row-wise when asked for; sizes are
the compressed ones).

Example::

    >>> apply_optimizer_in_backward(torch.optim.SGD, [model.ec.weight], {"lr": 0.1})
    >>> dmp = DistributedModelParallel(model)      # default sharders include this one
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import torch
from torch import nn
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingConfig

from robe_torchrec.distributed.sharder import (
    RobeEmbeddingBagCollectionSharder,
    RobeShardedArrays,
    compressed_shape,
    resolve_fused_optimizer,
)
from robe_torchrec.embedding_collection import RobeEmbeddingCollection


class EmbeddingCollectionView:
    """What ``ShardedEmbeddingCollection.__init__`` reads from the module it shards: the
    table configs, one meta parameter per table named as an ``EmbeddingCollection`` names it
    (shaped as its compressed size) and the flags; on the meta device, so the base
    constructor loads no state (the ROBE state dict is loaded by the sharded module)."""

    def __init__(self, module: RobeEmbeddingCollection) -> None:
        self._module = module
        self._params = {
            f"embeddings.{name}.weight": nn.Parameter(
                torch.empty(compressed_shape(module.layout, t), device="meta"),
                requires_grad=False)
            for t, name in enumerate(module.layout.table_names)
        }
        self.device = torch.device("meta")

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._module.embedding_configs()

    def embedding_names_by_table(self) -> List[List[str]]:
        return self._module.embedding_names_by_table()

    def embedding_dim(self) -> int:
        return self._module.embedding_dim()

    def need_indices(self) -> bool:
        return self._module.need_indices()

    def use_gather_select(self) -> bool:
        return self._module.use_gather_select()

    def use_gather_select_per_sharding(self) -> Optional[Dict[str, bool]]:
        return self._module.use_gather_select_per_sharding()

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        return iter(self._params.items())

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)


class ShardedRobeEmbeddingCollection(RobeShardedArrays, ShardedEmbeddingCollection):
    """``RobeEmbeddingCollection`` sharded by TorchRec (built by the sharder).

    State dict and optimizer as ``ShardedRobeEmbeddingBagCollection``'s: ``weight`` (the
    unsharded module's flat array, plain or ``ShardedTensor``) and ``robe_layout``, so
    checkpoints move between the unsharded and sharded modules and sharding types.
    """

    def __init__(
        self,
        module: RobeEmbeddingCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        optimizer: Tuple[Type[torch.optim.Optimizer], Dict[str, Any]],
        device: Optional[torch.device] = None,
        qcomm_codecs_registry=None,
        module_fqn: Optional[str] = None,
    ) -> None:
        self._robe_init(module, EmbeddingCollectionView(module), table_name_to_parameter_sharding,
                        env, optimizer, device, qcomm_codecs_registry, module_fqn)

    def _create_lookups(self) -> None:
        self._robe_create_lookups(list(self._sharding_type_to_sharding.values()), unpooled=True)

    @property
    def unsharded_module_type(self) -> Type[RobeEmbeddingCollection]:  # type: ignore[override]
        return RobeEmbeddingCollection


class RobeEmbeddingCollectionSharder(RobeEmbeddingBagCollectionSharder):
    """Shards :class:`~robe_torchrec.RobeEmbeddingCollection` for
    ``DistributedModelParallel`` and ``EmbeddingShardingPlanner``: the sharding types, the
    compressed sizes and the fused optimizer are planned as for the pooled module (see
    :class:`RobeEmbeddingBagCollectionSharder`), ``row_wise`` included: offered with
    ``row_wise=True``, where each rank's rows hash into the rank's slice of the array, as
    for the pooled module (an id gets the vector a row-wise bag module gives a bag of it).

    Example::

        >>> planner.plan(model, [RobeEmbeddingCollectionSharder(),
        ...                      RobeEmbeddingBagCollectionSharder()])
        >>> RobeEmbeddingCollectionSharder(row_wise=True)   # offer row_wise too
    """

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
                 row_wise: bool = False) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry,
                         row_wise=row_wise)

    def shard(self, module: RobeEmbeddingCollection, params: Dict[str, ParameterSharding],
              env: ShardingEnv, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedRobeEmbeddingCollection:
        return ShardedRobeEmbeddingCollection(
            module, params, env, resolve_fused_optimizer(module, self.fused_params), device,
            qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn)

    @property
    def module_type(self) -> Type[RobeEmbeddingCollection]:  # type: ignore[override]
        return RobeEmbeddingCollection

    @property
    def sharded_module_type(self) -> Type[ShardedRobeEmbeddingCollection]:  # type: ignore[override]
        return ShardedRobeEmbeddingCollection
