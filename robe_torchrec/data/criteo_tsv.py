"""Streaming loader for raw Criteo TSV files (Kaggle ``train.txt``, 1TB ``day_N``).

Each line is ``label \\t I1..I13 \\t C1..C26``: a 0/1 label, 13 integer features and 26
categorical features as hex strings; any feature may be empty (read as 0, as torchrec's
``BinaryCriteoUtils`` and DLRM do). Files are opened through torchrec's ``LoadFiles`` (iopath,
so remote paths work) or ``gzip`` for ``*.gz``.

TorchRec's own ``criteo_kaggle`` / ``CriteoIterDataPipe`` parse with ``csv`` and ``safe_cast``,
which turn a malformed value into 0 and a short row into a shifted one, silently; and they
do not know line numbers. This module parses each line itself so that a bad row either
raises an error naming the file and line, or is counted and skipped (``on_bad_row="skip"``).

Example::

    >>> data = CriteoTsv(["/data/criteo/train.txt"], batch_size=4096,
    ...                  num_embeddings_per_feature=1_000_000, rank=0, world_size=1)
    >>> for batch in data:  # torchrec Batch, keys cat_0..cat_25, like SyntheticCriteo
    ...     ...
    >>> data.rows_read, data.skipped_rows
"""

from __future__ import annotations

import gzip
import logging
import os
import zlib
from dataclasses import dataclass, field
from typing import IO, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.utils import Batch, LoadFiles

from robe_torchrec.data.criteo import (
    NUM_DENSE,
    NUM_SPARSE,
    NUM_TSV_FIELDS,
    NumEmbeddings,
    dlrm_dense_transform,
    SPARSE_KEYS,
    make_batch,
    resolve_num_embeddings,
    table_sizes,
)

logger = logging.getLogger(__name__)

OnBadRow = Literal["error", "skip"]
#: how many skipped-row messages are kept for inspection
MAX_SKIPPED_EXAMPLES = 10
_LABELS = {"0": 0.0, "1": 1.0}
_INT64_MAX = (1 << 63) - 1
# Criteo ids are 32-bit hashes printed as 8 hex digits; only used to spot a cut-off last line
_HEX_WIDTH = 8
_DENSE_END = 1 + NUM_DENSE


