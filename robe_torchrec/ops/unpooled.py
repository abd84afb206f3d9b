"""The unpooled lookup (one embedding per id) as the pooled op with one id per bag.

A bag holding one id pooled with SUM (no per-sample weight) is that id's embedding, so the
unpooled lookup runs ``robe::forward`` itself: the C++, Triton and reference kernels, the fake
kernels, autograd and the fused optimizers in backward serve it unchanged, and a ROBE bag of
one id gives exactly the vector the unpooled module gives (by construction, tested).

The op takes ``T * B`` bags, one ``B`` for all features, but features hold different numbers
of ids. :func:`unpooled_args` lays them out in one of two ways:

* **One feature of keys** (the features share one array, as ``RobeConfig(shared=True)``, the
  default, lays them out): feature ``t`` hashes id ``i`` as the key ``i + row_offset[t]``, so
  the lookup of every id is that of its key in a single feature whose row offset is 0. The op
  gets the ``N`` keys as ``N`` bags and writes ``[N, dim]``, the rows asked for: no padding and
  no gather. An id outside its feature's rows may still be a key inside a later table's, so
  the ids are checked against their own features, as the op would check them: at the call
  when the op reads its checks there (then a problem raises the op's message), else (the
  op's deferred checks, a GPU's default) on the device, where an id that fails becomes the
  key -1, which the op's own check refuses. A deferred problem then writes nothing in
  backward, as any other, and :func:`~robe_torchrec.ops.deferred_checks.name_problems_with`
  names it from the ids, not the keys.
* **Padded**, otherwise (features on arrays of their own, of other dims or pooled by their
  mean): feature ``f`` (``n_f`` ids) gets the bags ``f * B .. f * B + n_f - 1``
  with ``B = max n_f``, the rest empty; the op writes ``[B, T * dim]`` and
  :func:`gather_unpooled` picks each id's row and feature's columns into ``[N, dim]`` (one
  gather). The padding costs ``T * max n_f - N`` zero rows: nothing when the features hold as
  many ids each (see ``benchmarks/results/unpooled_ops.md``).

A graph ``torch.compile`` traces cannot derive the keys layout from ``table_meta``: given
it (:func:`keys_table_meta`, a module's buffer), it makes the ids keys in
``robe::unpooled_keys``, an op whose kernel checks them as an eager call does; without it
it takes the padded layout, which reads nothing on the host.

Example::

    >>> args, index = unpooled_args(values, counts=[3, 1], layout=layout_args)
    >>> rows = gather_unpooled(args.forward(weights), index, dim=8)    # [4, 8]
    >>> rows = robe_unpooled_lookup(weights, values, [3, 1], layout_args)   # the same
"""

from __future__ import annotations

import itertools
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from robe_torchrec.ops import meta as m
from robe_torchrec.ops.args import LayoutArgs, LookupArgs
from robe_torchrec.ops.backends import checks_deferred
from robe_torchrec.ops.deferred_checks import name_problems_with
from robe_torchrec.ops.feature_names import name_in_error, names_of
from robe_torchrec.ops.long_lived import long_lived
from robe_torchrec.ops.small_copies import ints_on_device
from robe_torchrec.ops.validation import (IdCheck, check_ids, check_shapes_only, id_check_of,
                                          meta_facts)
from robe_torchrec.ops.weak_ids import WeakIdDict


def unpooled_args(values: Tensor, counts: List[int], layout: LayoutArgs,
                  keys_meta: Optional[Tensor] = None) -> Tuple[LookupArgs, Optional[Tensor]]:
    """``(LookupArgs, index)`` of the unpooled lookup of ``values`` (feature-major, ``counts[f]``
    ids of feature ``f``): one id per bag, as one feature of keys or padded (see the module
    docstring). ``index`` is ``None`` when the op's output already is ``[N, dim]``.

    ``layout`` must be that of features of one dim with SUM pooling (the unpooled module's);
    its ``output_dim`` is replaced by ``T * dim``. Ids that fail their check raise here when
    the keys layout is taken and the op reads its checks at the call (the op's message),
    else in the op or, deferred, at a later call.

    ``keys_meta``: the layout's features as one feature of keys (:func:`keys_table_meta`,
    a module's buffer), read only in a graph ``torch.compile`` traces, which cannot derive
    it from ``table_meta``: with it the graph takes the keys layout too, without it the
    padded one.
    """
    num_features = len(counts)
    if torch.compiler.is_compiling():  # a trace may hold a KJT's counts as unknowns
        # (no message: strict torch.export fails on a _check given one)
        torch._check(values.numel() == sum(counts))
    if values.dim() != 1 or values.numel() != sum(counts):
        raise ValueError(f"robe_unpooled_lookup: values must be 1-D with sum(counts) = "
                         f"{sum(counts)} ids, got shape {tuple(values.shape)}")
    if layout.table_meta.shape[1] != num_features:
        raise ValueError(f"robe_unpooled_lookup: {num_features} counts for a table_meta of "
                         f"{layout.table_meta.shape[1]} features")
    if torch.compiler.is_compiling():
        return _traced_args(values, counts, layout, keys_meta)
    keys = _keys_layout(layout)
    if keys is not None:
        return _keys_args(values, counts, keys, layout.table_meta), None
    return _padded_args(values, counts, layout)


