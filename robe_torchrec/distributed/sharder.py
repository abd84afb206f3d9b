"""Sharding ``RobeEmbeddingBagCollection`` with TorchRec's ``DistributedModelParallel``.

:class:`RobeEmbeddingBagCollectionSharder` subclasses TorchRec's
``EmbeddingBagCollectionSharder`` and :class:`ShardedRobeEmbeddingBagCollection` subclasses
``ShardedEmbeddingBagCollection``: TorchRec's input dist, output dist, KeyedTensor assembly,
planner and pipelines are reused as they are; only the lookup kernel (``_create_lookups``),
the optimizer and the state dict are ROBE's own. See ``docs/sharding.md`` for semantics.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.fused import FusedOptimizer
from torchrec.optim.keyed import CombinedOptimizer

from robe_torchrec.distributed.lookup import RobeShardedLookup, Segment
from robe_torchrec.array_module import RobeArrayModule
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.layout import FeatureLayout, RobeLayout
from robe_torchrec.ops.deferred_checks import raise_ready
from robe_torchrec.ops.meta import Optimizer, Pooling, rowwise_state_size
from robe_torchrec.optim import RowWiseAdagrad, in_backward_kwargs, resolve_optimizer
from robe_torchrec.torchrec_compat import undo_data_parallel_wrapping
from robe_torchrec.rate_group import RateGroup
from robe_torchrec.variable_batch import order_inverse_indices

DP = ShardingType.DATA_PARALLEL.value
TW = ShardingType.TABLE_WISE.value
RW = ShardingType.ROW_WISE.value
SUPPORTED_SHARDING_TYPES = (DP, TW, RW)
SHARED_SHARDING_TYPES = (DP, RW)
_KERNELS = (EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value)

_EMB_OPT = {
    EmbOptimType.EXACT_SGD: torch.optim.SGD,
    EmbOptimType.SGD: torch.optim.SGD,
    EmbOptimType.EXACT_ADAGRAD: torch.optim.Adagrad,
    EmbOptimType.ADAM: torch.optim.Adam,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: RowWiseAdagrad,
}


# ---------------------------------------------------------------------------------------
# layout helpers
# ---------------------------------------------------------------------------------------

def compressed_shape(layout: RobeLayout, t: int) -> torch.Size:
    """The shape the planner sees for table ``t``: its ROBE floats as ``[rows, dim]``."""
    dim = layout.tables[t].embedding_dim
    return torch.Size([max(1, math.ceil(layout.table_array_share(t) / dim)), dim])


def rw_rows(num_embeddings: int, world: int, rank: int) -> Tuple[int, int]:
    """First row and row count of ``rank`` under ROW_WISE, as TorchRec's input dist buckets
    ids (blocks of ``ceil(num_embeddings / world)`` rows)."""
    block = math.ceil(num_embeddings / world)
    start = min(rank * block, num_embeddings)
    return start, min(block, num_embeddings - start)


def rw_slices(array_size: int, world: int) -> List[Tuple[int, int]]:
    """ROW_WISE: (offset inside the array, size) of each rank's slice: ``world`` equal
    slices, the remainder to the last."""
    base = array_size // world
    return [(r * base, base if r < world - 1 else array_size - base * (world - 1))
            for r in range(world)]


def module_is_weighted(module: RobeArrayModule) -> bool:
    """Whether the module takes per-sample weights (an unpooled module never does)."""
    return isinstance(module, RobeEmbeddingBagCollection) and module.is_weighted()


def resolve_fused_optimizer(
    module: RobeArrayModule, fused_params: Optional[Dict[str, Any]]
) -> Tuple[Type[torch.optim.Optimizer], Dict[str, Any]]:
    """The in-backward optimizer of a sharded module: from ``apply_optimizer_in_backward`` on
    ``module.weight`` if called, else from the sharder's ``fused_params``."""
    applied = module.in_backward_optimizer()
    if applied is not None:
        optimizer_class, kwargs = applied
        # TorchRec's own sharders may have edited the dict (shared with stock tables)
        kwargs = in_backward_kwargs(kwargs)
        resolve_optimizer(optimizer_class, kwargs)
        return optimizer_class, kwargs
    fused_params = fused_params or {}
    opt = fused_params.get("optimizer")
    if opt is None:
        raise ValueError(
            f"sharding {type(module).__name__} needs a fused optimizer: call "
            "torchrec.optim.apply_optimizer_in_backward(torch.optim.SGD|Adagrad|Adam or "
            "torchrec.optim.RowWiseAdagrad, module.parameters(), {...}) before "
            "DistributedModelParallel, or give the sharder fused_params={'optimizer': "
            "EmbOptimType.EXACT_SGD|EXACT_ADAGRAD|ADAM|EXACT_ROWWISE_ADAGRAD, "
            "'learning_rate': ...}")
    cls = _EMB_OPT.get(opt)
    if cls is None:
        raise ValueError(f"RobeEmbeddingBagCollection: fused optimizer {opt} is not supported "
                         "(EXACT_SGD, EXACT_ADAGRAD, ADAM, EXACT_ROWWISE_ADAGRAD)")
    kwargs: Dict[str, Any] = {"lr": float(fused_params.get("learning_rate", 0.01))}
    if "weight_decay" in fused_params:
        kwargs["weight_decay"] = float(fused_params["weight_decay"])
    if cls is not torch.optim.SGD and "eps" in fused_params:
        kwargs["eps"] = float(fused_params["eps"])
    if cls is torch.optim.Adam:
        kwargs["betas"] = (float(fused_params.get("beta1", 0.9)),
                           float(fused_params.get("beta2", 0.999)))
    resolve_optimizer(cls, kwargs)
    return cls, kwargs