class CriteoRowError(ValueError):
    """A malformed TSV row; ``str(err)`` reads ``"<path> line <n>: <problem>"``."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        super().__init__(f"{path} line {line}: {problem}")
        self.path = path
        self.line = line
        self.problem = problem


class CriteoFileError(ValueError):
    """A Criteo file cannot be read (the message names it and says why)."""


@dataclass
class TsvReadStats:
    """Counts of one pass over the files (rows of this shard only)."""

    rows_read: int = 0
    skipped_rows: int = 0
    skipped_examples: List[str] = field(default_factory=list)

    def skip(self, message: str) -> None:
        self.skipped_rows += 1
        if len(self.skipped_examples) < MAX_SKIPPED_EXAMPLES:
            self.skipped_examples.append(message)


def _open_text(path: str) -> IO[str]:
    # newline="\n": a stray "\r" must not split a line, or line numbers would drift from
    # what `sed -n Np` shows; errors="replace": binary garbage becomes a bad-field error
    # with a line number instead of a UnicodeDecodeError without one.
    kw = dict(encoding="utf-8", errors="replace", newline="\n")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", **kw)  # type: ignore[return-value]
    _, handle = next(iter(LoadFiles([path], mode="r", **kw)))
    return handle


def _lines(f: IO[str], path: str) -> Iterator[str]:
    """The lines of ``f``; a read error (a cut-off or corrupt ``.gz``, an I/O error) is
    raised as :class:`CriteoFileError` naming the file and the last line read."""
    count = 0
    it = iter(f)
    while True:
        try:
            line = next(it)
        except StopIteration:
            return
        except (EOFError, OSError, zlib.error) as e:
            what = ("the compressed stream ends early: truncated .gz file?"
                    if isinstance(e, EOFError) else f"{type(e).__name__}: {e}")
            raise CriteoFileError(f"{path}: cannot read past line {count}: {what}") from e
        count += 1
        yield line


def _diagnose(fields: List[str], strict_width: bool) -> Optional[str]:
    """The first problem of a 40-field row, in words (``None`` if it parses)."""
    if fields[0] not in _LABELS:
        return f"field 1 (label): expected 0 or 1, got {fields[0][:40]!r}"
    for j in range(NUM_DENSE):
        v = fields[1 + j]
        try:
            x = int(v) if v else 0
        except ValueError:
            return f"field {2 + j} (int_{j}): expected an integer or empty, got {v[:40]!r}"
        if abs(x) > _INT64_MAX:
            return f"field {2 + j} (int_{j}): {v[:40]!r} does not fit in 64 bits"
    for j in range(NUM_SPARSE):
        v = fields[_DENSE_END + j]
        try:
            x = int(v, 16) if v else 0
        except ValueError:
            return f"field {_DENSE_END + 1 + j} (cat_{j}): expected a hex id or empty, got {v[:40]!r}"
        if x > _INT64_MAX or x < 0:
            return f"field {_DENSE_END + 1 + j} (cat_{j}): {v[:40]!r} is not a 63-bit hex id"
        if strict_width and v and len(v) != _HEX_WIDTH:
            return (
                f"last line has no newline and field {_DENSE_END + 1 + j} (cat_{j}) is {v!r}, "
                f"not {_HEX_WIDTH} hex digits: truncated file?"
            )
    return None


def iter_tsv_rows(
    paths: Sequence[str],
    chunk_rows: int,
    shard: int = 0,
    num_shards: int = 1,
    on_bad_row: OnBadRow = "error",
    stats: Optional[TsvReadStats] = None,
) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Parsed rows in chunks of ``chunk_rows`` (the last may be shorter).

    Lines are numbered across all files in order; this shard owns lines ``i`` with
    ``i % num_shards == shard`` and parses only those. Yields raw int64 dense ``[n, 13]``
    (not normalised), int64 ids ``[n, 26]`` (not folded) and float32 labels ``[n]``.
    """
    stats = stats if stats is not None else TsvReadStats()
    dense_rows: List[List[int]] = []
    id_rows: List[List[int]] = []
    labels: List[float] = []
    global_line = 0
    for path in paths:
        with _open_text(path) as f:
            for lineno, line in enumerate(_lines(f, path), 1):
                owned = global_line % num_shards == shard
                global_line += 1
                if not owned:
                    continue
                fields = line.rstrip("\r\n").split("\t")
                problem = None
                if len(fields) != NUM_TSV_FIELDS:
                    problem = f"expected {NUM_TSV_FIELDS} tab-separated fields, got {len(fields)}"
                else:
                    try:
                        label = _LABELS[fields[0]]
                        dense = [int(v) if v else 0 for v in fields[1:_DENSE_END]]
                        ids = [int(v, 16) if v else 0 for v in fields[_DENSE_END:]]
                        if max(ids) > _INT64_MAX or min(ids) < 0 or max(map(abs, dense)) > _INT64_MAX:
                            raise OverflowError
                    except (KeyError, ValueError, OverflowError):
                        # the fallback only guards against _diagnose and the fast path drifting apart
                        problem = _diagnose(fields, strict_width=False) or "could not parse the row"
                    if problem is None and not line.endswith("\n"):
                        problem = _diagnose(fields, strict_width=True)
                if problem is not None:
                    if on_bad_row == "error":
                        raise CriteoRowError(path, lineno, problem)
                    stats.skip(f"{path} line {lineno}: {problem}")
                    continue
                labels.append(label)
                dense_rows.append(dense)
                id_rows.append(ids)
                stats.rows_read += 1
                if len(labels) == chunk_rows:
                    yield _to_arrays(dense_rows, id_rows, labels)
                    dense_rows, id_rows, labels = [], [], []
    if labels:
        yield _to_arrays(dense_rows, id_rows, labels)


def _to_arrays(
    dense_rows: List[List[int]], id_rows: List[List[int]], labels: List[float]
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.array(dense_rows, dtype=np.int64),
        np.array(id_rows, dtype=np.int64),
        np.array(labels, dtype=np.float32),
    )