def _traced_args(values: Tensor, counts: List[int], layout: LayoutArgs,
                 keys_meta: Optional[Tensor]) -> Tuple[LookupArgs, Optional[Tensor]]:
    """The layouts a traced graph takes: the keys when ``keys_meta`` is given, the ids made
    keys by ``robe::unpooled_keys`` (an op, so that it checks the ids on the host or defers
    the checks as an eager call does); else padded. ``keys_meta`` is the same tensor every
    call (a buffer), so that what the ops derive from it once is not derived again."""
    if keys_meta is None:
        return _padded_args(values, counts, layout)
    keys = torch.ops.robe.unpooled_keys(values, counts, *layout)
    offsets = torch.arange(values.numel() + 1, dtype=torch.int64, device=values.device)
    one_feature = layout._replace(table_meta=keys_meta,
                                  output_dim=layout.output_dim // len(counts))
    return LookupArgs(keys, offsets, None, one_feature), None


class KeysLayout(NamedTuple):
    """A layout's features as one feature of keys (see the module docstring)."""
    #: the op's layout: one feature on the shared array, row offset 0, keys below
    #: ``num_rows``
    layout: LayoutArgs
    #: each feature's row offset on the device; ``None`` when all are 0
    row_offsets: Optional[Tensor]
    #: what each id is checked against in its own feature (``None``: nothing to check)
    id_check: Optional[IdCheck]
    #: what that check comes to: feature ``t``'s ids lie in ``[0, id_ends[t])``
    id_ends: List[int]
    #: ``[T, 2]`` int64 on the device: each feature's ``id_ends`` and row offset (the
    #: check on the device); ``None`` when nothing is checked
    id_table: Optional[Tensor]
    #: the original table_meta on the CPU (the checks' messages read it)
    meta_cpu: Tensor


#: table_meta -> (its version, the layout's other arguments, its KeysLayout or None)
_KEYS_LAYOUTS: WeakIdDict = WeakIdDict()


@torch.compiler.disable  # reads table_meta on the host, once per tensor version
def _keys_layout(layout: LayoutArgs) -> Optional[KeysLayout]:
    table_meta = layout.table_meta
    try:
        version: Optional[int] = table_meta._version
    except RuntimeError:  # an inference tensor: no version to key on
        version = None
    arguments = (layout.output_dim, layout.block_size, layout.hash_mode,
                 tuple(layout.hash_params), layout.bounds_check)
    hit = _KEYS_LAYOUTS.get(table_meta) if version is not None else None
    if hit is not None and hit[0] == version and hit[1] == arguments:
        return hit[2]
    if version is None:  # not kept: made for this call
        return _derive_keys_layout(layout)
    # kept for later calls (training ones save its table_meta for backward): normal
    # tensors outside any CUDA graph pool, even when first asked for under inference_mode
    found = long_lived(lambda: _derive_keys_layout(layout), layout.table_meta.device)
    _KEYS_LAYOUTS[table_meta] = (version, arguments, found)
    return found


class KeySpace(NamedTuple):
    """Where a layout's features, as one feature of keys, look their keys up."""
    dim: int
    weight_offset: int
    weight_size: int
    #: keys of ids inside their features' rows lie in ``[0, key_end)``
    key_end: int


def key_space(meta_rows: Sequence[Sequence[int]], output_dim: int) -> Optional[KeySpace]:
    """The key space of features given as ``table_meta``'s rows (Python ints, feature by
    feature in each row), or ``None`` when the keys cannot serve them: features on several
    arrays, of several dims, or not pooled by their sum."""
    num_features = len(meta_rows[m.DIM])
    if num_features == 0 or output_dim % num_features:
        return None
    dim = output_dim // num_features
    row_offsets, num_rows = meta_rows[m.ROW_OFFSET], meta_rows[m.NUM_ROWS]
    # the op's own bounds check then holds for every id that passed its feature's
    key_end = max(r + n for r, n in zip(row_offsets, num_rows))
    if (any(len(set(meta_rows[f])) != 1 for f in (m.W_OFFSET, m.W_SIZE))
            or list(meta_rows[m.DIM]) != [dim] * num_features
            or any(p != m.Pooling.SUM for p in meta_rows[m.POOLING])
            or min(row_offsets) < 0 or min(num_rows) < 0 or key_end >= 2**63):
        return None
    return KeySpace(dim, meta_rows[m.W_OFFSET][0], meta_rows[m.W_SIZE][0], key_end)


def keys_table_meta(meta_rows: Sequence[Sequence[int]], output_dim: int,
                    device: torch.device | str | None = None) -> Optional[Tensor]:
    """The ``table_meta`` (one column) of features given as ``table_meta``'s rows (Python
    ints) looked up as one feature of keys, or ``None`` where the keys cannot serve them or
    there is one feature (its own keys already). A module keeps it as a buffer for the
    graphs ``torch.compile`` traces (see :func:`unpooled_args`).

    Example::

        >>> keys_table_meta(ec.layout.table_meta().tolist(), ec.layout.output_dim).shape
        torch.Size([7, 1])
    """
    space = key_space(meta_rows, output_dim) if len(meta_rows[m.DIM]) > 1 else None
    return None if space is None else _space_meta(space, device)


def _space_meta(space: KeySpace, device: torch.device | str | None) -> Tensor:
    return m.build_table_meta(dims=[space.dim], weight_offsets=[space.weight_offset],
                              weight_sizes=[space.weight_size], row_offsets=[0],
                              num_rows=[space.key_end], poolings=[m.Pooling.SUM],
                              device=device)


def _derive_keys_layout(layout: LayoutArgs) -> Optional[KeysLayout]:
    meta_cpu = layout.table_meta.cpu().clone()
    num_features = meta_cpu.shape[1]
    if num_features == 0 or layout.output_dim % num_features:
        return None
    dim = layout.output_dim // num_features
    if num_features == 1:  # already one feature: the op checks its ids as they are
        return KeysLayout(layout._replace(output_dim=dim), None, None, [], None, meta_cpu)
    space = key_space(meta_cpu.tolist(), layout.output_dim)
    if space is None:
        return None
    row_offsets, num_rows = meta_cpu[m.ROW_OFFSET].tolist(), meta_cpu[m.NUM_ROWS].tolist()
    device = layout.table_meta.device
    table_meta = _space_meta(space, device)
    shifts = None
    if any(row_offsets):
        shifts = torch.tensor(row_offsets, dtype=torch.int64, device=device)
    id_check = id_check_of(meta_facts(meta_cpu, layout.block_size, layout.output_dim),
                           layout.hash_mode, layout.hash_params, layout.bounds_check)
    if id_check.in_bounds:
        id_ends = num_rows
    elif id_check.key_limit is not None:
        id_ends = [id_check.key_limit - r for r in row_offsets]
    else:
        id_ends = []
    id_table = None
    if id_ends:
        id_table = torch.tensor([id_ends, row_offsets], dtype=torch.int64, device=device).T
    return KeysLayout(layout._replace(table_meta=table_meta, output_dim=dim), shifts,
                      id_check if id_ends else None, id_ends, id_table, meta_cpu)


def _keys_args(values: Tensor, counts: List[int], keys: KeysLayout,
               table_meta: Tensor) -> LookupArgs:
    """The op's arguments of ``keys``' lookup of ``values``; ``table_meta``, the layout's
    own, names the features of a problem found later."""
    num_ids, device = values.numel(), values.device
    if keys.id_check is not None:
        if checks_deferred(device):
            return _checked_on_device(values, counts, keys, names_of(table_meta))
        _check_ids_now(values, counts, keys)
    if keys.row_offsets is not None:
        # output_size given: the op need not read the counts' sum back from the device
        shifts = torch.repeat_interleave(keys.row_offsets,
                                         ints_on_device(counts, torch.int64, device),
                                         output_size=num_ids)
        # the op's key, formed here: int64 wraps as the kernels' key does
        values = values.to(torch.int64) + shifts
    offsets = torch.arange(num_ids + 1, dtype=values.dtype, device=device)
    return LookupArgs(values, offsets, None, keys.layout)


def _checked_on_device(values: Tensor, counts: List[int], keys: KeysLayout,
                       names: Optional[Tuple[str, ...]]) -> LookupArgs:
    # each id's range end and row offset, placed on the device without a wait
    per_id = torch.repeat_interleave(keys.id_table,
                                     ints_on_device(counts, torch.int64, values.device),
                                     dim=0, output_size=values.numel())
    ids = values.to(torch.int64)
    inside = (ids >= 0) & (ids < per_id[:, 0])
    # -1 fails the op's check of the keys (the bounds' and the reference hash's alike)
    keys_of_ids = torch.where(inside, ids + per_id[:, 1], -1)
    _name_from_ids(keys_of_ids, values, counts, keys, names)
    offsets = torch.arange(values.numel() + 1, dtype=torch.int64, device=values.device)
    return LookupArgs(keys_of_ids, offsets, None, keys.layout)


@torch.compiler.disable  # a host-side record of the tensors
def _name_from_ids(keys_of_ids: Tensor, values: Tensor, counts: List[int],
                   keys: KeysLayout, names: Optional[Tuple[str, ...]]) -> None:
    try:
        version: Optional[int] = values._version
    except RuntimeError:  # an inference tensor: no version says whether it changed since
        version = None

    def name() -> None:
        if version is None or values._version == version:
            try:
                _check_ids_now(values.cpu(), counts, keys)
            except ValueError as err:
                name_in_error(err, None, names)
                raise

    name_problems_with(keys_of_ids, name)


# robe::unpooled_keys: the ids made keys, for a traced graph. A Python kernel behind an op,
# so that a trace sees one opaque call whose kernel reads the host (the keys layout, its ids'
# check) as an eager call does. Tagged cudagraph_unsafe: it copies the counts to the device
# each call, which a CUDA graph capture refuses, so Inductor runs it outside its graphs.
_LIB = torch.library.Library("robe", "FRAGMENT")
_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)  # (a tag since torch 2.8)
_LIB.define("unpooled_keys(Tensor values, SymInt[] counts, Tensor table_meta, "
            "SymInt output_dim, SymInt block_size, SymInt hash_mode, SymInt[] hash_params, "
            "SymInt bounds_check) -> Tensor",
            tags=() if _CUDAGRAPH_UNSAFE is None else (_CUDAGRAPH_UNSAFE,))


