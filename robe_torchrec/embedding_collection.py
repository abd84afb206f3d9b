"""``RobeEmbeddingCollection``: a drop-in ``EmbeddingCollection`` (unpooled) backed by ROBE-Z."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from robe_torchrec import stock_state_dict
from robe_torchrec.array_module import RobeArrayModule, as_kjt, check_kjt, select_features
from robe_torchrec.config import RobeConfig
from robe_torchrec.least_squares import copy_sequence_table, fit_into, sequence_table_weights
from robe_torchrec.ops.unpooled import gather_unpooled, keys_table_meta, unpooled_args


class RobeEmbeddingCollection(RobeArrayModule, EmbeddingCollectionInterface):
    """A collection of unpooled embedding tables (one embedding per id, as for sequence
    features) compressed by ROBE-Z, with the interface of TorchRec's ``EmbeddingCollection``.

    It takes the same ``EmbeddingConfig`` tables, a ``KeyedJaggedTensor`` in and returns a
    ``Dict[str, JaggedTensor]``: for each feature, the embedding of each of its ids with the
    feature's lengths (and offsets), as ``EmbeddingCollection`` returns it; a KJT with a
    variable batch size per feature gives each feature its own lengths, as there.

    The array, the :class:`RobeConfig` (hash, block size, shared or per-table arrays), the
    layout, the state-dict checks and training (any ``torch.optim`` optimizer on the dense
    gradient of :attr:`weight`, or SGD / Adagrad / row-wise Adagrad / Adam fused into backward
    with ``torchrec.optim.apply_optimizer_in_backward``) are those of
    :class:`~robe_torchrec.RobeEmbeddingBagCollection`: the lookup is the pooled op with one
    id per bag (:func:`robe_torchrec.ops.robe_unpooled_lookup`), so the two modules built from
    the same tables, config and seed give the same vector for an id.

    Args:
        tables: the embedding tables, as for ``EmbeddingCollection`` (one ``embedding_dim``
            for all, as there; data_type FP32, FP16 or BF16, one for all).
        robe: the compression settings.
        device: where the array lives (``"meta"`` allocates nothing).
        need_indices: also return each feature's ids, as the ``weights`` of its
            ``JaggedTensor`` (as ``EmbeddingCollection(need_indices=True)``).

    Example::

        >>> tables = [EmbeddingConfig(name="items", embedding_dim=8, num_embeddings=10**6,
        ...                           feature_names=["history", "candidate"])]
        >>> ec = RobeEmbeddingCollection(tables, RobeConfig(compression=1000, block_size=4))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["history", "candidate"], values=torch.tensor([5, 6, 7, 8, 9]),
        ...     lengths=torch.tensor([3, 0, 1, 1]))
        >>> out = ec(kjt)
        >>> out["history"].values().shape, out["history"].lengths()
        (torch.Size([3, 8]), tensor([3, 0]))
    """

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        robe: RobeConfig,
        device: Optional[torch.device | str] = None,
        need_indices: bool = False,
    ) -> None:
        super().__init__()
        check_one_dim(tables)
        self._init_array(tables, robe, device)
        # the features as one feature of keys, for the graphs torch.compile traces (which
        # cannot derive it from table_meta); None where the keys cannot serve them
        self.register_buffer("keys_table_meta", self._keys_table_meta(self.weight.device),
                             persistent=False)
        self._embedding_configs = tables
        self._need_indices = need_indices
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._embedding_names: List[str] = [
            name for names in self._embedding_names_by_table for name in names
        ]
        self._embedding_dim = tables[0].embedding_dim
        # a stock EmbeddingCollection's state dict gets a hint, not a key list
        stock_state_dict.register(self, stock_state_dict.SEQUENCES)

    @classmethod
    def from_embedding_collection(
        cls, ec: EmbeddingCollectionInterface, robe: RobeConfig,
        id_counts: Optional[Dict[str, torch.Tensor]] = None,
    ) -> "RobeEmbeddingCollection":
        """A ROBE module with the tables of a trained TorchRec ``EmbeddingCollection``, its
        array the least-squares fit of the trained tables under the hash, as
        :meth:`RobeEmbeddingBagCollection.from_embedding_bag_collection` fits a bag
        collection's (``id_counts``: table name -> look-ups per row; uniform when None).

            >>> robe_ec = RobeEmbeddingCollection.from_embedding_collection(
            ...     trained_ec, RobeConfig(compression=100, block_size=8))
        """
        tables = [copy_sequence_table(t) for t in ec.embedding_configs()]
        robe_ec = cls(tables, robe, need_indices=ec.need_indices())
        fit_into(robe_ec, sequence_table_weights(ec), id_counts)
        return robe_ec

    # --- EmbeddingCollection interface ---------------------------------------------------

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_names_by_table(self) -> List[List[str]]:
        return self._embedding_names_by_table

    def need_indices(self) -> bool:
        return self._need_indices

    def use_gather_select(self) -> bool:
        """What ``ShardedEmbeddingCollection`` asks of an ``EmbeddingCollection``: never."""
        return False

    def use_gather_select_per_sharding(self) -> Optional[Dict[str, bool]]:
        return None

    def _keys_table_meta(self, device: Optional[torch.device | str] = None
                         ) -> Optional[torch.Tensor]:
        return keys_table_meta(self._layout.table_meta().tolist(), self._layout.output_dim,
                               device)

    def _restore_layout_buffers(self) -> None:
        super()._restore_layout_buffers()
        keys_meta = getattr(self, "keys_table_meta", None)  # (registered after the array)
        if keys_meta is not None:
            with torch.no_grad():
                keys_meta.copy_(self._keys_table_meta())

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """The embedding of every id of every feature: ``KeyedJaggedTensor`` ->
        ``Dict[str, JaggedTensor]`` keyed by embedding name (the feature's name).

        Keys beyond the tables' features are ignored, as ``EmbeddingCollection`` ignores
        them; per-sample weights are ignored too. Ids are checked by the op.
        """
        features = as_kjt(features)  # a TensorDict, as EmbeddingCollection takes it
        features = select_features(check_kjt(features, "RobeEmbeddingCollection"),
                                   self._layout.feature_names, "RobeEmbeddingCollection")
        counts = features.length_per_key()
        values = features.values()
        try:
            args, index = unpooled_args(values, counts, self._layout.op_args(self.table_meta),
                                        self.keys_table_meta)
        except ValueError as err:  # an id that fails its check
            raise self._explain(err, features) from None
        rows = gather_unpooled(self._run_lookup(args, features), index, self._embedding_dim)
        lengths = features.lengths().split(features.stride_per_key())
        ids = values.split(counts)
        return {name: JaggedTensor(values=r, lengths=n, weights=i if self._need_indices else None)
                for name, r, n, i in zip(self._embedding_names, rows.split(counts), lengths, ids)}


def check_one_dim(tables: List[EmbeddingConfig]) -> None:
    """``EmbeddingCollection``'s rule, with its message: one ``embedding_dim`` for all tables."""
    if tables and any(t.embedding_dim != tables[0].embedding_dim for t in tables):
        dims = {t.name: t.embedding_dim for t in tables}
        raise ValueError("RobeEmbeddingCollection: all tables are required to have the same "
                         f"embedding dimension, as in EmbeddingCollection (got {dims}); put "
                         "tables of another dim in a second RobeEmbeddingCollection")
