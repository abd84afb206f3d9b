"""``RobeLayout``: where every table and feature of a ROBE module lives, computed once.

Given the tables (TorchRec ``EmbeddingBagConfig``) and a :class:`~robe_torchrec.RobeConfig`,
the layout fixes the ROBE arrays (sizes and offsets in the module's flat ``weight``), which
array each table hashes into and with which key offset, the per-feature metadata the ops take
(``table_meta``), the hash parameters, the bounds-check mode, the initial scale, and the
``robe_layout`` tensor a checkpoint carries. The unsharded module, the sharder and the sharded
lookups all read this one immutable object instead of recomputing any of it.

Example::

    >>> from torchrec import EmbeddingBagConfig
    >>> from robe_torchrec import RobeConfig, RobeLayout
    >>> tables = [EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=1000,
    ...                              feature_names=["f1"]),
    ...           EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=500,
    ...                              feature_names=["f2", "f3"])]
    >>> layout = RobeLayout.build(tables, RobeConfig(memory_size=1024, block_size=4))
    >>> layout.array_sizes, layout.output_dim, layout.feature("f3").row_offset
    ((1024,), 16, 1000)
    >>> layout.table_meta().shape            # [NUM_META_FIELDS, features]
    torch.Size([7, 3])
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    PoolingType,
)

from robe_torchrec.config import RobeConfig
from robe_torchrec.hashing import HashMode, hash_params, reference_key_limit
from robe_torchrec.ops.args import LayoutArgs
from robe_torchrec.ops.meta import BoundsCheck, Pooling, build_table_meta
from robe_torchrec.table_init import TableInit, array_inits

#: the TorchRec data types a ROBE array can be stored in, and its torch dtype (the kernels
#: accumulate in float32 and return float32 for FP16 / BF16 arrays; optimizer state is float32)
WEIGHT_DTYPE_OF: Dict[DataType, torch.dtype] = {DataType.FP32: torch.float32,
                                                DataType.FP16: torch.float16,
                                                DataType.BF16: torch.bfloat16}

#: the TorchRec poolings ROBE supports, as the ops encode them
POOLING_OF: Dict[PoolingType, Pooling] = {PoolingType.SUM: Pooling.SUM,
                                          PoolingType.MEAN: Pooling.MEAN}

# the persisted ``robe_layout`` tensor: a header, then four numbers per table (format 1, of
# checkpoints saved before table names were recorded: the last three)
LAYOUT_FORMAT = 2
_HEADER_FIELDS = ("format", "hash", "seed", "block_size", "shared", "num_tables")
_TABLE_FIELDS = ("num_embeddings", "embedding_dim", "array_size")
#: each format's numbers per table
_TABLE_WIDTH = {1: len(_TABLE_FIELDS), 2: 1 + len(_TABLE_FIELDS)}


def name_fingerprint(name: str) -> int:
    """A table name as the int64 ``robe_layout`` records (the first 8 bytes of its SHA-256):
    a tensor cannot hold the name, and a checkpoint must tell its tables apart."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


@dataclasses.dataclass(frozen=True)
class TableLayout:
    """Where one table lives."""

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: Pooling
    feature_names: Tuple[str, ...]
    array: int  # index of the ROBE array it hashes into
    row_offset: int  # added to its ids to form hash keys (shared layout), else 0


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
    """One input feature: one column of ``table_meta``.

    ``array_offset`` / ``array_size`` say where the hashed array lies in the weights handed
    to the op: the module's flat ``weight`` here; a sharded lookup relocates them into its
    local weight (``dataclasses.replace``), and row-wise also narrows ``row_offset``,
    ``num_rows`` and ``array_size`` to the rank's block.
    """

    name: str
    table: int  # index of its table
    dim: int
    array: int  # index of its ROBE array
    array_offset: int  # W_OFFSET
    array_size: int  # W_SIZE: what the hash maps into
    row_offset: int  # ROW_OFFSET
    num_rows: int  # NUM_ROWS: exclusive bound on ids when bounds are checked
    pooling: Pooling


