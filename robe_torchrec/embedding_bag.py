"""``RobeEmbeddingBagCollection``: a drop-in ``EmbeddingBagCollection`` backed by ROBE-Z."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple, Type

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from robe_torchrec.config import RobeConfig
from robe_torchrec.fused_lookup import fused_lookup
from robe_torchrec.layout import RobeLayout
from robe_torchrec.ops.args import LookupArgs
from robe_torchrec.optim import RobeFusedOptimizer


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
        >>> ebc.layout.array_sizes, ebc.layout.feature("f2").row_offset   # see RobeLayout
        ((8800,), 1000000)
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        robe: RobeConfig,
        is_weighted: bool = False,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        self._layout = RobeLayout.build(tables, robe)
        for table in tables:  # TorchRec's convention, which the layout followed
            if not table.feature_names:
                table.feature_names = [table.name]
        self._embedding_bag_configs = tables
        self._is_weighted = is_weighted
        self._embedding_names: List[str] = [
            name for names in get_embedding_names_by_table(tables) for name in names
        ]
        self._lengths_per_embedding: List[int] = self._layout.dims

        self.weight = nn.Parameter(torch.empty(self._layout.memory_size, device=device))
        meta_device = None if self.weight.device.type == "meta" else self.weight.device
        self.register_buffer("table_meta", self._layout.table_meta(device=meta_device), persistent=False)
        self.register_buffer("robe_layout", self._layout.to_tensor(), persistent=True)
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

    @property
    def layout(self) -> RobeLayout:
        """Where every table and feature lives (immutable, built once from the tables and
        the :class:`RobeConfig`); the sharder and the sharded lookups read it too."""
        return self._layout

    def reset_parameters(self) -> None:
        """Uniform in ``[-s, s]``, ``s = layout.init_scale`` (``robe.init_scale``, else
        ``sqrt(1 / max num_embeddings)``)."""
        if self.weight.device.type == "meta":
            return
        scale = self._layout.init_scale
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
        args = LookupArgs(values, offsets, per_sample_weights,
                          self._layout.op_args(self.table_meta))
        fused = self._sync_fused_optimizer()
        try:
            if fused is None:
                pooled = args.forward(self.weight)
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

    def in_backward_optimizer(self) -> Optional[Tuple[Type[torch.optim.Optimizer], Dict[str, Any]]]:
        """``(optimizer class, kwargs)`` that ``apply_optimizer_in_backward`` recorded on
        :attr:`weight`, or ``None``; raises if more than one was applied."""
        classes = getattr(self.weight, "_optimizer_classes", None)
        if not classes:
            return None
        if len(classes) != 1:
            raise ValueError("RobeEmbeddingBagCollection: exactly one in-backward optimizer "
                             f"per ROBE array is supported, got {len(classes)}")
        return classes[0], dict(self.weight._optimizer_kwargs[0])  # type: ignore[attr-defined]

    def _sync_fused_optimizer(self) -> Optional[RobeFusedOptimizer]:
        applied = self.in_backward_optimizer()
        if applied is None:
            return None
        optimizer_class, kwargs = applied
        if self._fused is None or self._fused.optimizer_class is not optimizer_class:
            self._fused = RobeFusedOptimizer("weight", self.weight, optimizer_class, kwargs)
        return self._fused

    # --- size and layout -----------------------------------------------------------------

    @property
    def memory_size(self) -> int:
        """Floats held by the ROBE array(s)."""
        return self.weight.numel()

    @property
    def uncompressed_size(self) -> int:
        """Floats the tables would hold uncompressed (sum of num_embeddings * embedding_dim)."""
        return self._layout.uncompressed_size

    @property
    def compression_ratio(self) -> float:
        return self._layout.uncompressed_size / self.memory_size

    def extra_repr(self) -> str:
        layout = self._layout
        return (f"tables={layout.table_names}, "
                f"memory_size={self.memory_size}, compression={self.compression_ratio:.1f}x, "
                f"block_size={layout.block_size}, hash={layout.hash_mode.name.lower()}, "
                f"shared={layout.shared}")

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args, **kwargs) -> None:
        saved = state_dict.get(prefix + "robe_layout")
        if saved is not None:
            self._layout.check_saved(saved)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # --- input handling ------------------------------------------------------------------

    def _align_features(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"RobeEmbeddingBagCollection expects a KeyedJaggedTensor, got "
                            f"{type(features).__name__}")
        keys, expected = features.keys(), self._layout.feature_names
        if keys != expected:
            missing = [f for f in expected if f not in keys]
            unknown = [k for k in keys if k not in expected]
            if missing or unknown:
                raise ValueError(f"RobeEmbeddingBagCollection: features do not match the tables: "
                                 f"missing {missing}, unknown {unknown} (expected {expected})")
            features = features.permute([keys.index(f) for f in expected])
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
        names = self._layout.feature_names
        if found and int(found.group(1)) < len(names):
            name = names[int(found.group(1))]
            message = message.replace(found.group(0), f"of feature {found.group(1)} ('{name}')")
        return type(err)(message)

