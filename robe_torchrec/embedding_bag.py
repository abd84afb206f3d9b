"""``RobeEmbeddingBagCollection``: a drop-in ``EmbeddingBagCollection`` backed by ROBE-Z."""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from robe_torchrec import ops
from robe_torchrec.config import RobeConfig
from robe_torchrec.fused_lookup import fused_lookup
from robe_torchrec.hashing import HashMode, hash_params, reference_key_limit
from robe_torchrec.ops.meta import BoundsCheck, Pooling, build_table_meta
from robe_torchrec.optim import RobeFusedOptimizer

_LAYOUT_VERSION = 1
_LAYOUT_HEADER = ("format", "hash", "seed", "block_size", "shared", "num_tables")
_LAYOUT_PER_TABLE = ("num_embeddings", "embedding_dim", "array_size")
_POOLING = {PoolingType.SUM: Pooling.SUM, PoolingType.MEAN: Pooling.MEAN}


class RobeEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """A collection of pooled embedding tables compressed by ROBE-Z into one small array
    (or one per table), with the interface of TorchRec's ``EmbeddingBagCollection``.

    It takes the same ``EmbeddingBagConfig`` tables, a ``KeyedJaggedTensor`` in and returns a
    ``KeyedTensor`` with the same keys and ``length_per_key``. Row ``i`` of a table is never
    stored: its values are read from the ROBE array in blocks of ``robe.block_size`` floats
    at hashed offsets, so memory is ``robe.memory_size`` floats whatever the tables' sizes.

    Training: with any ``torch.optim`` optimizer on the dense gradient of :attr:`weight`; or
    with the update fused into backward (SGD, Adagrad, Adam) by calling
    ``torchrec.optim.apply_optimizer_in_backward`` on :attr:`weight`, after which
    :attr:`fused_optimizer` holds the optimizer state and learning rate.

    Args:
        tables: the embedding tables, as for ``EmbeddingBagCollection`` (pooling SUM or MEAN).
        robe: the compression settings.
        is_weighted: whether the input carries per-sample weights.
        device: where the array lives (``"meta"`` allocates nothing).

    Example::

        >>> tables = [EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=10**6,
        ...                              feature_names=["f1"]),
        ...           EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=10**5,
        ...                              feature_names=["f2"])]
        >>> ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=1000, block_size=4))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 0, 1, 1]))
        >>> ebc(kjt).values().shape
        torch.Size([2, 16])
        >>> ebc.compression_ratio
        1000.0...
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        robe: RobeConfig,
        is_weighted: bool = False,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("RobeEmbeddingBagCollection needs at least one table")
        _check_tables(tables)
        self._embedding_bag_configs = tables
        self._robe = robe
        self._is_weighted = is_weighted
        self._hash_mode = robe.hash_mode
        self._hash_params = hash_params(robe.hash_mode, robe.seed)
        self._bounds_check = int(robe.bounds_check_mode)

        table_sizes = [t.num_embeddings * t.embedding_dim for t in tables]
        array_sizes = robe.split_memory(table_sizes)
        self._array_sizes: List[int] = array_sizes
        self._uncompressed_size = sum(table_sizes)
        array_offsets = [sum(array_sizes[:i]) for i in range(len(array_sizes))]

        dims, w_offsets, w_sizes, row_offsets, num_rows, poolings = [], [], [], [], [], []
        for t, table in enumerate(tables):
            array = 0 if robe.shared else t
            for _ in table.feature_names:
                dims.append(table.embedding_dim)
                w_offsets.append(array_offsets[array])
                w_sizes.append(array_sizes[array])
                row_offsets.append(sum(tb.num_embeddings for tb in tables[:t]) if robe.shared else 0)
                num_rows.append(table.num_embeddings)
                poolings.append(int(_POOLING[table.pooling]))
        if self._hash_mode == HashMode.REFERENCE and robe.bounds_check_mode == BoundsCheck.ERROR:
            num_blocks = max(-(-d // robe.block_size) for d in dims)
            limit = reference_key_limit(num_blocks, self._hash_params)
            largest_key = max(r + n - 1 for r, n in zip(row_offsets, num_rows))
            if largest_key >= limit:
                raise ValueError(f"RobeEmbeddingBagCollection: the reference hash computes keys "
                                 f"below {limit} only, but these tables reach key {largest_key}; "
                                 "use RobeConfig(hash='mix')")
        self._feature_names: List[str] = [f for table in tables for f in table.feature_names]
        self._embedding_names: List[str] = [
            name for names in get_embedding_names_by_table(tables) for name in names
        ]
        self._lengths_per_embedding: List[int] = dims
        self._output_dim = sum(dims)
        self._max_dim = max(dims)

        self.weight = nn.Parameter(torch.empty(sum(array_sizes), device=device))
        meta_device = None if self.weight.device.type == "meta" else self.weight.device
        self.register_buffer(
            "table_meta",
            build_table_meta(dims, w_offsets, w_sizes, row_offsets, num_rows, poolings, meta_device),
            persistent=False,
        )
        self.register_buffer("robe_layout", self._layout_tensor(), persistent=True)
        self._fused: Optional[RobeFusedOptimizer] = None
        self.reset_parameters()

    # --- EmbeddingBagCollection interface ------------------------------------------------

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def reset_parameters(self) -> None:
        """Uniform in ``[-s, s]``, ``s = robe.init_scale or sqrt(1 / max num_embeddings)``."""
        if self.weight.device.type == "meta":
            return
        scale = self._robe.init_scale
        if scale is None:
            scale = math.sqrt(1.0 / max(t.num_embeddings for t in self._embedding_bag_configs))
        with torch.no_grad():
            self.weight.uniform_(-scale, scale)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool the embeddings of every feature: ``KeyedJaggedTensor`` -> ``KeyedTensor``."""
        features = self._align_features(features)
        values = features.values()
        offsets = features.offsets()
        if offsets.dtype != values.dtype and values.dtype in (torch.int32, torch.int64):
            offsets = offsets.to(values.dtype)
        per_sample_weights = None
        if self._is_weighted:
            per_sample_weights = features.weights_or_none()
            if per_sample_weights is None:
                raise ValueError("RobeEmbeddingBagCollection(is_weighted=True) got a "
                                 "KeyedJaggedTensor without weights")
        args = (values, offsets, per_sample_weights, self.table_meta, self._output_dim,
                self._robe.block_size, int(self._hash_mode), self._hash_params, self._bounds_check)
        fused = self._sync_fused_optimizer()
        try:
            if fused is None:
                pooled = ops.forward(self.weight, *args)
            else:
                pooled = fused_lookup(self.weight, fused, args)
        except (ValueError, RuntimeError) as err:
            raise self._name_feature(err) from None
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding,
                           values=pooled)

    # --- fused optimizer -----------------------------------------------------------------

    @property
    def fused_optimizer(self) -> Optional[RobeFusedOptimizer]:
        """The in-backward optimizer, once ``apply_optimizer_in_backward`` was called on
        :attr:`weight` (``None`` while training on dense gradients)."""
        return self._sync_fused_optimizer()

    def _sync_fused_optimizer(self) -> Optional[RobeFusedOptimizer]:
        classes = getattr(self.weight, "_optimizer_classes", None)
        if not classes:
            return None
        if len(classes) != 1:
            raise ValueError("RobeEmbeddingBagCollection: exactly one in-backward optimizer "
                             f"per ROBE array is supported, got {len(classes)}")
        kwargs = self.weight._optimizer_kwargs[0]  # type: ignore[attr-defined]
        if self._fused is None or self._fused.optimizer_class is not classes[0]:
            self._fused = RobeFusedOptimizer("weight", self.weight, classes[0], dict(kwargs))
        return self._fused

    # --- size and layout -----------------------------------------------------------------

    @property
    def memory_size(self) -> int:
        """Floats held by the ROBE array(s)."""
        return self.weight.numel()

    @property
    def uncompressed_size(self) -> int:
        """Floats the tables would hold uncompressed (sum of num_embeddings * embedding_dim)."""
        return self._uncompressed_size

    @property
    def compression_ratio(self) -> float:
        return self._uncompressed_size / self.memory_size

    def extra_repr(self) -> str:
        return (f"tables={[t.name for t in self._embedding_bag_configs]}, "
                f"memory_size={self.memory_size}, compression={self.compression_ratio:.1f}x, "
                f"block_size={self._robe.block_size}, hash={self._hash_mode.name.lower()}, "
                f"shared={self._robe.shared}")

    def _layout_tensor(self) -> torch.Tensor:
        header = [_LAYOUT_VERSION, int(self._hash_mode), self._robe.seed, self._robe.block_size,
                  int(self._robe.shared), len(self._embedding_bag_configs)]
        per_table = []
        for t, table in enumerate(self._embedding_bag_configs):
            array = 0 if self._robe.shared else t
            per_table += [table.num_embeddings, table.embedding_dim, self._array_sizes[array]]
        return torch.tensor(header + per_table, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args, **kwargs) -> None:
        saved = state_dict.get(prefix + "robe_layout")
        if saved is not None:
            _check_layout(saved.cpu(), self._layout_tensor(), [t.name for t in self._embedding_bag_configs])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # --- input handling ------------------------------------------------------------------

    def _align_features(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"RobeEmbeddingBagCollection expects a KeyedJaggedTensor, got "
                            f"{type(features).__name__}")
        keys = features.keys()
        if keys == self._feature_names:
            pass
        else:
            missing = [f for f in self._feature_names if f not in keys]
            unknown = [k for k in keys if k not in self._feature_names]
            if missing or unknown:
                raise ValueError(f"RobeEmbeddingBagCollection: features do not match the tables: "
                                 f"missing {missing}, unknown {unknown} (expected {self._feature_names})")
            features = features.permute([keys.index(f) for f in self._feature_names])
        if features.variable_stride_per_key():
            raise ValueError("RobeEmbeddingBagCollection does not support variable batch size "
                             "per feature")
        if features.lengths_or_none() is not None and features.values().numel() != int(
            features.lengths().sum()
        ):
            raise ValueError(f"robe: lengths sum to {int(features.lengths().sum())} but values has "
                             f"{features.values().numel()} entries")
        return features

    def _name_feature(self, err: Exception) -> Exception:
        """Turn an op error's feature index into the feature's name."""
        message = str(err)
        found = re.search(r"of feature (\d+)", message)
        if found and int(found.group(1)) < len(self._feature_names):
            name = self._feature_names[int(found.group(1))]
            message = message.replace(found.group(0), f"of feature {found.group(1)} ('{name}')")
        return type(err)(message)


