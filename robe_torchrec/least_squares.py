"""The least-squares fit of trained embedding tables into a ROBE-Z array, under the hash.

Every element ``(table t, row i, column j)`` of the tables is read from exactly one slot of
the ROBE array (:mod:`robe_torchrec.hashing`), so the array ``W`` that best reproduces the
trained tables ``E`` in weighted least squares,

    minimise  sum_{t,i,j}  c_{t,i} * (W[slot(t, i, j)] - E_t[i, j]) ** 2,

has a closed form: each slot holds the ``c``-weighted mean of the table entries that land on
it (the design matrix has one 1 per row, so the normal equations are diagonal). ``c_{t,i}``
is how often id ``i`` of table ``t`` is looked up (``id_counts``; uniform without it): the
frequent rows, whose embeddings matter most to the loss, win the collisions. A slot that no
entry with positive weight lands on is set to 0 (the minimum-norm solution).

This module knows layouts and modules' arrays, not the module classes: both
``RobeEmbeddingBagCollection.from_embedding_bag_collection`` and :mod:`robe_torchrec.compress`
(checkpoints, the training app's ``embedding.init_from``) build on it, so the dependency
runs one way.

Example::

    >>> tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000,
    ...                              feature_names=["f0"])]
    >>> full = EmbeddingBagCollection(tables)                 # trained elsewhere
    >>> robe = RobeEmbeddingBagCollection([copy_table(t) for t in tables], RobeConfig(compression=10))
    >>> fit_into(robe, table_weights(full))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence

import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import (EmbeddingBagCollectionInterface,
                                                EmbeddingCollectionInterface)

from robe_torchrec.hashing import block_starts
from robe_torchrec.layout import RobeLayout

if TYPE_CHECKING:
    from robe_torchrec.array_module import RobeArrayModule

_ROWS_PER_CHUNK = 1 << 16


def table_weights(ebc: EmbeddingBagCollectionInterface) -> Dict[str, torch.Tensor]:
    """``{table name: weight [num_embeddings, dim]}`` of an unsharded TorchRec
    ``EmbeddingBagCollection`` (its ``embedding_bags.<name>.weight`` state)."""
    return _weights_by_table(ebc, ebc.embedding_bag_configs(), "embedding_bags",
                             "EmbeddingBagCollection (load a sharded one with "
                             "robe_torchrec.compress.load_embedding_bag_collection)")


def sequence_table_weights(ec: EmbeddingCollectionInterface) -> Dict[str, torch.Tensor]:
    """``{table name: weight [num_embeddings, dim]}`` of an unsharded TorchRec
    ``EmbeddingCollection`` (its ``embeddings.<name>.weight`` state)."""
    return _weights_by_table(ec, ec.embedding_configs(), "embeddings", "EmbeddingCollection")


def _weights_by_table(module: torch.nn.Module, tables: Sequence[Any], tables_key: str,
                      expected: str) -> Dict[str, torch.Tensor]:
    state = module.state_dict()
    out = {}
    for table in tables:
        key = f"{tables_key}.{table.name}.weight"
        if key not in state:
            raise TypeError(f"{type(module).__name__} has no {key}: pass an unsharded "
                            f"TorchRec {expected}")
        out[table.name] = state[key]
    return out


def least_squares_array(layout: RobeLayout, weights: Mapping[str, torch.Tensor],
                        id_counts: Optional[Mapping[str, torch.Tensor]] = None) -> torch.Tensor:
    """The flat ROBE weight (``layout.memory_size`` floats, float32) closest in
    ``id_counts``-weighted least squares to the tables ``weights`` (table name -> ``[rows,
    dim]``; see the module docstring). ``id_counts``: table name -> ``[rows]`` non-negative
    look-up counts, for every table; ``None``: every row weighs the same."""
    numerator = torch.zeros(layout.memory_size, dtype=torch.float64)
    denominator = torch.zeros(layout.memory_size, dtype=torch.float64)
    for table in layout.tables:
        weight = _checked_weight(weights, table)
        counts = _checked_counts(id_counts, table)
        # the first feature's placement: every feature of a table reads the same rows
        feature = layout.feature(table.feature_names[0])
        num_blocks = -(-table.embedding_dim // layout.block_size)
        column = torch.arange(table.embedding_dim)
        for first in range(0, table.num_embeddings, _ROWS_PER_CHUNK):
            rows = torch.arange(first, min(first + _ROWS_PER_CHUNK, table.num_embeddings))
            starts = block_starts(rows + table.row_offset, num_blocks, feature.array_size,
                                  layout.block_size, layout.hash_mode, list(layout.hash_params))
            slots = (feature.array_offset + starts[:, column // layout.block_size]
                     + column % layout.block_size)
            w = (torch.ones(rows.numel(), dtype=torch.float64) if counts is None
                 else counts[rows]).unsqueeze(1).expand_as(slots)
            numerator.index_add_(0, slots.reshape(-1),
                                 (w * weight[rows].to(torch.float64)).reshape(-1))
            denominator.index_add_(0, slots.reshape(-1), w.reshape(-1))
    fitted = torch.where(denominator > 0, numerator / denominator.clamp(min=1e-300),
                         torch.zeros_like(numerator))
    return fitted.to(torch.float32)


def _checked_weight(weights: Mapping[str, torch.Tensor], table) -> torch.Tensor:
    if table.name not in weights:
        raise ValueError(f"no trained weight for table {table.name!r} (got tables "
                         f"{sorted(weights)}): the full model must have the same tables")
    weight = weights[table.name].detach().cpu()
    if tuple(weight.shape) != (table.num_embeddings, table.embedding_dim):
        raise ValueError(f"table {table.name!r}: trained weight has shape {tuple(weight.shape)}, "
                         f"the ROBE tables expect ({table.num_embeddings}, "
                         f"{table.embedding_dim})")
    return weight


def _checked_counts(id_counts: Optional[Mapping[str, torch.Tensor]], table
                    ) -> Optional[torch.Tensor]:
    if id_counts is None:
        return None
    if table.name not in id_counts:
        raise ValueError(f"id_counts has no entry for table {table.name!r}: give counts for "
                         f"every table, or id_counts=None for uniform weights")
    counts = torch.as_tensor(id_counts[table.name]).detach().cpu().to(torch.float64)
    if counts.shape != (table.num_embeddings,):
        raise ValueError(f"id_counts[{table.name!r}] has shape {tuple(counts.shape)}, expected "
                         f"({table.num_embeddings},): one count per row")
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError(f"id_counts[{table.name!r}] must be finite and >= 0")
    return counts


def fit_into(robe_ebc: "RobeArrayModule", weights: Mapping[str, torch.Tensor],
             id_counts: Optional[Mapping[str, torch.Tensor]] = None) -> None:
    """Overwrite ``robe_ebc``'s (unsharded) array with the fit of the tables ``weights``."""
    fitted = least_squares_array(robe_ebc.layout, weights, id_counts)
    with torch.no_grad():
        robe_ebc.weight.copy_(fitted.to(robe_ebc.weight.dtype))


def copy_table(table: EmbeddingBagConfig) -> EmbeddingBagConfig:
    """A copy of ``table`` (the ROBE module fills in a table's ``feature_names`` in place:
    the trained module's configs stay as they were)."""
    return EmbeddingBagConfig(name=table.name, embedding_dim=table.embedding_dim,
                              num_embeddings=table.num_embeddings,
                              feature_names=list(table.feature_names), pooling=table.pooling,
                              data_type=table.data_type)


def copy_sequence_table(table: EmbeddingConfig) -> EmbeddingConfig:
    """:func:`copy_table` of an ``EmbeddingConfig`` (an ``EmbeddingCollection``'s table)."""
    return EmbeddingConfig(name=table.name, embedding_dim=table.embedding_dim,
                           num_embeddings=table.num_embeddings,
                           feature_names=list(table.feature_names), data_type=table.data_type)