def check_tables(tables: Sequence[EmbeddingBagConfig]) -> None:
    """Refuse tables ROBE cannot hold, naming the table."""
    if not tables:
        raise ValueError("RobeEmbeddingBagCollection needs at least one table")
    names = set()
    for table in tables:
        if table.name in names:
            raise ValueError(f"duplicate table name {table.name!r}")
        names.add(table.name)
        if table_pooling(table) not in POOLING_OF:
            raise ValueError(f"table {table.name!r}: pooling {table.pooling} is not supported "
                             "(SUM or MEAN)")
        if table.data_type not in WEIGHT_DTYPE_OF:
            raise ValueError(f"table {table.name!r}: data_type {table.data_type} is not supported "
                             "(ROBE arrays are FP32, FP16 or BF16)")
        if table.num_embeddings < 1 or table.embedding_dim < 1:
            raise ValueError(f"table {table.name!r}: num_embeddings and embedding_dim must be "
                             f"positive, got num_embeddings={table.num_embeddings}, "
                             f"embedding_dim={table.embedding_dim}")
    data_types = {t.data_type for t in tables}
    if len(data_types) > 1:
        found = ", ".join(f"{t.name!r}: {t.data_type.name}" for t in tables)
        raise ValueError("RobeEmbeddingBagCollection: all tables of one module must share one "
                         f"data_type, as they live in one flat ROBE weight (got {found}); put "
                         "tables of another data_type in a second RobeEmbeddingBagCollection")


def table_pooling(table: BaseEmbeddingConfig) -> PoolingType:
    """The table's pooling; an unpooled table (``EmbeddingConfig``, which has none) is looked
    up with one id per bag pooled by SUM (:mod:`robe_torchrec.ops.unpooled`)."""
    return getattr(table, "pooling", PoolingType.SUM)


def weight_dtype_of(tables: Sequence[EmbeddingBagConfig]) -> torch.dtype:
    """The dtype of the flat ``weight`` holding ``tables`` (checked by :func:`check_tables`)."""
    return WEIGHT_DTYPE_OF[tables[0].data_type]