def _check_tables(tables: List[EmbeddingBagConfig]) -> None:
    names = set()
    for table in tables:
        if table.name in names:
            raise ValueError(f"duplicate table name {table.name!r}")
        names.add(table.name)
        if not table.feature_names:
            table.feature_names = [table.name]
        if table.pooling not in _POOLING:
            raise ValueError(f"table {table.name!r}: pooling {table.pooling} is not supported "
                             "(SUM or MEAN)")
        if table.data_type != DataType.FP32:
            raise ValueError(f"table {table.name!r}: data_type {table.data_type} is not supported "
                             "(ROBE arrays are FP32)")
        if table.num_embeddings < 1 or table.embedding_dim < 1:
            raise ValueError(f"table {table.name!r}: num_embeddings and embedding_dim must be positive")


def _decode_layout(layout: torch.Tensor) -> Dict[str, Any]:
    values = [int(v) for v in layout.tolist()]
    decoded: Dict[str, Any] = dict(zip(_LAYOUT_HEADER, values[: len(_LAYOUT_HEADER)]))
    decoded["hash"] = HashMode(decoded["hash"]).name.lower() if decoded.get("hash") in (0, 1) else decoded.get("hash")
    rest = values[len(_LAYOUT_HEADER):]
    decoded["tables"] = [tuple(rest[i: i + 3]) for i in range(0, len(rest), 3)]
    return decoded


def _check_layout(saved: torch.Tensor, own: torch.Tensor, table_names: List[str]) -> None:
    if saved.shape == own.shape and bool(torch.equal(saved, own)):
        return
    ckpt, mine = _decode_layout(saved), _decode_layout(own)
    diffs = [f"{k}: checkpoint {ckpt.get(k)!r} vs module {mine.get(k)!r}"
             for k in _LAYOUT_HEADER if ckpt.get(k) != mine.get(k)]
    for i, (a, b) in enumerate(zip(ckpt["tables"], mine["tables"])):
        for field, x, y in zip(_LAYOUT_PER_TABLE, a, b):
            if x != y:
                name = table_names[i] if i < len(table_names) else str(i)
                diffs.append(f"table {name!r} {field}: checkpoint {x} vs module {y}")
    raise ValueError("RobeEmbeddingBagCollection: the checkpoint was made with another ROBE "
                     "layout, loading it would scramble every embedding: " + "; ".join(diffs))