def _unpooled_keys(values: Tensor, counts: List[int], *layout) -> Tensor:
    """The int64 keys of ``values`` in the layout's feature of keys, checked as
    :func:`_keys_args` checks them (raised now, or deferred)."""
    layout_args = LayoutArgs(*layout)
    keys = _keys_layout(layout_args)
    if keys is None:
        raise ValueError("robe::unpooled_keys: table_meta's features are not one feature of "
                         "keys (one array, one dim, pooled by their sum): the keys_meta given "
                         "to unpooled_args is not this table_meta's")
    try:
        found = _keys_args(values, counts, keys, layout_args.table_meta).values
    except ValueError as err:
        name_in_error(err, layout_args.table_meta)
        raise
    found = found.to(torch.int64)
    return found.clone() if found is values else found  # an op returns no alias


def _unpooled_keys_fake(values: Tensor, counts: List[int], *layout) -> Tensor:
    check_shapes_only(values, *layout)
    return values.new_empty(values.shape, dtype=torch.int64)


_LIB.impl("unpooled_keys", _unpooled_keys, "CompositeExplicitAutograd")
torch.library.register_fake("robe::unpooled_keys", _unpooled_keys_fake, lib=_LIB)


#: below this many ids a feature on average, each id is compared with its feature's range
#: end; from it on, each feature's smallest and largest id (a few us of calls a feature,
#: against a few ns an id: benchmarks/results/probes/unpooled_keys_ab.md)
MIN_MAX_FROM_IDS_A_FEATURE = 2048