def planner_sharding_types(layout: RobeLayout, row_wise: bool = False) -> List[str]:
    """The sharding types under which a module of this layout computes what it computes
    unsharded: data-parallel, and table-wise for per-table arrays (``shared=False``). With
    ``row_wise``, also ROW_WISE, a different model (each rank's rows hash into the rank's
    slice only); a shared module is then row-wise only, as all its tables must be alike.

    Example::

        >>> planner_sharding_types(ebc.layout)               # RobeConfig(shared=False)
        ['data_parallel', 'table_wise']
    """
    if layout.shared:
        return [RW] if row_wise else [DP]
    return [DP, TW, RW] if row_wise else [DP, TW]


def validate_plan(module: RobeArrayModule,
                  plan: Dict[str, ParameterSharding]) -> None:
    """Refuse, with a message naming the table, a plan this module cannot run."""
    layout = module.layout
    names = layout.table_names
    missing = [n for n in names if n not in plan]
    if missing:
        raise ValueError(f"RobeEmbeddingBagCollection: the plan has no entry for tables {missing}")
    for name in names:
        ps = plan[name]
        if ps.sharding_type not in SUPPORTED_SHARDING_TYPES:
            raise ValueError(
                f"RobeEmbeddingBagCollection: table {name!r} is planned {ps.sharding_type}, "
                f"which ROBE sharding does not support (valid: "
                f"{list(SHARED_SHARDING_TYPES if layout.shared else SUPPORTED_SHARDING_TYPES)}); plan with RobeEmbeddingBagCollectionSharder() (it offers only those) or "
                f"pass robe_sharding_constraints(model) to the planner")
        if ps.compute_kernel not in _KERNELS:
            raise ValueError(
                f"RobeEmbeddingBagCollection: table {name!r} has compute kernel "
                f"{ps.compute_kernel!r}; ROBE sharding runs its own kernel and accepts the plan "
                f"names {list(_KERNELS)}")
    for t, name in enumerate(names):
        if plan[name].sharding_type == RW:
            world = len(plan[name].ranks or []) or 1
            array_size = layout.array_sizes[layout.tables[t].array]
            if array_size // world < layout.block_size:
                raise ValueError(
                    f"RobeEmbeddingBagCollection: table {name!r} is planned row_wise over "
                    f"{world} ranks but its ROBE array ({array_size} floats) cannot "
                    f"give each rank a slice of at least block_size={layout.block_size}; plan "
                    f"it data_parallel or table_wise (the defaults of "
                    f"RobeEmbeddingBagCollectionSharder()) or over fewer ranks")
    if layout.shared:
        types = {plan[n].sharding_type for n in names}
        if len(types) != 1 or not types <= set(SHARED_SHARDING_TYPES):
            raise ValueError(
                "RobeEmbeddingBagCollection(shared=True) keeps every table in one ROBE array, "
                "which cannot be split by table: its tables must all be planned data_parallel "
                f"or all row_wise, got { {n: plan[n].sharding_type for n in names} }; plan "
                "with RobeEmbeddingBagCollectionSharder() (it offers only data_parallel for "
                "shared modules) or pass robe_sharding_constraints(model) to the planner, or "
                "use RobeConfig(shared=False) for table-wise sharding")


