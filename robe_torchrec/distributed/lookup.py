"""The lookup kernel of a sharded ``RobeEmbeddingBagCollection``: one per sharding type.

A lookup holds, on this rank, the ROBE arrays of the tables of its sharding type that this
rank serves (``local weight``: those arrays concatenated), looks up the features TorchRec's
input dist hands it, and applies the fused optimizer inside backward:

* ``TABLE_WISE`` / ``ROW_WISE``: the gradient that TorchRec's output dist brings back covers
  the whole global batch; ``robe::backward_fused_`` scatters it and updates in one go.
* ``DATA_PARALLEL``: every rank holds the arrays and sees only its local batch. Backward
  computes the dense array gradient (``robe::backward_dense``), all-reduces it (sum divided
  by the world size, DDP's averaging) and applies the optimizer with
  :func:`robe_torchrec.ops.dense_update.apply_dense_update_` (:mod:`robe_torchrec.fused_lookup`,
  shared with the unsharded module), all inside autograd: there is no
  DDP wrapper and no gradient left for a dense optimizer, so pipelines that need every
  embedding optimizer fused into backward (FusedSparseDist, SemiSync) see what they expect.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Type

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.fused import FusedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec.fused_lookup import autograd_anchor, fused_lookup
from robe_torchrec.layout import FeatureLayout, RobeLayout
from robe_torchrec.ops.args import LookupArgs
from robe_torchrec.ops.deferred_checks import DeferredCheckError
from robe_torchrec.ops.feature_names import name_features
from robe_torchrec.ops.unpooled import gather_unpooled, keys_table_meta, unpooled_args
from robe_torchrec.optim import RobeFusedOptimizer
from robe_torchrec.rate_group import RateGroup
from robe_torchrec.rowwise_install import ArrayOwner
from robe_torchrec.variable_batch import flatten_variable_strides, pad_variable_strides


@dataclasses.dataclass(frozen=True)
class Segment:
    """A contiguous piece of the module's flat ``weight`` held by a lookup on this rank."""

    global_offset: int  # first element inside the unsharded module's flat ``weight``
    size: int
    local_offset: int  # first element inside the lookup's local weight


class _LocalRobeOptimizer(RobeFusedOptimizer):
    """Per-lookup optimizer state; hyper-parameters are read from the module-level group, so
    that a change of ``dmp.fused_optimizer.param_groups[..]["lr"]`` reaches every lookup."""

    def __init__(self, param, optimizer_class, kwargs, block_size: int) -> None:
        super().__init__("local", param, optimizer_class, kwargs, block_size=block_size)
        self._owner_group: Optional[RateGroup] = None

    def follow(self, owner: FusedOptimizer) -> None:
        """Read hyper-parameters from ``owner``'s first param group from now on."""
        self._owner_group = next(iter(owner.param_groups))

    def _group(self) -> RateGroup:
        if self._owner_group is not None:
            return self._owner_group
        return super()._group()