@torch.compiler.disable  # raises on what the data hold
def _check_ids_now(values: Tensor, counts: List[int], keys: KeysLayout) -> None:
    if _ids_inside(values, counts, keys.id_ends):
        return
    feature = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts),
                                      output_size=values.numel())
    check_ids(values.cpu(), feature, keys.meta_cpu, keys.meta_cpu, keys.id_check)
    raise AssertionError("robe_unpooled_lookup: an id out of its range passed check_ids")


def _ids_inside(values: Tensor, counts: List[int], ends: List[int]) -> bool:
    """Whether every id of feature ``t`` lies in ``[0, ends[t])`` (one read of the answer)."""
    if values.numel() < MIN_MAX_FROM_IDS_A_FEATURE * len(counts):
        table = ints_on_device([*ends, *counts], torch.int64, values.device)
        per_id = torch.repeat_interleave(table[:len(ends)], table[len(ends):],
                                         output_size=values.numel())
        return not bool(((values < 0) | (values >= per_id)).any())
    present = [(ids, end) for ids, end in zip(values.split(counts), ends) if ids.numel()]
    bounds = torch.stack([torch.stack(torch.aminmax(ids)) for ids, _ in present]).tolist()
    return all(low >= 0 and high < end for (low, high), (_, end) in zip(bounds, present))


