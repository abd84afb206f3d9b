"""``RobeEmbeddingBagCollection``: a drop-in ``EmbeddingBagCollection`` backed by ROBE-Z."""

# No ``from __future__ import annotations``: torchrec.fx copies forward's annotations into its
# graph, and TorchScript, given that graph, reads a string annotation as an unknown type
# before it reaches robe_torchrec.torchscript's refusal.

from typing import Dict, List, Optional, Tuple

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from robe_torchrec import stock_state_dict
from robe_torchrec.array_module import RobeArrayModule, as_kjt, check_kjt, select_features
from robe_torchrec.config import RobeConfig
from robe_torchrec.least_squares import copy_table, fit_into, table_weights
from robe_torchrec.ops.args import LookupArgs
from robe_torchrec.torchscript import not_scriptable
from robe_torchrec.variable_batch import expand_variable_strides, pad_variable_strides

# a leaf of torchrec.fx graphs: it branches on the KJT's strides, which a Proxy lacks
torch.fx.wrap("expand_variable_strides")


class RobeEmbeddingBagCollection(RobeArrayModule, EmbeddingBagCollectionInterface):
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
        # a stock EBC's state dict gets a hint, not a key list
        stock_state_dict.register(self, stock_state_dict.BAGS)
        self._init_array(tables, robe, device)
        self._embedding_bag_configs = tables
        self._is_weighted = is_weighted
        self._embedding_names: List[str] = [
            name for names in get_embedding_names_by_table(tables) for name in names
        ]
        self._lengths_per_embedding: List[int] = self._layout.dims

    @classmethod
    def from_embedding_bag_collection(
        cls, ebc: EmbeddingBagCollectionInterface, robe: RobeConfig,
        id_counts: Optional[Dict[str, torch.Tensor]] = None,
    ) -> "RobeEmbeddingBagCollection":
        """A ROBE module with the tables of a trained TorchRec ``EmbeddingBagCollection``,
        its array the least-squares fit of the trained tables under the hash: each slot the
        mean of the table entries landing on it, weighted by ``id_counts`` (table name ->
        look-ups per row; uniform when None). See :mod:`robe_torchrec.least_squares`, and
        :mod:`robe_torchrec.compress` and docs/compress.md for a sharded DCP checkpoint.

            >>> robe_ebc = RobeEmbeddingBagCollection.from_embedding_bag_collection(
            ...     trained_ebc, RobeConfig(compression=100, block_size=8))
        """
        tables = [copy_table(t) for t in ebc.embedding_bag_configs()]
        robe_ebc = cls(tables, robe, is_weighted=ebc.is_weighted())
        fit_into(robe_ebc, table_weights(ebc), id_counts)
        return robe_ebc

    # --- EmbeddingBagCollection interface ------------------------------------------------

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool the embeddings of every feature: ``KeyedJaggedTensor`` -> ``KeyedTensor``.

        Keys beyond the tables' features are ignored, as ``EmbeddingBagCollection`` ignores
        them. Nothing here waits on the device: ids, offsets and lengths are checked by the op.
        """
        features = as_kjt(features)  # a TensorDict, as EmbeddingBagCollection takes it
        names = self._layout.feature_names
        values, offsets, per_sample_weights = _lookup_inputs(features, names, self._is_weighted)
        args = LookupArgs(values, offsets, per_sample_weights,
                          self._layout.op_args(self.table_meta))
        pooled = expand_variable_strides(self._run_lookup(args, features), features, names,
                                         self._lengths_per_embedding)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding,
                           values=pooled)


# --- input handling ------------------------------------------------------------------------

@torch.fx.wrap  # a leaf of torchrec.fx graphs: it reads keys and dtypes, which a Proxy lacks
@not_scriptable  # the first call of such a graph: TorchScript stops here, with our error
def _lookup_inputs(
    features: KeyedJaggedTensor, feature_names: List[str], is_weighted: bool
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(values, offsets, per_sample_weights)`` of the tables' features, in the order of
    ``feature_names``, as the op takes them. A KJT with a variable batch size per feature
    is padded to its largest (:func:`~robe_torchrec.variable_batch.pad_variable_strides`).

    Example::

        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["other", "f1"], values=torch.tensor([7, 1, 2]), lengths=torch.tensor([1, 2]))
        >>> _lookup_inputs(kjt, ["f1"], is_weighted=False)
        (tensor([1, 2]), tensor([0, 2]), None)
    """
    features = select_features(check_kjt(features, "RobeEmbeddingBagCollection"), feature_names)
    if features.variable_stride_per_key():
        features = pad_variable_strides(features)
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
