"""Compress trained embedding tables into a ROBE-Z array: the least-squares fit under the hash.

Every element ``(table t, row i, column j)`` of the tables is read from exactly one slot of
the ROBE array (:mod:`robe_torchrec.hashing`), so the array ``W`` that best reproduces the
trained tables ``E`` in weighted least squares,

    minimise  sum_{t,i,j}  c_{t,i} * (W[slot(t, i, j)] - E_t[i, j]) ** 2,

has a closed form: each slot holds the ``c``-weighted mean of the table entries that land on
it (the design matrix has one 1 per row, so the normal equations are diagonal). ``c_{t,i}``
is how often id ``i`` of table ``t`` is looked up (``id_counts``; uniform without it): the
frequent rows, whose embeddings matter most to the loss, win the collisions. A slot that no
entry with positive weight lands on is set to 0 (the minimum-norm solution).

Example::

    >>> tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000,
    ...                              feature_names=["f0"])]
    >>> full = EmbeddingBagCollection(tables)                 # trained elsewhere
    >>> robe = compress_embedding_bag_collection(full, RobeConfig(compression=10, block_size=4))
    >>> robe.memory_size
    800
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface

from robe_torchrec.config import RobeConfig
from robe_torchrec.hashing import block_starts
from robe_torchrec.layout import RobeLayout

#: where the training app's checkpoints keep the embedding tables (DLRMTrain's state dict,
#: under DCP's "model" entry; robe_torchrec.train.checkpoint)
APP_TABLES_PREFIX = "model.sparse_arch.embedding_bag_collection.embedding_bags."
_ROWS_PER_CHUNK = 1 << 16


def table_weights(ebc: EmbeddingBagCollectionInterface) -> Dict[str, torch.Tensor]:
    """``{table name: weight [num_embeddings, dim]}`` of an unsharded TorchRec
    ``EmbeddingBagCollection`` (its ``embedding_bags.<name>.weight`` state)."""
    state = ebc.state_dict()
    out = {}
    for table in ebc.embedding_bag_configs():
        key = f"embedding_bags.{table.name}.weight"
        if key not in state:
            raise TypeError(f"{type(ebc).__name__} has no {key}: pass an unsharded TorchRec "
                            f"EmbeddingBagCollection (load a sharded one with "
                            f"load_embedding_bag_collection)")
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


def compress_embedding_bag_collection(
    ebc: EmbeddingBagCollectionInterface, robe: RobeConfig,
    id_counts: Optional[Mapping[str, torch.Tensor]] = None,
):
    """A :class:`~robe_torchrec.RobeEmbeddingBagCollection` with ``ebc``'s tables whose
    array is the least-squares fit of ``ebc``'s trained weights (module docstring);
    ``RobeEmbeddingBagCollection.from_embedding_bag_collection`` calls this."""
    from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection

    tables = [_copy_table(t) for t in ebc.embedding_bag_configs()]
    robe_ebc = RobeEmbeddingBagCollection(tables, robe, is_weighted=ebc.is_weighted())
    fit_into(robe_ebc, table_weights(ebc), id_counts)
    return robe_ebc


def fit_into(robe_ebc, weights: Mapping[str, torch.Tensor],
             id_counts: Optional[Mapping[str, torch.Tensor]] = None) -> None:
    """Overwrite ``robe_ebc``'s (unsharded) array with the fit of the tables ``weights``."""
    fitted = least_squares_array(robe_ebc.layout, weights, id_counts)
    with torch.no_grad():
        robe_ebc.weight.copy_(fitted.to(robe_ebc.weight.dtype))


def _copy_table(table: EmbeddingBagConfig) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=table.name, embedding_dim=table.embedding_dim,
                              num_embeddings=table.num_embeddings,
                              feature_names=list(table.feature_names), pooling=table.pooling,
                              data_type=table.data_type)


def load_table_weights(path: "str | os.PathLike", tables: Sequence[EmbeddingBagConfig],
                       prefix: str = APP_TABLES_PREFIX, storage_reader=None
                       ) -> Dict[str, torch.Tensor]:
    """The full tables of a ``torch.distributed.checkpoint`` checkpoint (saved sharded by any
    number of ranks; the app's by default), read in this process alone: ``{table name:
    weight [rows, dim]}``. ``prefix``: where ``embedding_bags.<name>.weight`` of the trained
    ``EmbeddingBagCollection`` sits under the checkpoint's ``model`` entry.
    ``storage_reader``: DCP's reader of ``path`` (default ``FileSystemReader``, which
    unpickles the checkpoint's metadata: pass one that restricts it, as the training app
    does, for a checkpoint you did not write)."""
    reader = storage_reader or dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    state: Dict[str, torch.Tensor] = {}
    for table in tables:
        key = f"model.{prefix}{table.name}.weight"
        shape = (table.num_embeddings, table.embedding_dim)
        if key not in saved:
            robe = [k for k in saved if k.endswith(".weight") and "embedding_bag_collection" in k]
            raise ValueError(f"checkpoint {path} has no full table {table.name!r} (no {key}); "
                             f"init_from needs a checkpoint of a full-table model "
                             f"(embedding=full), found {robe[:3]}")
        if tuple(saved[key].size) != shape:
            raise ValueError(f"checkpoint {path}: table {table.name!r} has shape "
                             f"{tuple(saved[key].size)}, the model expects {shape} (the same "
                             f"data, cardinalities and embedding.dim)")
        state[key] = torch.empty(shape)
    dcp.load({"model": {k[len("model."):]: v for k, v in state.items()}},
             storage_reader=reader, no_dist=True)
    return {t.name: state[f"model.{prefix}{t.name}.weight"] for t in tables}


def fit_from_checkpoint(robe_ebc, path: "str | os.PathLike",
                        prefix: str = APP_TABLES_PREFIX, storage_reader=None) -> None:
    """Overwrite ``robe_ebc``'s array with the fit (uniform weights) of the full tables of the
    DCP checkpoint ``path`` (the training app's ``embedding.init_from``; ``storage_reader``:
    see :func:`load_table_weights`)."""
    fit_into(robe_ebc, load_table_weights(path, robe_ebc.embedding_bag_configs(), prefix,
                                          storage_reader))


def load_embedding_bag_collection(path: "str | os.PathLike", tables: List[EmbeddingBagConfig],
                                  prefix: str = APP_TABLES_PREFIX) -> EmbeddingBagCollection:
    """An unsharded TorchRec ``EmbeddingBagCollection`` of ``tables`` holding the trained
    tables of a (sharded) DCP checkpoint (see :func:`load_table_weights`)."""
    weights = load_table_weights(path, tables, prefix)
    ebc = EmbeddingBagCollection([_copy_table(t) for t in tables], device=torch.device("cpu"))
    ebc.load_state_dict({f"embedding_bags.{name}.weight": w for name, w in weights.items()})
    return ebc