def _padded_args(values: Tensor, counts: List[int],
                 layout: LayoutArgs) -> Tuple[LookupArgs, Optional[Tensor]]:
    num_features = len(counts)
    num_ids = values.numel()
    # offsets in the values' dtype, as the op takes them (it refuses other value dtypes)
    index_dtype = values.dtype if values.dtype in (torch.int32, torch.int64) else torch.int64
    if num_features == 1:  # a bag an id, and the op's output is the rows
        offsets = torch.arange(num_ids + 1, dtype=index_dtype, device=values.device)
        return LookupArgs(values, offsets, None, layout), None
    # at least one bag a feature, so that the offsets need no branch on the width (which a
    # compiled graph may hold as an unknown): with no id at all, one empty bag a feature
    width = max([1, *counts])
    dim = layout.output_dim // max(num_features, 1)
    device = values.device
    # What the features' counts give, worked out on the host (a few ints a feature) and
    # copied in one go, so that the device runs a handful of ops a batch: each feature's
    # first id, and a last feature past the end, holding no id from id N on, whose first bag
    # is the offsets' final entry N; and the shift that turns id i of feature f into its
    # row of the op's output seen as [B * T, dim], i * T - (starts[f] * T - f).
    starts = list(itertools.accumulate(counts, initial=0))
    shifts = [start * num_features - f for f, start in enumerate(starts[:-1])]
    # (from pinned memory on CUDA: a copy from pageable memory would wait for the device)
    table = ints_on_device([*counts, 0, *starts, *shifts], torch.int64, device)
    count_t, start_t = table[:num_features + 1], table[num_features + 1:2 * num_features + 2]
    # bag (f, b) holds id starts[f] + b while b < counts[f], else nothing
    bags = (torch.minimum(torch.arange(width, device=device), count_t[:, None])
            + start_t[:, None])
    offsets = bags.view(-1)[:num_features * width + 1].to(index_dtype)
    args = LookupArgs(values, offsets, None, layout._replace(output_dim=num_features * dim))
    # output_size given: the op need not read the counts' sum back from the device
    shift = torch.repeat_interleave(table[2 * num_features + 2:], count_t[:num_features],
                                    output_size=num_ids)
    return args, torch.arange(0, num_ids * num_features, num_features, device=device) - shift


def gather_unpooled(pooled: Tensor, index: Optional[Tensor], dim: int) -> Tensor:
    """``[N, dim]``: each id's row of the op's ``[B, T * dim]`` output (``index`` from
    :func:`unpooled_args`)."""
    if index is None:
        return pooled
    return pooled.reshape(-1, dim).index_select(0, index)


def robe_unpooled_lookup(weights: Tensor, values: Tensor, counts: List[int],
                         layout: LayoutArgs) -> Tensor:
    """One embedding per id, ``[N, dim]``, differentiable in ``weights``: the unpooled lookup
    through ``torch.ops.robe.forward`` (see the module docstring).

    Example::

        >>> rows = robe_unpooled_lookup(ec.weight, kjt.values(), kjt.length_per_key(),
        ...                             ec.layout.op_args(ec.table_meta))
    """
    args, index = unpooled_args(values, counts, layout)
    dim = layout.output_dim // max(len(counts), 1)
    return gather_unpooled(args.forward(weights), index, dim)