class RobeShardedLookup(ArrayOwner):
    """Looks up the features of one sharding type on this rank (see module docstring).

    Args:
        features: the features TorchRec's input dist hands this lookup, in its KJT's order,
            placed in the local weight (see :class:`~robe_torchrec.layout.FeatureLayout`).
        segments: the pieces of the module's flat ``weight`` the local weight holds.
        local_size: floats of the local weight.
        layout: the module's layout (hash, block size, bounds check).
        unpooled: one embedding per id, ``[ids, dim]`` (a sharded ``RobeEmbeddingCollection``:
            :func:`robe_torchrec.ops.unpooled.unpooled_args`), instead of ``[batch, dims]``.
        row_wise: the lookup of ROW_WISE tables (its output is reduce-scattered).
    """

    def __init__(
        self,
        features: List[FeatureLayout],
        segments: List[Segment],
        local_size: int,
        layout: RobeLayout,
        optimizer_class: Type[torch.optim.Optimizer],
        optimizer_kwargs: Dict[str, Any],
        data_parallel: bool,
        process_group: Optional[dist.ProcessGroup],
        is_weighted: bool,
        device: Optional[torch.device] = None,
        unpooled: bool = False,
        row_wise: bool = False,
    ) -> None:
        super().__init__()
        self._unpooled = unpooled
        self._row_wise = row_wise
        self.features = features
        self.segments = segments
        self._layout = layout
        self._data_parallel = data_parallel
        self._pg = process_group
        self._is_weighted = is_weighted
        self._output_dim = sum(f.dim for f in features)
        # an unpooled lookup's features as one feature of keys, for the graphs
        # torch.compile traces (see unpooled_args); None where the keys cannot serve them
        keys_meta = None
        if unpooled and features:
            keys_meta = keys_table_meta(layout.table_meta(features).tolist(),
                                        self._output_dim, device)
        # requires grad only until the sharded module has built its lookups (see there)
        self.weight = nn.Parameter(torch.zeros(local_size, device=device,
                                                dtype=layout.weight_dtype))
        self.register_buffer("table_meta", layout.table_meta(features, device), persistent=False)
        self.register_buffer("keys_table_meta", keys_meta, persistent=False)
        name_features(self.table_meta, [f.name for f in features])
        self.optimizer = _LocalRobeOptimizer(self.weight, optimizer_class, optimizer_kwargs,
                                             layout.block_size)
        # keeps the array out of ``in_backward_optimizer_filter`` (dense optimizers)
        self.weight._in_backward_optimizers = [self.optimizer]  # type: ignore[attr-defined]
        self._anchor = autograd_anchor(self.weight.device)
        self.register_array()  # torchrec.optim.RowWiseAdagrad leaves it to the lookup

    def _apply(self, fn: Any, recurse: bool = True) -> "RobeShardedLookup":
        module = super()._apply(fn, recurse)
        if self._anchor.device != self.weight.device:  # the anchor follows the array
            self._anchor = autograd_anchor(self.weight.device)
        name_features(self.table_meta, [f.name for f in self.features])  # a new tensor, perhaps
        return module

    # no state of its own in state_dict: the sharded module presents the arrays as ``weight``
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        pass

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:  # called by TorchRec before state_dict
        pass

    def purge(self) -> None:
        pass

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        # a pooled VBE input: padded to one stride here, flattened as TorchRec's VBE
        # output dist takes it below (the unpooled output does not depend on strides)
        vbe_strides = (features.stride_per_key_per_rank()
                       if not self._unpooled and features.variable_stride_per_key() else None)
        if not self.features:
            # an empty rank still joins the output dist's collectives in backward
            flat = vbe_strides is not None
            return _EmptyLookup.apply(self._anchor, 0 if flat else features.stride(), self, flat)
        if vbe_strides is not None:
            if self._row_wise:
                self._check_row_wise_vbe(vbe_strides)
            features = pad_variable_strides(features)
        values = features.values()
        offsets = features.offsets()
        if offsets.dtype != values.dtype:
            offsets = offsets.to(values.dtype)
        psw = features.weights_or_none() if self._is_weighted else None
        layout_args = self._layout.op_args(self.table_meta, self._output_dim)
        index = None
        try:
            if self._unpooled:  # (ids may be checked here: see unpooled_args)
                args, index = unpooled_args(values, features.length_per_key(), layout_args,
                                            self.keys_table_meta)
            else:
                args = LookupArgs(values, offsets, psw, layout_args)
            out = fused_lookup(self.weight, self.optimizer, args, self._anchor,
                               self._pg if self._data_parallel else None)
        except (ValueError, RuntimeError) as err:
            if isinstance(err, DeferredCheckError):
                raise  # another call's input, perhaps another lookup's: named by that call
            message = row_wise_id_error(str(err), self.features, self._layout)
            raise type(err)(name_feature(message, [f.name for f in self.features])) from None
        if self._unpooled:
            return gather_unpooled(out, index, self.features[0].dim)
        if vbe_strides is not None:
            return flatten_variable_strides(out, vbe_strides, [f.dim for f in self.features])
        return out

    def _check_row_wise_vbe(self, strides: List[List[int]]) -> None:
        """Refuse, before a backward that would fail, row-wise VBE output that gloo cannot
        carry back: TorchRec's row-wise output dist reduce-scatters this lookup's output in
        one piece per rank, and its backward all-gathers those pieces, which gloo supports
        only when all are the same size (stock ``EmbeddingBagCollection`` fails the same
        way, tests/distributed/test_sequence.py shows it). Every rank sees the same
        strides, so every rank raises."""
        if not torch.is_grad_enabled() or self._pg is None:
            return
        if dist.get_backend(self._pg) != "gloo":
            return
        sizes = [sum(strides[f][r] * feature.dim for f, feature in enumerate(self.features))
                 for r in range(len(strides[0]))]
        if len(set(sizes)) > 1:
            raise ValueError(
                "RobeEmbeddingBagCollection: the row_wise features "
                f"{sorted({f.name for f in self.features})} got a variable batch size per "
                f"feature whose pooled output differs in size between ranks ({sizes} floats "
                "per rank: the sum over features of batch size x dim); TorchRec's row-wise "
                "output dist then all-gathers uneven pieces in backward, which the gloo "
                "backend cannot do. Train on NCCL, plan these tables table_wise or "
                "data_parallel, or run this batch without gradients (torch.no_grad())")