@dataclasses.dataclass(frozen=True)
class RobeLayout:
    """The derived layout of a ROBE module (immutable; build with :meth:`build`).

    Attributes:
        config: the compression settings it was built from.
        tables: one :class:`TableLayout` per table, in the order given.
        features: one :class:`FeatureLayout` per feature, tables' features in order: the
            order of the module's input keys, of ``table_meta``'s columns and of the output.
        array_sizes: floats of each ROBE array (one if ``config.shared``, else one per table).
        array_offsets: where each array starts in the flat ``weight``.
        hash_params: the hash's parameters (from ``config.hash`` and ``config.seed``).
        init_scale: arrays whose tables say nothing of their initialisation start uniform
            in ``[-init_scale, init_scale]``.
        array_inits: per array, its tables' own initialisation, or ``None`` for that default
            (see :mod:`robe_torchrec.table_init`).
        uncompressed_size: floats the tables would hold uncompressed.
        weight_dtype: the dtype of the flat ``weight`` (the tables' ``data_type``: float32,
            float16 or bfloat16; all tables share it).
    """

    config: RobeConfig
    tables: Tuple[TableLayout, ...]
    features: Tuple[FeatureLayout, ...]
    array_sizes: Tuple[int, ...]
    array_offsets: Tuple[int, ...]
    hash_params: Tuple[int, ...]
    init_scale: float
    uncompressed_size: int
    weight_dtype: torch.dtype = torch.float32
    array_inits: Tuple[Optional[TableInit], ...] = ()
    #: what :meth:`op_args` puts after ``table_meta``, derived once: every forward reads it,
    #: and deriving it (a sum over the features, two config parses) took 3 us of a module
    #: forward's host work
    _fixed_op_args: Tuple[Any, ...] = dataclasses.field(init=False, repr=False, compare=False)
    #: the features' names, for the same reason (a module forward selects its keys by them)
    _fixed_feature_names: Tuple[str, ...] = dataclasses.field(init=False, repr=False,
                                                              compare=False)

    @classmethod
    def build(cls, tables: Sequence[EmbeddingBagConfig], robe: RobeConfig) -> "RobeLayout":
        """The layout of ``tables`` compressed by ``robe``; raises ``ValueError`` for tables
        ROBE cannot hold or keys the reference hash cannot compute. A table without
        ``feature_names`` has one feature named as the table (TorchRec's convention)."""
        check_tables(tables)
        table_sizes = [t.num_embeddings * t.embedding_dim for t in tables]
        array_sizes = robe.split_memory(table_sizes)
        array_offsets = [sum(array_sizes[:i]) for i in range(len(array_sizes))]
        table_layouts: List[TableLayout] = []
        features: List[FeatureLayout] = []
        for t, table in enumerate(tables):
            array = 0 if robe.shared else t
            row_offset = sum(tb.num_embeddings for tb in tables[:t]) if robe.shared else 0
            pooling = POOLING_OF[table_pooling(table)]
            names = tuple(table.feature_names or [table.name])
            table_layouts.append(TableLayout(table.name, table.num_embeddings,
                                             table.embedding_dim, pooling, names, array,
                                             row_offset))
            features += [FeatureLayout(name, t, table.embedding_dim, array, array_offsets[array],
                                       array_sizes[array], row_offset, table.num_embeddings,
                                       pooling)
                         for name in names]
        init_scale = robe.init_scale
        if init_scale is None:  # the reference DLRM's initialisation
            init_scale = math.sqrt(1.0 / max(t.num_embeddings for t in tables))
        return cls(
            config=robe,
            tables=tuple(table_layouts),
            features=tuple(features),
            array_sizes=tuple(array_sizes),
            array_offsets=tuple(array_offsets),
            hash_params=tuple(hash_params(robe.hash_mode, robe.seed)),
            init_scale=float(init_scale),
            uncompressed_size=sum(table_sizes),
            weight_dtype=weight_dtype_of(tables),
            array_inits=array_inits(tables, [t.array for t in table_layouts], len(array_sizes),
                                    robe.init_scale is not None),
        )

    def __post_init__(self) -> None:
        # a frozen dataclass sets a derived field through object's own setattr
        object.__setattr__(self, "_fixed_op_args", (
            sum(f.dim for f in self.features), self.config.block_size,
            int(self.config.hash_mode), tuple(self.hash_params),
            int(self.config.bounds_check_mode)))
        object.__setattr__(self, "_fixed_feature_names", tuple(f.name for f in self.features))
        # the reference hash overflows beyond a key limit: refuse tables whose ids reach it
        if self.hash_mode != HashMode.REFERENCE or self.bounds_check != BoundsCheck.ERROR:
            return
        num_blocks = max(-(-f.dim // self.block_size) for f in self.features)
        limit = reference_key_limit(num_blocks, list(self.hash_params))
        largest_key = max(f.row_offset + f.num_rows - 1 for f in self.features)
        if largest_key >= limit:
            raise ValueError(f"RobeEmbeddingBagCollection: the reference hash computes keys "
                             f"below {limit} only, but these tables reach key {largest_key}; "
                             "use RobeConfig(hash='mix')")

    # --- settings of the config, as the ops take them --------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def shared(self) -> bool:
        return self.config.shared

    @property
    def hash_mode(self) -> HashMode:
        return self.config.hash_mode

    @property
    def bounds_check(self) -> BoundsCheck:
        return self.config.bounds_check_mode

    # --- sizes -----------------------------------------------------------------------------

    @property
    def memory_size(self) -> int:
        """Floats of all ROBE arrays together (the size of the flat ``weight``)."""
        return sum(self.array_sizes)

    @property
    def table_names(self) -> List[str]:
        return [t.name for t in self.tables]

    @property
    def feature_names(self) -> List[str]:
        return list(self._fixed_feature_names)

    @property
    def dims(self) -> List[int]:
        """Embedding dim of each feature (the output's ``length_per_key``)."""
        return [f.dim for f in self.features]

    @property
    def output_dim(self) -> int:
        return self._fixed_op_args[0]

    def table_index(self, name: str) -> int:
        return self.table_names.index(name)

    def feature(self, name: str) -> FeatureLayout:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(f"RobeLayout: no feature {name!r} (features: {self.feature_names})")

    def table_array_share(self, t: int) -> int:
        """Floats of ROBE memory attributable to table ``t``: its own array, or its share of
        the shared array in proportion to ``num_embeddings * embedding_dim``."""
        table = self.tables[t]
        if not self.shared:
            return self.array_sizes[table.array]
        sizes = [tb.num_embeddings * tb.embedding_dim for tb in self.tables]
        return max(1, math.ceil(self.array_sizes[0] * sizes[t] / sum(sizes)))

    # --- initialisation ----------------------------------------------------------------------

    def draw(self, weight: torch.Tensor) -> None:
        """Initialise the flat ``weight`` in place: each array uniform in
        ``[-init_scale, init_scale]``, or as its tables say (:attr:`array_inits`)."""
        with torch.no_grad():
            if not any(self.array_inits):  # one draw over every array, as always
                weight.uniform_(-self.init_scale, self.init_scale)
                return
            for a, init in enumerate(self.array_inits):
                array = weight[self.array_offsets[a]: self.array_offsets[a] + self.array_sizes[a]]
                if init is None:
                    array.uniform_(-self.init_scale, self.init_scale)
                else:
                    init.draw(array, [t.name for t in self.tables if t.array == a])

    # --- op arguments ----------------------------------------------------------------------

    def table_meta(self, features: Optional[Sequence[FeatureLayout]] = None,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """The ops' ``table_meta`` (see :mod:`robe_torchrec.ops.meta`) of ``features`` in that
        order: by default all of them (the unsharded module's); a sharded lookup passes its
        features placed in its local weight."""
        features = self.features if features is None else features
        return build_table_meta(
            [f.dim for f in features], [f.array_offset for f in features],
            [f.array_size for f in features], [f.row_offset for f in features],
            [f.num_rows for f in features], [int(f.pooling) for f in features], device)

    def op_args(self, table_meta: torch.Tensor, output_dim: Optional[int] = None) -> LayoutArgs:
        """The op arguments this layout fixes, around ``table_meta`` (the module's buffer, or
        a sharded lookup's of its local features with their ``output_dim``)."""
        own_dim, block_size, hash_mode, params, bounds_check = self._fixed_op_args
        return LayoutArgs(table_meta, own_dim if output_dim is None else output_dim,
                          block_size, hash_mode, list(params), bounds_check)

    # --- the checkpointed layout -----------------------------------------------------------

    def to_tensor(self) -> torch.Tensor:
        """The ``robe_layout`` tensor a state dict carries: what must match for a checkpoint's
        array to mean the same embeddings, the tables' names and order included (int64,
        format ``LAYOUT_FORMAT``)."""
        return self._layout_tensor(LAYOUT_FORMAT)

    def _layout_tensor(self, version: int) -> torch.Tensor:
        header = [version, int(self.hash_mode), self.config.seed, self.block_size,
                  int(self.shared), len(self.tables)]
        per_table: List[int] = []
        for table in self.tables:
            if version >= 2:
                per_table.append(name_fingerprint(table.name))
            per_table += [table.num_embeddings, table.embedding_dim, self.array_sizes[table.array]]
        return torch.tensor(header + per_table, dtype=torch.int64)

    def check_saved(self, saved: torch.Tensor) -> None:
        """Raise ``ValueError`` naming every difference if the ``robe_layout`` tensor of a
        checkpoint is not this layout's (loading it would scramble every embedding): its
        tables in another order, or other tables, count as differences, since a table's rows
        are keys placed after those of the tables before it. A checkpoint of format 1, saved
        before the names were recorded, is checked on everything else, with a warning."""
        saved = saved.cpu()
        version = int(saved[0]) if saved.numel() else 0
        own = self._layout_tensor(version) if version in _TABLE_WIDTH else self.to_tensor()
        if saved.shape == own.shape and bool(torch.equal(saved, own)):
            if version < LAYOUT_FORMAT:
                warnings.warn(
                    f"robe_layout of format {version} holds no table names, so the order of "
                    f"the checkpoint's tables cannot be checked: they are taken to be this "
                    f"module's, {self.table_names}. Save the module again to record them",
                    stacklevel=3)
            return
        if version not in _TABLE_WIDTH:
            raise ValueError(
                f"RobeEmbeddingBagCollection: the checkpoint's robe_layout has format "
                f"{version}, which this robe_torchrec does not know (it reads formats "
                f"{sorted(_TABLE_WIDTH)}): it was saved by another version of robe_torchrec")
        ckpt, mine = _decode(saved), _decode(own)
        diffs = [f"{k}: checkpoint {ckpt.get(k)!r} vs module {mine.get(k)!r}"
                 for k in _HEADER_FIELDS if ckpt.get(k) != mine.get(k)]
        names = self.table_names
        if ckpt["names"] != mine["names"]:
            by_print = {name_fingerprint(n): n for n in names}
            theirs = [by_print.get(p, "<a table this module does not have>")
                      for p in ckpt["names"]]
            order = ("the same tables in another order" if sorted(ckpt["names"]) ==
                     sorted(mine["names"]) else "other tables")
            diffs.append(f"{order}: checkpoint {theirs} vs module {names} (build the module "
                         f"with the checkpoint's tables, in its order)")
        else:
            for i, (a, b) in enumerate(zip(ckpt["tables"], mine["tables"])):
                for field, x, y in zip(_TABLE_FIELDS, a, b):
                    if x != y:
                        name = names[i] if i < len(names) else str(i)
                        diffs.append(f"table {name!r} {field}: checkpoint {x} vs module {y}")
        raise ValueError("RobeEmbeddingBagCollection: the checkpoint was made with another ROBE "
                         "layout, loading it would scramble every embedding: " + "; ".join(diffs))


def _decode(layout: torch.Tensor) -> Dict[str, Any]:
    values = [int(v) for v in layout.tolist()]
    decoded: Dict[str, Any] = dict(zip(_HEADER_FIELDS, values[: len(_HEADER_FIELDS)]))
    if decoded.get("hash") in (0, 1):
        decoded["hash"] = HashMode(decoded["hash"]).name.lower()
    rest = values[len(_HEADER_FIELDS):]
    width = _TABLE_WIDTH[decoded["format"]]
    rows = [rest[i: i + width] for i in range(0, len(rest), width)]
    named = width > len(_TABLE_FIELDS)  # the name's fingerprint first
    decoded["names"] = [row[0] for row in rows] if named else None
    decoded["tables"] = [tuple(row[1:] if named else row) for row in rows]
    return decoded