def robe_sharding_constraints(model: nn.Module, constraints=None):
    """``ParameterConstraints`` for every ``RobeEmbeddingBagCollection`` in ``model``: a
    shared-layout module's tables are restricted to DATA_PARALLEL (or ROW_WISE where the
    constraints given ask for it: then constrain all its tables alike); other modules keep
    the constraints given. Pass the result to ``EmbeddingShardingPlanner``; planning
    ``row_wise`` also needs ``RobeEmbeddingBagCollectionSharder(row_wise=True)``.

    Example::

        >>> constraints = robe_sharding_constraints(model)
        >>> EmbeddingShardingPlanner(topology, constraints=constraints).plan(model, sharders)
    """
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = dict(constraints or {})
    for module in model.modules():
        if isinstance(module, RobeArrayModule) and module.layout.shared:
            for table in module.layout.tables:
                c = constraints.get(table.name) or ParameterConstraints()
                allowed = [t for t in (c.sharding_types or [DP]) if t in SHARED_SHARDING_TYPES]
                c.sharding_types = allowed or [DP]
                constraints[table.name] = c
    return constraints


def validate_rowwise_state(layout: RobeLayout, plan: Dict[str, ParameterSharding],
                           optimizer_class: Type[torch.optim.Optimizer], world: int) -> None:
    """Refuse a plan under which row-wise Adagrad's state cannot be the unsharded module's.

    Row-wise Adagrad keeps one accumulator per aligned chunk of ``block_size`` floats of the
    weight it updates. A lookup's local weight is chunked as the module's flat ``weight``
    only if every array (ROW_WISE: every rank's slice) starts at a multiple of
    ``block_size`` both there and in the local weight; when every table is data-parallel
    the local weight is the flat weight and any layout works.
    """
    if resolve_optimizer(optimizer_class, {}) != Optimizer.ROWWISE_ADAGRAD:
        return
    if all(plan[n].sharding_type == DP for n in layout.table_names):
        return
    z = layout.block_size
    bad: List[str] = []
    for a, (offset, size) in enumerate(zip(layout.array_offsets, layout.array_sizes)):
        if offset % z:
            bad.append(f"array {a} starts at {offset}")
    for t, table in enumerate(layout.tables):
        if plan[table.name].sharding_type == RW:
            base = rw_slices(layout.array_sizes[table.array], world)[0][1]
            if world > 1 and base % z:
                bad.append(f"table {table.name!r}'s row_wise slices are {base} floats")
    if bad:
        raise ValueError(
            "RobeEmbeddingBagCollection: row-wise Adagrad (one accumulator per block_size="
            f"{z} floats) needs every ROBE array, and every row_wise slice of one, to start at a "
            f"multiple of block_size, else the sharded state differs from the unsharded "
            f"module's: {'; '.join(bad)}. Use RobeConfig(shared=True) or a memory_size whose "
            "per-table split (and row_wise slices) are multiples of block_size, plan every "
            "table data_parallel, or use Adagrad (EXACT_ADAGRAD / torch.optim.Adagrad)")


class _ModuleView:
    """What ``ShardedEmbeddingBagCollection.__init__`` reads from the module it shards: the
    table configs and one (meta) parameter per table, named as an EBC names them."""

    def __init__(self, module: RobeEmbeddingBagCollection) -> None:
        self._module = module
        self._params = {
            f"embedding_bags.{t.name}.weight": nn.Parameter(
                torch.empty(compressed_shape(module.layout, i), device="meta"),
                requires_grad=False)
            for i, t in enumerate(module.embedding_bag_configs())
        }
        self.device = torch.device("cpu")

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._module.embedding_bag_configs()

    def is_weighted(self) -> bool:
        return self._module.is_weighted()

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        return iter(self._params.items())

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return dict(self._params)


