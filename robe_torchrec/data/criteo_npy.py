"""Criteo in TorchRec's binary layout: ``<prefix>_dense.npy``, ``_sparse.npy``, ``_labels.npy``.

The layout is the one ``torchrec/datasets/scripts/npy_preproc_criteo.py``
(``BinaryCriteoUtils.tsv_to_npys``) writes: dense float32 ``[N, 13]`` *already normalised*,
sparse integer ids ``[N, 26]``, labels int32 ``[N, 1]``. :class:`CriteoNpy` checks the three
files of every prefix against that layout (clear errors instead of a shape error deep in
an iterator) and then reads them with torchrec's ``InMemoryBinaryCriteoIterDataPipe``, which
splits batches evenly over ranks. :func:`tsv_to_npy` writes the layout from a raw TSV.

Example::

    >>> tsv_to_npy("train.txt", "/data/criteo_npy/train")      # once
    >>> data = CriteoNpy(["/data/criteo_npy/train"], batch_size=4096,
    ...                  num_embeddings_per_feature=1_000_000, rank=0, world_size=1)
    >>> batch = next(iter(data))  # torchrec Batch, keys cat_0..cat_25, like CriteoTsv's
"""

from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass
from typing import BinaryIO, Iterator, List, Literal, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec.data.criteo import (
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_KEYS,
    NumEmbeddings,
    dlrm_dense_transform,
    resolve_num_embeddings,
    table_sizes,
)
from robe_torchrec.data.criteo_tsv import OnBadRow, TsvReadStats, _check_paths, _check_shard, iter_tsv_rows

PathLike = Union[str, os.PathLike]
_PARTS = ("dense", "sparse", "labels")


def npy_paths(prefix: PathLike) -> Tuple[str, str, str]:
    """``(dense, sparse, labels)`` file names of a prefix, as torchrec's script names them."""
    p = os.fspath(prefix)
    return tuple(f"{p}_{part}.npy" for part in _PARTS)  # type: ignore[return-value]


def _open_npy(path: str, prefix: str) -> np.ndarray:
    if not os.path.isfile(path):
        names = ", ".join(os.path.basename(p) for p in npy_paths(prefix))
        raise FileNotFoundError(f"{path} does not exist (prefix {prefix!r} means the files {names})")
    try:
        # mmap: only the header is read here, however large the file
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npy array (truncated or not npy?): {e}") from e


def check_npy_values(dense_path: str, labels_path: str, dense: np.ndarray, labels: np.ndarray,
                     chunk_rows: int = 1 << 20) -> None:
    """Raise ``ValueError`` naming file and row (0-based) for the first non-finite dense
    value or label other than 0 / 1 (read in chunks: the arrays may be memory maps)."""
    for start in range(0, len(dense), chunk_rows):
        d = np.asarray(dense[start:start + chunk_rows])
        bad = ~np.isfinite(d).all(axis=1)
        if bad.any():
            row = start + int(np.argmax(bad))
            raise ValueError(f"{dense_path} row {row}: dense values must be finite, got "
                             f"{np.asarray(dense[row]).tolist()}")
        lab = np.asarray(labels[start:start + chunk_rows]).reshape(-1)
        bad = (lab != 0) & (lab != 1)
        if bad.any():
            row = start + int(np.argmax(bad))
            raise ValueError(f"{labels_path} row {row}: labels must be 0 or 1, got "
                             f"{lab[row - start].item()!r}")


def check_npy_prefix(prefix: PathLike, check_values: bool = False) -> int:
    """Checks one prefix's three files against torchrec's layout; returns the row count.

    Raises ``ValueError`` naming the file for a wrong shape or dtype, unreadable file or
    differing row counts, ``FileNotFoundError`` for a missing file. ``check_values``: also
    read every dense value and label (:func:`check_npy_values`).
    """
    prefix = os.fspath(prefix)
    dense_path, sparse_path, labels_path = npy_paths(prefix)
    dense, sparse, labels = (_open_npy(p, prefix) for p in (dense_path, sparse_path, labels_path))
    for path, arr, cols, kinds, what in (
        (dense_path, dense, NUM_DENSE, "f", "floating (normalised dense features)"),
        (sparse_path, sparse, NUM_SPARSE, "iu", "integer (categorical ids)"),
        (labels_path, labels, 1, "iuf", "integer or floating (0/1 labels)"),
    ):
        if arr.ndim != 2 or arr.shape[1] != cols:
            raise ValueError(f"{path}: expected shape (N, {cols}), got {tuple(arr.shape)}")
        if arr.dtype.kind not in kinds:
            raise ValueError(f"{path}: expected a {what} dtype, got {arr.dtype}")
    rows = {len(dense), len(sparse), len(labels)}
    if len(rows) != 1:
        raise ValueError(
            f"{prefix}: row counts differ: {os.path.basename(dense_path)} {len(dense)}, "
            f"{os.path.basename(sparse_path)} {len(sparse)}, {os.path.basename(labels_path)} {len(labels)}"
        )
    if len(dense) == 0:
        raise ValueError(f"{prefix}: the npy files have no rows")
    if check_values:
        check_npy_values(dense_path, labels_path, dense, labels)
    return len(dense)


