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
        tables: the embedding tables, as for ``EmbeddingBagCollection`` (pooling SUM or MEAN;
            data_type FP32, FP16 or BF16, one for all tables: :attr:`weight` is stored in it,
            the output and optimizer state are float32).
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

        self.weight = nn.Parameter(torch.empty(self._layout.memory_size, device=device,
                                               dtype=self._layout.weight_dtype))
        # both buffers are functions of the layout: reset_parameters() rebuilds them after
        # to_empty(), as it re-draws the weight
        self.register_buffer("table_meta", self._layout.table_meta(device=self.weight.device),
                             persistent=False)
        self.register_buffer("robe_layout", self._layout.to_tensor(), persistent=True)
        self._fused: Optional[RobeFusedOptimizer] = None
        self.reset_parameters()

    @classmethod
    def from_embedding_bag_collection(
        cls, ebc: EmbeddingBagCollectionInterface, robe: RobeConfig,
        id_counts: Optional[Dict[str, torch.Tensor]] = None,
    ) -> "RobeEmbeddingBagCollection":
        """A ROBE module with the tables of a trained TorchRec ``EmbeddingBagCollection``,
        its array the least-squares fit of the trained tables under the hash: each slot the
        mean of the table entries landing on it, weighted by ``id_counts`` (table name ->
        look-ups per row; uniform when None). See :mod:`robe_torchrec.compress` and
        docs/compress.md (also for a sharded DCP checkpoint).

            >>> robe_ebc = RobeEmbeddingBagCollection.from_embedding_bag_collection(
            ...     trained_ebc, RobeConfig(compression=100, block_size=8))
        """
        from robe_torchrec.compress import compress_embedding_bag_collection

        return compress_embedding_bag_collection(ebc, robe, id_counts)

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
        """Draw the array uniform in ``[-s, s]``, ``s = layout.init_scale`` (``robe.init_scale``,
        else ``sqrt(1 / max num_embeddings)``), and rebuild the layout buffers.

        As for TorchRec's modules, a module built on the meta device is materialised with
        ``to_empty`` and then this (it draws exactly what construction on the device draws)::

            >>> ebc = RobeEmbeddingBagCollection(tables, robe, device="meta")
            >>> ebc.to_empty(device="cpu")
            >>> torch.manual_seed(0); ebc.reset_parameters()   # == built on CPU after manual_seed(0)
        """
        self._restore_layout_buffers()
        if self.weight.device.type != "meta":
            scale = self._layout.init_scale
            with torch.no_grad():
                self.weight.uniform_(-scale, scale)

    def _restore_layout_buffers(self) -> None:
        with torch.no_grad():
            self.table_meta.copy_(self._layout.table_meta())
            self.robe_layout.copy_(self._layout.to_tensor())

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool the embeddings of every feature: ``KeyedJaggedTensor`` -> ``KeyedTensor``.

        Keys beyond the tables' features are ignored, as ``EmbeddingBagCollection`` ignores
        them. Nothing here waits on the device: ids, offsets and lengths are checked by the op.
        """
        values, offsets, per_sample_weights = _lookup_inputs(
            features, self._layout.feature_names, self._is_weighted)
        args = LookupArgs(values, offsets, per_sample_weights,
                          self._layout.op_args(self.table_meta))
        fused = self._current_fused_optimizer()
        try:
            if fused is None:
                pooled = args.forward(self.weight)
            else:
                pooled = fused_lookup(self.weight, fused, args)
        except (ValueError, RuntimeError) as err:
            raise self._explain(err, features) from None
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding,
                           values=pooled)

    # --- fused optimizer -----------------------------------------------------------------

    @property
    def fused_optimizer(self) -> Optional[RobeFusedOptimizer]:
        """The in-backward optimizer, once ``apply_optimizer_in_backward`` was called on
        :attr:`weight` (``None`` while training on dense gradients)."""
        return self._current_fused_optimizer()

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

    def _current_fused_optimizer(self) -> Optional[RobeFusedOptimizer]:
        # torchrec.fx traces an inference graph: the weight is a Proxy there
        if isinstance(self.weight, torch.fx.Proxy):
            return None
        # a compiled graph guards on what in_backward_optimizer() reads (the attributes
        # apply_optimizer_in_backward sets on the weight): applying one later recompiles
        if self.in_backward_optimizer() is None:
            return None
        self._sync_fused_optimizer()
        return self._fused

    # torch.compile cannot trace the construction of an optimizer; marked constant, this
    # runs for real when a graph is traced (before the graph reads self._fused), and as a
    # plain call in eager mode
    @torch.compiler.assume_constant_result
    def _sync_fused_optimizer(self) -> bool:
        """Create (or replace) the fused optimizer after ``apply_optimizer_in_backward``."""
        applied = self.in_backward_optimizer()
        if applied is not None:
            optimizer_class, kwargs = applied
            if self._fused is None or self._fused.optimizer_class is not optimizer_class:
                self._fused = RobeFusedOptimizer("weight", self.weight, optimizer_class, kwargs,
                                                 block_size=self._layout.block_size)
        return True

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
        elif prefix + "weight" in state_dict:
            # Without the layout nothing says the array means the same embeddings: refused
            # before anything is copied, whatever `strict` (torch hands every module
            # strict=True here and applies the caller's only to the key lists afterwards).
            raise ValueError(
                f"RobeEmbeddingBagCollection: the state dict has {prefix}weight but no "
                f"{prefix}robe_layout, so the array's layout cannot be checked (another "
                "layout would scramble every embedding); load a state dict saved with its "
                f"robe_layout, or, if you know the array has this module's layout, add "
                f"state_dict['{prefix}robe_layout'] = module.robe_layout")
        # after to_empty() the non-persistent table_meta is garbage and no checkpoint has it
        self._restore_layout_buffers()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # --- errors -------------------------------------------------------------------------

    def _explain(self, err: Exception, features: KeyedJaggedTensor) -> Exception:
        """The op's error in the input's terms: the feature's name next to its index, and the
        lengths the caller gave rather than the offsets computed from them."""
        message = str(err)
        found = re.search(r"of feature (\d+)", message)
        names = self._layout.feature_names
        if found and int(found.group(1)) < len(names):
            name = names[int(found.group(1))]
            message = message.replace(found.group(0), f"of feature {found.group(1)} ('{name}')")
        if features.lengths_or_none() is not None:  # its offsets are their cumulative sum
            message = re.sub(r"offsets\[-1\] = (\d+) but values has (\d+) entries \(.*?\)",
                             r"lengths sum to \1 but values has \2 entries", message)
        return type(err)(message)


# --- input handling ------------------------------------------------------------------------

@torch.fx.wrap  # a leaf of torchrec.fx graphs: it reads keys and dtypes, which a Proxy lacks
def _lookup_inputs(
    features: KeyedJaggedTensor, feature_names: List[str], is_weighted: bool
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(values, offsets, per_sample_weights)`` of the tables' features, in the order of
    ``feature_names``, as the op takes them.

    Example::

        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["other", "f1"], values=torch.tensor([7, 1, 2]), lengths=torch.tensor([1, 2]))
        >>> _lookup_inputs(kjt, ["f1"], is_weighted=False)
        (tensor([1, 2]), tensor([0, 2]), None)
    """
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"RobeEmbeddingBagCollection expects a KeyedJaggedTensor, got "
                        f"{type(features).__name__}")
    features = _select_features(features, feature_names)
    if features.variable_stride_per_key():
        raise ValueError("RobeEmbeddingBagCollection does not support variable batch size "
                         "per feature")
    values, offsets = features.values(), features.offsets()
    if offsets.dtype != values.dtype and values.dtype in (torch.int32, torch.int64):
        offsets = offsets.to(values.dtype)
    per_sample_weights = None
    if is_weighted:
        per_sample_weights = features.weights_or_none()
        if per_sample_weights is None:
            raise ValueError("RobeEmbeddingBagCollection(is_weighted=True) got a "
                             "KeyedJaggedTensor without weights")
    return values, offsets, per_sample_weights


def _select_features(features: KeyedJaggedTensor, feature_names: List[str]) -> KeyedJaggedTensor:
    """``features`` reduced to ``feature_names``, in that order; other keys are dropped (as
    ``EmbeddingBagCollection`` drops them), a missing one raises ``ValueError`` naming it."""
    keys = features.keys()
    if keys == feature_names:  # the usual case: no copy, no read of the lengths
        return features
    missing = [f for f in feature_names if f not in keys]
    if missing:
        # an unknown key next to a missing one is likely a typo of it: name both
        unknown = [k for k in keys if k not in feature_names]
        also = f", unknown {unknown}" if unknown else ""
        raise ValueError(f"RobeEmbeddingBagCollection: the input lacks features of the tables: "
                         f"missing {missing}{also} (expected {feature_names}; unknown "
                         "features are ignored)")
    return features.permute([keys.index(f) for f in feature_names])