# ---------------------------------------------------------------------------------------
# the sharded module
# ---------------------------------------------------------------------------------------

class RobeShardedArrays:
    """What a sharded ROBE module (pooled or unpooled) adds to TorchRec's sharded module: the
    per-rank lookups over the local pieces of the flat array, their in-backward optimizer,
    and the state dict that presents the pieces as the unsharded module's ``weight``.

    Mixed in before TorchRec's ``ShardedEmbeddingBagCollection`` /
    ``ShardedEmbeddingCollection``; the subclass's ``_create_lookups`` calls
    :meth:`_robe_create_lookups` with its shardings, and its constructor :meth:`_robe_finish`.
    """

    # --- construction ----------------------------------------------------------------------

    def _robe_init(self, module: RobeArrayModule, view: Any,
                   plan: Dict[str, ParameterSharding], env: ShardingEnv,
                   optimizer: Tuple[Type[torch.optim.Optimizer], Dict[str, Any]],
                   device: Optional[torch.device], qcomm_codecs_registry,
                   module_fqn: Optional[str]) -> None:
        """Check the plan, run TorchRec's sharded constructor on ``view`` (what it reads of
        the module), then build ROBE's state from ``module``."""
        validate_plan(module, plan)
        validate_rowwise_state(module.layout, plan, optimizer[0], env.world_size)
        # read by _create_lookups, which runs inside the base constructor
        self.__dict__["_robe_src"] = (module, optimizer)
        super().__init__(  # type: ignore[call-arg]  # the TorchRec class after this mixin
            view, plan, env, fused_params=None, device=device,
            qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn)
        # torchrec 1.6's constructor puts DDP around data-parallel lookups (1.8 asks
        # init_data_parallel below, which declines); the rest of this class reads the
        # lookups themselves
        undo_data_parallel_wrapping(self._lookups)
        # then out of autograd, as the unsharded module's array once fused and FBGEMM's
        # fused tables: the fused backward updates each array (see fused_lookup); DDP, which
        # torchrec 1.6 put around some, refuses a module with nothing that requires grad
        for lookup in self._lookups:
            lookup.weight.requires_grad_(False)
        self._robe_finish(module)
        del self.__dict__["_robe_src"]

    def _robe_create_lookups(self, shardings, unpooled: bool = False) -> None:
        """One :class:`RobeShardedLookup` per sharding type, over this rank's pieces."""
        module, (opt_class, opt_kwargs) = self.__dict__["_robe_src"]
        layout: RobeLayout = module.layout
        pg = self._env.process_group
        rank, world = self._env.rank, self._env.world_size
        for sharding, sharding_type in zip(shardings, self._sharding_types):
            row_wise = sharding_type == RW
            # the features this rank looks up, in the order of the KJT the input dist hands it
            local_names = (sharding.feature_names_per_rank()[rank] if sharding_type == TW
                           else sharding.feature_names())
            local_features = [layout.feature(name) for name in local_names]
            # local arrays (ROW_WISE: this rank's slice of each) in global order: a
            # data-parallel lookup's weight is then laid out exactly as the unsharded
            # module's (its state can be viewed without copies)
            segments: List[Segment] = []
            local_piece: Dict[int, Tuple[int, int]] = {}  # array -> (local offset, size)
            local_size = 0
            for a in sorted({f.array for f in local_features}):
                off, size = (rw_slices(layout.array_sizes[a], world)[rank] if row_wise
                             else (0, layout.array_sizes[a]))
                segments.append(Segment(layout.array_offsets[a] + off, size, local_size))
                local_piece[a] = (local_size, size)
                local_size += size
            features: List[FeatureLayout] = []
            for f in local_features:
                offset, size = local_piece[f.array]
                f = dataclasses.replace(f, array_offset=offset, array_size=size)
                if row_wise:
                    # ids arrive local to this rank's row block: the hash key stays the
                    # global row; MEAN is applied by TorchRec after the reduce-scatter
                    start, num_rows = rw_rows(f.num_rows, world, rank)
                    f = dataclasses.replace(f, row_offset=f.row_offset + start,
                                            num_rows=num_rows, pooling=Pooling.SUM)
                features.append(f)
            lookup = RobeShardedLookup(
                features, segments, local_size, layout, opt_class, opt_kwargs,
                sharding_type == DP, pg, module_is_weighted(module), self._device,
                unpooled=unpooled, row_wise=row_wise)
            self._lookups.append(lookup)
        self._robe_lookups = nn.ModuleList(self._lookups)

    def init_data_parallel(self) -> None:
        # no DDP: data-parallel arrays are all-reduced and updated inside backward
        pass

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        # the state dict is ROBE's own (see _save_to_state_dict / _load_from_state_dict)
        pass

    def _robe_finish(self, module: RobeArrayModule) -> None:
        pg = self._env.process_group
        self._rank = dist.get_rank(pg) if pg is not None else 0
        self._world = dist.get_world_size(pg) if pg is not None else 1
        layout: RobeLayout = module.layout
        self._robe_layout = layout
        # who declares each array in the state dict
        plan = self.module_sharding_plan
        pieces = set()
        for table in layout.tables:
            a = table.array
            ps = plan[table.name]
            if ps.sharding_type == RW:
                for r, (off, size) in enumerate(rw_slices(layout.array_sizes[a], self._world)):
                    pieces.add((layout.array_offsets[a] + off, size, r))
            else:
                owner = 0 if ps.sharding_type == DP else int(ps.ranks[0])  # type: ignore[index]
                pieces.add((layout.array_offsets[a], layout.array_sizes[a], owner))
        self._global_segments = sorted(pieces)
        self._all_dp = all(plan[n].sharding_type == DP for n in layout.table_names)
        self._dp_lookups = [lk for lk, st in zip(self._lookups, self._sharding_types) if st == DP]

        # initial values: rank 0's module, so every rank starts from the same arrays
        if module.weight.device.type != "meta":
            self._copy_from_rank0(module.weight.detach().clone())
        else:
            self.reset_parameters()

        self._robe_opt = ShardedRobeFusedOptimizer(self)
        for lk in self._lookups:
            lk.optimizer.follow(self._robe_opt)
        self._optim = CombinedOptimizer([("", self._robe_opt)])

    # --- what ShardedRobeFusedOptimizer reads ----------------------------------------------

    @property
    def layout(self) -> RobeLayout:
        """The unsharded module's layout."""
        return self._robe_layout

    @property
    def robe_lookups(self) -> List[RobeShardedLookup]:
        """This rank's lookups, one per sharding type."""
        return list(self._lookups)

    @property
    def all_data_parallel(self) -> bool:
        """Whether every table is data-parallel (the state dict then holds plain tensors)."""
        return self._all_dp

    def broadcast_data_parallel(self, tensors_of=lambda lk: [lk.weight.data]) -> None:
        """Copy rank 0's data-parallel pieces (``tensors_of(lookup)``) to every rank."""
        pg = self._env.process_group
        if pg is None or self._world == 1:
            return
        for lk in self._dp_lookups:
            for t in tensors_of(lk):
                if t.numel():
                    dist.broadcast(t, src=dist.get_global_rank(pg, 0), group=pg)

    # --- views over the local arrays -------------------------------------------------------

    def _declared_local(self, tensor_of, unit: int = 1) -> List[Tuple[Segment, torch.Tensor]]:
        """(segment, view) of every piece this rank declares in the state dict; with
        ``unit``, of a tensor with one entry per ``unit`` floats of the weight (row-wise
        state: the segments then start at multiples of ``unit``)."""
        out = []
        for lk, st in zip(self._lookups, self._sharding_types):
            if st == DP and self._rank != 0:
                continue
            t = tensor_of(lk)
            for s in lk.segments:
                start = s.local_offset // unit
                out.append((s, t[start: start + rowwise_state_size(s.size, unit)]))
        return out

    def global_view(self, tensor_of, clone: bool = False, unit: int = 1) -> torch.Tensor:
        """The flat array (or an optimizer state of the same shape; with ``unit``, one of
        an entry per ``unit`` floats, as row-wise Adagrad's ``sum``) as the state dict shows
        it: a plain tensor when every table is data-parallel, else a ``ShardedTensor`` of the
        local tensors' dtype."""
        if self._all_dp:
            t = tensor_of(self._dp_lookups[0])
            return t.detach().clone() if clone else t
        device = self._lookups[0].weight.device
        def placement(rank: int) -> str:
            return f"rank:{rank}/{device.type}" if device.type == "cpu" else f"rank:{rank}/{device}"
        shards_md = [ShardMetadata(shard_offsets=[off // unit],
                                   shard_sizes=[rowwise_state_size(size, unit)],
                                   placement=placement(r))
                     for off, size, r in self._global_segments]
        by_offset = {md.shard_offsets[0]: md for md in shards_md}
        local = []
        for s, view in self._declared_local(tensor_of, unit):
            view = view.detach().clone() if clone else view.detach()
            local.append(Shard(tensor=view, metadata=by_offset[s.global_offset // unit]))
        size = rowwise_state_size(self._robe_layout.memory_size, unit)
        meta = ShardedTensorMetadata(
            shards_metadata=shards_md, size=torch.Size([size]),
            tensor_properties=TensorProperties(dtype=tensor_of(self._lookups[0]).dtype))
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, meta, process_group=self._env.process_group)

    # --- state dict ------------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.global_view(lambda lk: lk.weight, clone=True)
        destination[prefix + "robe_layout"] = self._robe_layout.to_tensor()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        wkey, lkey = prefix + "weight", prefix + "robe_layout"
        if lkey in state_dict:
            self._robe_layout.check_saved(state_dict[lkey])
        elif strict:
            missing_keys.append(lkey)
        if wkey in state_dict:
            self._load_flat(state_dict[wkey], lambda lk: lk.weight.data, "weight")
        elif strict:
            missing_keys.append(wkey)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        for key in (wkey, lkey):
            while key in unexpected_keys:
                unexpected_keys.remove(key)

    def _load_flat(self, src, tensor_of, what: str) -> None:
        """Copy a flat array (plain or ShardedTensor) into the local pieces of ``tensor_of``."""
        with torch.no_grad():
            total = self._robe_layout.memory_size
            if isinstance(src, ShardedTensor):
                if tuple(src.size()) != (total,):
                    raise ValueError(f"RobeEmbeddingBagCollection: {what} has size "
                                     f"{tuple(src.size())}, expected ({total},)")
                theirs = {(sh.metadata.shard_offsets[0], sh.metadata.shard_sizes[0]): sh.tensor
                          for sh in src.local_shards()}
                for s, view in self._declared_local(tensor_of):
                    found = theirs.get((s.global_offset, s.size))
                    if found is None:
                        raise ValueError(
                            f"RobeEmbeddingBagCollection: the {what} ShardedTensor given has no "
                            f"local shard at offset {s.global_offset} (size {s.size}); load "
                            "checkpoints of another sharding through "
                            "torch.distributed.checkpoint into this module's own state_dict()")
                    if found.data_ptr() != view.data_ptr():
                        view.copy_(found)
                if not self._all_dp:
                    self.broadcast_data_parallel(lambda lk: [tensor_of(lk)])
            else:
                if hasattr(src, "full_tensor"):  # DTensor
                    src = src.full_tensor()
                if src.numel() != total:
                    raise ValueError(f"RobeEmbeddingBagCollection: {what} has {src.numel()} "
                                     f"elements, expected {total}")
                src = src.reshape(-1)
                for lk in self._lookups:
                    t = tensor_of(lk)
                    for s in lk.segments:
                        view = t[s.local_offset: s.local_offset + s.size]
                        if view.data_ptr() != src[s.global_offset:].data_ptr():
                            view.copy_(src[s.global_offset: s.global_offset + s.size])

    # --- misc ------------------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """Draw the arrays exactly as the unsharded module's ``reset_parameters`` does (the
        whole flat array, by ``RobeLayout.draw``, from rank 0's generator), and keep this
        rank's pieces: a model built on the meta device and sharded starts where the same
        model built on CPU with the same seed starts. The flat array is the compressed size,
        so drawing all of it on every rank is cheap."""
        layout = self._robe_layout
        full = torch.empty(layout.memory_size, dtype=layout.weight_dtype)
        layout.draw(full)
        self._copy_from_rank0(full)

    def _copy_from_rank0(self, flat: torch.Tensor) -> None:
        """Fill every lookup's local weight from rank 0's copy of the flat array."""
        pg = self._env.process_group
        with torch.no_grad():
            src = flat.to(self._lookups[0].weight.device)
            if pg is not None and self._world > 1:
                dist.broadcast(src, src=dist.get_global_rank(pg, 0), group=pg)
            for lk in self._lookups:
                for s in lk.segments:
                    lk.weight[s.local_offset: s.local_offset + s.size].copy_(
                        src[s.global_offset: s.global_offset + s.size])

    def extra_repr(self) -> str:
        names = self._robe_layout.table_names
        return (f"tables={names}, plan="
                f"{ {n: self.module_sharding_plan[n].sharding_type for n in names} }")


class ShardedRobeEmbeddingBagCollection(RobeShardedArrays, ShardedEmbeddingBagCollection):
    """``RobeEmbeddingBagCollection`` sharded by TorchRec (built by the sharder).

    State dict: ``weight`` (the unsharded module's flat array: a plain tensor when every table
    is data-parallel, otherwise a ``ShardedTensor`` whose shards are the arrays each rank
    owns, data-parallel ones declared by rank 0) and ``robe_layout``; the same keys as the
    unsharded module, so checkpoints move between the two, between world sizes and between
    sharding types (``torch.distributed.checkpoint``).
    """

    def __init__(
        self,
        module: RobeEmbeddingBagCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        optimizer: Tuple[Type[torch.optim.Optimizer], Dict[str, Any]],
        device: Optional[torch.device] = None,
        qcomm_codecs_registry=None,
        module_fqn: Optional[str] = None,
    ) -> None:
        self._robe_init(module, _ModuleView(module), table_name_to_parameter_sharding, env,
                        optimizer, device, qcomm_codecs_registry, module_fqn)

    def _create_lookups(self) -> None:
        self._robe_create_lookups(self._embedding_shardings)

    def input_dist(self, ctx, features):  # type: ignore[override]
        """TorchRec's input dist, given a VBE KJT's inverse indices in the order of the
        features it sends (:func:`~robe_torchrec.variable_batch.order_inverse_indices`:
        the row-wise MEAN divisor reads them in that order)."""
        order = [f for sharding in self._embedding_shardings for f in sharding.feature_names()]
        return super().input_dist(ctx, order_inverse_indices(features, order))

    @property
    def unsharded_module_type(self) -> Type[RobeEmbeddingBagCollection]:  # type: ignore[override]
        return RobeEmbeddingBagCollection


class ShardedRobeFusedOptimizer(FusedOptimizer):
    """The sharded module's in-backward optimizer, keyed ``weight`` as the unsharded module's
    (DMP prefixes the module path). State tensors are viewed as the array is: plain when all
    tables are data-parallel, else ``ShardedTensor``; ``step`` is a scalar tensor."""

    def __init__(self, owner: RobeShardedArrays) -> None:
        self._owner = owner
        first = owner.robe_lookups[0].optimizer
        group = RateGroup({k: v for k, v in first.param_groups[0].items() if k != "params"},
                          first.param.device)
        weight = owner.global_view(lambda lk: lk.weight)
        names = list(first.param_state.keys())
        # row-wise Adagrad's sum: one entry per block_size floats (validate_rowwise_state
        # made the local chunks the global ones)
        unit = owner.layout.block_size if first.kind == Optimizer.ROWWISE_ADAGRAD else 1
        state: Dict[str, torch.Tensor] = {}
        for name in names:
            if name == "step":
                continue
            state[name] = owner.global_view(lambda lk, n=name: lk.optimizer.param_state[n],
                                            unit=unit)
        if "step" in names:
            # the step counter of this rank's first lookup (they all count the same steps)
            state["step"] = first.param_state["step"]
        group["params"] = [weight]
        super().__init__({"weight": weight}, {weight: state}, [group])
        self._weight = weight
        self.kind = first.kind

    def step(self, closure: Any = None) -> None:
        # as RobeFusedOptimizer.step: the finished input checks, no wait
        raise_ready(send_idle=True)

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    def post_load_state_dict(self) -> None:
        """After ``load_state_dict`` (TorchRec copies into the state tensors in place):
        data-parallel pieces declared by rank 0 only reach the other ranks, and every
        lookup gets the loaded step count."""
        st = self.state[self._weight]
        owner = self._owner
        if not owner.all_data_parallel:
            owner.broadcast_data_parallel(
                lambda lk: [v for k, v in lk.optimizer.param_state.items() if k != "step"])
        if "step" in st:
            for lk in owner.robe_lookups:
                step = lk.optimizer.param_state["step"]
                if step is not st["step"]:
                    step.fill_(float(st["step"]))


# ---------------------------------------------------------------------------------------
# the sharder
# ---------------------------------------------------------------------------------------

class RobeEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards :class:`RobeEmbeddingBagCollection` for ``DistributedModelParallel`` and
    ``EmbeddingShardingPlanner``.

    Which sharding types the planner may pick, per module (:func:`planner_sharding_types`):
    ``data_parallel``, and ``table_wise`` for per-table arrays (``RobeConfig(shared=False)``),
    so that every plan it makes computes what the unsharded module computes. ``row_wise`` is
    a different model (each rank hashes its rows into its own slice of the array): it is
    offered only with ``row_wise=True``. A hand-made plan (``construct_module_sharding_plan``)
    may use any of the three.

    Args:
        fused_params: the in-backward optimizer when ``apply_optimizer_in_backward`` was not
            called on the module's weight: ``{"optimizer": EmbOptimType.EXACT_SGD |
            EXACT_ADAGRAD | ADAM | EXACT_ROWWISE_ADAGRAD, "learning_rate": ..., "eps": ...,
            "beta1": ..., "beta2": ..., "weight_decay": ...}``.
        row_wise: offer ``row_wise`` to the planner too (a shared module is then planned
            row-wise only); narrow it further with ``robe_sharding_constraints``.

    Example::

        >>> planner.plan(model, [RobeEmbeddingBagCollectionSharder()])   # DP / TW only
        >>> constraints = robe_sharding_constraints(
        ...     model, {"t0": ParameterConstraints(sharding_types=["row_wise"])})
        >>> EmbeddingShardingPlanner(topology, constraints=constraints).plan(
        ...     model, [RobeEmbeddingBagCollectionSharder(row_wise=True)])
    """

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
                 row_wise: bool = False) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self.row_wise = row_wise
        self._types_of_last_module: Optional[List[str]] = None

    def shard(self, module: RobeEmbeddingBagCollection, params: Dict[str, ParameterSharding],
              env: ShardingEnv, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedRobeEmbeddingBagCollection:
        return ShardedRobeEmbeddingBagCollection(
            module, params, env, resolve_fused_optimizer(module, self.fused_params), device,
            qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn)

    def shardable_parameters(self, module: RobeEmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        """One meta tensor per table, shaped as the ROBE floats it costs (``[rows, dim]`` with
        ``rows * dim`` about its array or its share of the shared array): the planner sizes
        the module by its compressed memory. Carries the fused optimizer class so the planner
        counts optimizer state."""
        try:
            opt_class = [resolve_fused_optimizer(module, self.fused_params)[0]]
        except ValueError:
            opt_class = None
        # TorchRec's enumerator asks sharding_types() (which takes no module) for each
        # parameter right after this call: answer it for this module
        self._types_of_last_module = self.sharding_types_for(module)
        out = {}
        for i, name in enumerate(module.layout.table_names):
            p = nn.Parameter(torch.empty(compressed_shape(module.layout, i), device="meta"),
                             requires_grad=False)
            if opt_class:
                p._optimizer_classes = opt_class  # type: ignore[attr-defined]
            out[name] = p
        return out

    def sharding_types_for(self, module: RobeEmbeddingBagCollection) -> List[str]:
        """The sharding types the planner may pick for ``module``'s tables (see the class
        docstring)."""
        return planner_sharding_types(module.layout, self.row_wise)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        """The types of the module last passed to :meth:`shardable_parameters` (the planner
        enumerates one module at a time), else all this sharder offers."""
        if self._types_of_last_module is not None:
            return list(self._types_of_last_module)
        return [DP, TW, RW] if self.row_wise else [DP, TW]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    @property
    def module_type(self) -> Type[RobeEmbeddingBagCollection]:  # type: ignore[override]
        return RobeEmbeddingBagCollection

    @property
    def sharded_module_type(self) -> Type[ShardedRobeEmbeddingBagCollection]:  # type: ignore[override]
        return ShardedRobeEmbeddingBagCollection