class CriteoNpy(IterableDataset):
    """Batches of Criteo in TorchRec's npy layout, through ``InMemoryBinaryCriteoIterDataPipe``.

    Args:
        prefixes: one prefix per file triple: ``"/d/day_0"`` reads ``/d/day_0_dense.npy``,
            ``/d/day_0_sparse.npy``, ``/d/day_0_labels.npy``. Read in order as one stream.
        batch_size: samples per batch.
        num_embeddings_per_feature: rows of each table: 26 ints, or one int for all tables;
            ids are taken modulo it. ``None`` keeps the stored ids.
        rank, world_size: global batches go round-robin to ranks; every rank gets the same
            number of batches (torchrec splits the last rows evenly; when fewer than
            ``world_size`` rows are left over, some ranks' last batch has ``batch_size + 1``).
        drop_last: drop the rows that do not fill a batch on every rank.
        stage: ``"train"`` reads everything; ``"val"`` / ``"test"`` read the first / second
            half of a single prefix (torchrec's split of the 1TB set's day 23).
        mmap_mode: map the files instead of loading them (each rank then touches only its
            own batches; without it each rank loads all files into memory).
        check_values: read every dense value and label once at construction and refuse a
            non-finite value or a label other than 0 / 1, naming file and row (costs one
            pass over the dense and label files).

    Dense features are used as stored: files from :func:`tsv_to_npy` hold DLRM's
    ``log(1 + max(x, 0))``; torchrec's script writes ``log(x - min + 2)`` (``min`` over the
    file's dense values). Ids become int64 and labels float32, as in :class:`CriteoTsv`.

    Example::

        >>> data = CriteoNpy(["/data/criteo_npy/day_0", "/data/criteo_npy/day_1"],
        ...                  batch_size=8192, num_embeddings_per_feature=[40_000_000] * 26,
        ...                  rank=rank, world_size=world_size, mmap_mode=True)
        >>> len(data)  # batches of this rank
    """

    def __init__(
        self,
        prefixes: Union[PathLike, Sequence[PathLike]],
        batch_size: int,
        num_embeddings_per_feature: NumEmbeddings = None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        stage: Literal["train", "val", "test"] = "train",
        mmap_mode: bool = False,
        check_values: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(prefixes, (str, os.PathLike)):
            prefixes = [prefixes]
        self.prefixes = [os.fspath(p) for p in prefixes]
        if not self.prefixes:
            raise ValueError("no Criteo npy prefixes given")
        _check_shard(batch_size, rank, world_size)
        if stage not in ("train", "val", "test"):
            raise ValueError(f'stage must be "train", "val" or "test", got {stage!r}')
        self.rows_per_prefix = [check_npy_prefix(p, check_values) for p in self.prefixes]
        if stage != "train" and len(self.prefixes) != 1:
            # torchrec halves only the first file and would read the others whole
            raise ValueError(f'stage="{stage}" reads half of one prefix; got {len(self.prefixes)} prefixes')
        first_half = (self.rows_per_prefix[0] + 1) // 2
        rows = {"train": sum(self.rows_per_prefix), "val": first_half}.get(
            stage, self.rows_per_prefix[0] - first_half
        )
        if rows < world_size:
            # torchrec would give every rank nothing, silently
            raise ValueError(f"{rows} rows (stage {stage!r}) for {world_size} ranks: each rank needs a row")
        num_embeddings = resolve_num_embeddings(num_embeddings_per_feature)
        paths = [npy_paths(p) for p in self.prefixes]
        # torchrec's constructor re-seeds numpy's global generator; keep the caller's stream
        rng_state = np.random.get_state()
        try:
            self._pipe = InMemoryBinaryCriteoIterDataPipe(
                stage=stage,
                dense_paths=[p[0] for p in paths],
                sparse_paths=[p[1] for p in paths],
                labels_paths=[p[2] for p in paths],
                batch_size=batch_size,
                rank=rank,
                world_size=world_size,
                drop_last=drop_last,
                mmap_mode=mmap_mode,
                hashes=None if num_embeddings is None else num_embeddings.reshape(-1).tolist(),
            )
        finally:
            np.random.set_state(rng_state)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.rows = rows  # of this stage, all ranks together
        self.num_embeddings = num_embeddings
        self.keys: List[str] = list(SPARSE_KEYS)

    def table_sizes(self) -> List[int]:
        """Rows of each of the 26 tables (raises if ``num_embeddings_per_feature`` is None)."""
        return table_sizes(self.num_embeddings)

    def __len__(self) -> int:
        """Batches this rank yields (the same on every rank)."""
        return len(self._pipe)

    def __iter__(self) -> Iterator[Batch]:
        batches = iter(self._pipe)
        while True:
            with warnings.catch_warnings():
                # with mmap_mode torchrec wraps read-only maps; the tensors are copied below
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                batch = next(batches, None)
            if batch is None:
                return
            kjt = batch.sparse_features
            yield Batch(
                dense_features=_owned(batch.dense_features, torch.float32),
                sparse_features=KeyedJaggedTensor(
                    keys=SPARSE_KEYS, values=_owned(kjt.values(), torch.int64), lengths=kjt.lengths()
                ),
                labels=_owned(batch.labels, torch.float32),
            )


def _owned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # torchrec's batches can be views of the loaded (or mapped) arrays: an in-place op in a
    # training step would then change the data set for the next epoch
    out = t.to(dtype)
    return out.clone() if out.data_ptr() == t.data_ptr() else out


@dataclass
class TsvToNpyResult:
    """What :func:`tsv_to_npy` wrote."""

    rows: int
    skipped_rows: int
    skipped_examples: List[str]
    dense_path: str
    sparse_path: str
    labels_path: str


# A fixed-size npy header, so it can be rewritten with the final row count once the rows
# are streamed out (the format allows padding the header dict with spaces).
_HEADER_BYTES = 128


def _npy_header(dtype: np.dtype, shape: Tuple[int, int]) -> bytes:
    body = repr(
        {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    ).encode("latin1")
    magic = np.lib.format.magic(1, 0)
    pad = _HEADER_BYTES - len(magic) - 2 - len(body) - 1
    return magic + struct.pack("<H", _HEADER_BYTES - len(magic) - 2) + body + b" " * pad + b"\n"


class _NpyStream:
    """Appends row chunks to a 2-D .npy file without holding it in memory."""

    def __init__(self, path: str, dtype: type, cols: int) -> None:
        self.path, self.dtype, self.cols, self.rows = path, np.dtype(dtype), cols, 0
        self.f: BinaryIO = open(path, "wb")
        self.f.write(_npy_header(self.dtype, (0, cols)))

    def append(self, chunk: np.ndarray) -> None:
        np.ascontiguousarray(chunk.reshape(-1, self.cols), dtype=self.dtype).tofile(self.f)
        self.rows += len(chunk)

    def close(self) -> None:
        self.f.seek(0)
        self.f.write(_npy_header(self.dtype, (self.rows, self.cols)))
        self.f.close()


def tsv_to_npy(
    tsv_paths: Union[PathLike, Sequence[PathLike]],
    out_prefix: PathLike,
    on_bad_row: OnBadRow = "error",
    chunk_rows: int = 1 << 16,
) -> TsvToNpyResult:
    """Converts raw Criteo TSV file(s) to one npy triple in torchrec's layout.

    Writes ``<out_prefix>_dense.npy`` (float32 ``[N, 13]``, DLRM's ``log(1 + max(x, 0))``),
    ``_sparse.npy`` (int64 ``[N, 26]`` raw ids, not folded, as torchrec's script) and
    ``_labels.npy`` (int32 ``[N, 1]``). Rows stream through in chunks, so memory stays flat;
    bad rows raise or are skipped as in :class:`~robe_torchrec.data.criteo_tsv.CriteoTsv`.
    On error no output files are left behind.

    ``BinaryCriteoUtils.tsv_to_npys`` is not used: it holds a whole file in Python lists,
    reads bad values as 0 without a word, and its dense transform depends on each file's
    minimum, so train and test files would be normalised differently.

    Example::

        >>> result = tsv_to_npy("day_0", "/data/criteo_npy/day_0", on_bad_row="skip")
        >>> result.rows, result.skipped_rows
    """
    paths = _check_paths(tsv_paths)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f'on_bad_row must be "error" or "skip", got {on_bad_row!r}')
    final = npy_paths(out_prefix)
    partial = [p + ".partial" for p in final]
    streams: List[_NpyStream] = []
    stats = TsvReadStats()
    try:
        streams = [
            _NpyStream(partial[0], np.float32, NUM_DENSE),
            _NpyStream(partial[1], np.int64, NUM_SPARSE),
            _NpyStream(partial[2], np.int32, 1),
        ]
        for dense, ids, labels in iter_tsv_rows(paths, chunk_rows, on_bad_row=on_bad_row, stats=stats):
            streams[0].append(dlrm_dense_transform(dense))
            streams[1].append(ids)
            streams[2].append(labels)
        for s in streams:
            s.close()
        for src, dst in zip(partial, final):
            os.replace(src, dst)
    except BaseException:
        for s in streams:
            s.f.close()
        for p in partial:
            if os.path.exists(p):
                os.remove(p)
        raise
    return TsvToNpyResult(stats.rows_read, stats.skipped_rows, stats.skipped_examples, *final)