def _check_paths(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> List[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [os.fspath(p) for p in paths]
    if not out:
        raise ValueError("no Criteo files given")
    for p in out:
        # remote (iopath) URIs are checked when opened
        if "://" not in p and not os.path.isfile(p):
            raise FileNotFoundError(f"Criteo file {p} does not exist")
    return out


def _check_shard(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


class CriteoTsv(IterableDataset):
    """Batches of raw Criteo TSV rows, streamed (see module docstring).

    Args:
        paths: TSV files (plain or ``.gz``), read in order as one stream.
        batch_size: samples per batch.
        num_embeddings_per_feature: rows of each table: 26 ints, or one int for all tables;
            ids are taken modulo it. ``None`` keeps the raw 32-bit ids.
        rank, world_size: this rank reads every ``world_size``-th line, starting at line
            ``rank`` (counted over all files); shares differ by at most one row.
        on_bad_row: ``"error"`` raises :class:`CriteoRowError` (a ``ValueError`` naming file
            and line); ``"skip"`` drops the row, counts it in :attr:`skipped_rows`, keeps the
            first messages in :attr:`skipped_examples` and logs a warning after the pass.
        drop_last: drop the final, smaller batch.

    Dense features become ``log(1 + max(x, 0))`` (DLRM); labels are float32 0/1.

    The per-rank batch count is not known in advance, and can differ by one between ranks
    (``drop_last=False``, or skipped rows); a loop that runs collectives must stop when any
    rank runs out. Inside a ``DataLoader`` with workers, each worker reads its own share of
    the rank's lines, and the counters live in the workers.

    Example::

        >>> data = CriteoTsv("criteo_kaggle_head10k.tsv", batch_size=512,
        ...                  num_embeddings_per_feature=100_000, on_bad_row="skip")
        >>> batch = next(iter(data))
        >>> batch.dense_features.shape, batch.sparse_features.keys()[:2]
        (torch.Size([512, 13]), ['cat_0', 'cat_1'])
    """

    def __init__(
        self,
        paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
        batch_size: int,
        num_embeddings_per_feature: NumEmbeddings = None,
        rank: int = 0,
        world_size: int = 1,
        on_bad_row: OnBadRow = "error",
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.paths = _check_paths(paths)
        _check_shard(batch_size, rank, world_size)
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f'on_bad_row must be "error" or "skip", got {on_bad_row!r}')
        self.batch_size = batch_size
        self.num_embeddings = resolve_num_embeddings(num_embeddings_per_feature)
        self.rank = rank
        self.world_size = world_size
        self.on_bad_row: OnBadRow = on_bad_row
        self.drop_last = drop_last
        self.keys: List[str] = list(SPARSE_KEYS)
        self.stats = TsvReadStats()

    def table_sizes(self) -> List[int]:
        """Rows of each of the 26 tables (raises if ``num_embeddings_per_feature`` is None)."""
        return table_sizes(self.num_embeddings)

    @property
    def rows_read(self) -> int:
        """Good rows of this shard parsed so far in the current (or last) pass."""
        return self.stats.rows_read

    @property
    def skipped_rows(self) -> int:
        """Bad rows skipped so far in the current (or last) pass (``on_bad_row="skip"``)."""
        return self.stats.skipped_rows

    @property
    def skipped_examples(self) -> List[str]:
        """The first few skipped rows' messages, ``"<path> line <n>: <problem>"``."""
        return self.stats.skipped_examples

    def __iter__(self) -> Iterator[Batch]:
        shard, num_shards = self.rank, self.world_size
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            shard = self.rank * worker.num_workers + worker.id
            num_shards = self.world_size * worker.num_workers
        self.stats = TsvReadStats()
        for dense, ids, labels in iter_tsv_rows(
            self.paths, self.batch_size, shard, num_shards, self.on_bad_row, self.stats
        ):
            if self.drop_last and len(labels) < self.batch_size:
                break
            yield make_batch(dlrm_dense_transform(dense), ids, labels, self.num_embeddings)
        if self.stats.skipped_rows:
            logger.warning(
                "CriteoTsv skipped %d malformed rows (rank %d), first: %s",
                self.stats.skipped_rows,
                self.rank,
                self.stats.skipped_examples[0],
            )