#: how to look up raw ids, as the unsharded message says it (validation.RAW_IDS_HINT)
ROW_WISE_RAW_IDS_HINT = ("; to look up raw ids (any 64-bit value), hash them with "
                         "RobeConfig(bounds_check=\"unbounded\", hash=\"mix\")")


def row_wise_id_error(message: str, features: List[FeatureLayout], layout: RobeLayout) -> str:
    """An out-of-range id seen by a row-wise lookup is the rank-local id TorchRec's bucketing
    made of it, checked against the rank's rows: say so, with the table's full range (the
    user's id cannot be recovered here). Other messages are returned unchanged.

    Example::

        >>> row_wise_id_error("robe: id 500000 at position 0 of feature 0 is out of range "
        ...                   "[0, 150)", [f3_on_rank_1], layout)
        'robe: an id of feature 0 is out of range [0, 300) (ids must lie in [0, num_embeddings)):
        this rank, which holds rows [150, 300) of it under row-wise sharding, got it as local
        id 500000 at position 0 of its input; to look up raw ids ...'
    """
    found = re.match(r"robe: id (-?\d+) at position (\d+) of feature (\d+)(?: \('[^']*'\))? "
                     r"is out of range", message)
    if not found or int(found.group(3)) >= len(features):
        return message
    local = features[int(found.group(3))]
    table = layout.feature(local.name)
    if (local.num_rows, local.row_offset) == (table.num_rows, table.row_offset):
        return message  # the whole table on this rank: the id is the user's
    start = local.row_offset - table.row_offset
    return (f"robe: an id of feature {found.group(3)} is out of range [0, {table.num_rows}) "
            f"(ids must lie in [0, num_embeddings)): this rank, which holds rows [{start}, "
            f"{start + local.num_rows}) of it under row-wise sharding, got it as local id "
            f"{found.group(1)} at position {found.group(2)} of its input{ROW_WISE_RAW_IDS_HINT}")


def name_feature(message: str, names: List[str]) -> str:
    """An op error names a feature by its index in the lookup's KJT, which under sharding is
    not the user's order: name it instead (keeping the index, which positions refer to).

    Example::

        >>> name_feature("robe: id 9 at position 3 of feature 1 is out of range", ["f0", "f3"])
        "robe: id 9 at position 3 of feature 'f3' (lookup feature 1) is out of range"
    """
    found = re.search(r"of feature (\d+)(?: \('[^']*'\))?", message)  # the op may name it
    if not found or int(found.group(1)) >= len(names):
        return message
    index = found.group(1)
    return message.replace(found.group(0),
                           f"of feature '{names[int(index)]}' (lookup feature {index})", 1)


class _EmptyLookup(torch.autograd.Function):
    """Output of a rank without tables of this sharding type: ``[batch, 0]`` (``[0]`` for
    VBE input, flat as TorchRec's VBE output dist takes it), requiring grad so the output
    dist's backward collective runs; counts the step like the others."""

    @staticmethod
    def forward(ctx, anchor, batch, lookup, flat):  # type: ignore[override]
        ctx.lookup = lookup
        return anchor.new_empty(0) if flat else anchor.new_empty(batch, 0)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        ctx.lookup.optimizer.advance_step()
        return None, None, None, None

