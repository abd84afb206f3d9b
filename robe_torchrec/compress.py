"""Compress trained embedding tables into a ROBE-Z array: from a trained TorchRec
``EmbeddingBagCollection`` or from the full tables of a (sharded) DCP checkpoint.

The fit itself, the least-squares array under the hash, is :mod:`robe_torchrec.least_squares`
(its functions are re-exported here); this module adds the checkpoint readers the training
app's ``embedding.init_from`` uses. It builds on the module (never the other way round):
``RobeEmbeddingBagCollection.from_embedding_bag_collection`` is the fit of a trained module,
:func:`compress_embedding_bag_collection` another name for it.

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
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface

from robe_torchrec.config import RobeConfig
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.least_squares import copy_table, fit_into, least_squares_array, table_weights
from robe_torchrec.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

__all__ = ["APP_TABLES_PREFIX", "compress_embedding_bag_collection", "fit_from_checkpoint",
           "fit_into", "least_squares_array", "load_embedding_bag_collection",
           "load_table_weights", "table_weights"]

#: where the training app's checkpoints keep the embedding tables (DLRMTrain's state dict,
#: under DCP's "model" entry; robe_torchrec.train.checkpoint)
APP_TABLES_PREFIX = "model.sparse_arch.embedding_bag_collection.embedding_bags."


def compress_embedding_bag_collection(
    ebc: EmbeddingBagCollectionInterface, robe: RobeConfig,
    id_counts: Optional[Mapping[str, torch.Tensor]] = None,
) -> RobeEmbeddingBagCollection:
    """A :class:`~robe_torchrec.RobeEmbeddingBagCollection` with ``ebc``'s tables whose
    array is the least-squares fit of ``ebc``'s trained weights: the same as
    ``RobeEmbeddingBagCollection.from_embedding_bag_collection``."""
    return RobeEmbeddingBagCollection.from_embedding_bag_collection(ebc, robe, id_counts)


def load_table_weights(path: "str | os.PathLike", tables: Sequence[EmbeddingBagConfig],
                       prefix: str = APP_TABLES_PREFIX, storage_reader=None
                       ) -> Dict[str, torch.Tensor]:
    """The full tables of a ``torch.distributed.checkpoint`` checkpoint (saved sharded by any
    number of ranks; the app's by default), read in this process alone: ``{table name:
    weight [rows, dim]}``. ``prefix``: where ``embedding_bags.<name>.weight`` of the trained
    ``EmbeddingBagCollection`` sits under the checkpoint's ``model`` entry.
    ``storage_reader``: DCP's reader of ``path`` (default
    :class:`~robe_torchrec.safe_dcp.SafeFileSystemReader`, which reads a checkpoint you did
    not write without running code from it; every table must be a tensor entry, and
    nothing else is read)."""
    reader = storage_reader or SafeFileSystemReader(str(path))
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
        if not isinstance(saved[key], TensorStorageMetadata):
            raise ValueError(f"checkpoint {path}: table {table.name!r} ({key}) is not a "
                             f"tensor entry but {type(saved[key]).__name__}")
        if tuple(saved[key].size) != shape:
            raise ValueError(f"checkpoint {path}: table {table.name!r} has shape "
                             f"{tuple(saved[key].size)}, the model expects {shape} (the same "
                             f"data, cardinalities and embedding.dim)")
        state[key] = torch.empty(shape)
    dcp.load({"model": {k[len("model."):]: v for k, v in state.items()}},
             storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return {t.name: state[f"model.{prefix}{t.name}.weight"] for t in tables}


def fit_from_checkpoint(robe_ebc: RobeEmbeddingBagCollection, path: "str | os.PathLike",
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
    ebc = EmbeddingBagCollection([copy_table(t) for t in tables], device=torch.device("cpu"))
    ebc.load_state_dict({f"embedding_bags.{name}.weight": w for name, w in weights.items()})
    return ebc
