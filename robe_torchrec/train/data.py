"""Batch sources of the ``data`` config group, sharded by rank.

A source gives the feature keys and table sizes the model is built from, and iterators of
torchrec ``Batch`` for training (from a position, so a resumed run reads exactly the batches
an uninterrupted one would have) and for validation and test.

Example::

    >>> source = build_data(cfg, rank=0, world_size=2)
    >>> batch = next(source.train_batches(start=10, count=1))   # this rank's batch of step 10
"""

from __future__ import annotations

import collections
import itertools
import os
from typing import Iterator, List, Optional, Protocol

from omegaconf import DictConfig
from torchrec.datasets.utils import Batch

from robe_torchrec.data.synthetic import SyntheticCriteo
from robe_torchrec.train.config import ConfigError

# Synthetic splits: each is its own range of stream batch indices, and a rank's share of a
# split is ``start + step * world_size + rank`` (the offset outside the product), so the
# ranges stay apart for every world size: training reads [0, 1e9), validation [1e9, 2e9),
# test [2e9, ...).
VAL_STREAM_START, TEST_STREAM_START = 10**9, 2 * 10**9
_SPLIT_RANGES = {"train": (0, VAL_STREAM_START), "val": (VAL_STREAM_START, TEST_STREAM_START),
                 "test": (TEST_STREAM_START, None)}


class DataSource(Protocol):
    keys: List[str]
    cardinalities: List[int]

    def train_batches(self, start: int, count: int) -> Iterator[Batch]:
        """This rank's batches of training steps ``start .. start + count - 1``."""

    def eval_batches(self, split: str, count: int) -> Optional[Iterator[Batch]]:
        """This rank's first ``count`` batches of ``split`` ("val" or "test"); None when
        the source has no such split."""


class SyntheticSource:
    """:class:`~robe_torchrec.data.synthetic.SyntheticCriteo`: rank ``r`` of ``W`` reads
    stream batch ``split start + step * W + r``, so every rank generates only its own share,
    and training, validation and test read disjoint index ranges whatever ``W`` is.

    ``cfg.cycle = N > 0`` generates this rank's first N training batches once and repeats
    them: for throughput measurements, where generating batches would cost more than the
    step being measured."""

    def __init__(self, cfg: DictConfig, batch_size: int, rank: int, world_size: int) -> None:
        self._data = SyntheticCriteo(batch_size=batch_size, cardinality_scale=cfg.cardinality_scale,
                                     seed=cfg.seed, num_sparse=cfg.num_sparse,
                                     mode=cfg.mode)
        self.keys, self.cardinalities = self._data.keys, self._data.cardinalities
        self._rank, self._world = rank, world_size
        self._cycle = [self._data.batch(i * world_size + rank)
                       for i in range(cfg.cycle)]

    def _stream(self, split: str, first: int, count: int) -> Iterator[Batch]:
        low, high = _SPLIT_RANGES[split]
        if high is not None and low + (first + count) * self._world > high:
            raise ConfigError(f"{split}: {first + count} steps x {self._world} rank(s) of "
                              f"synthetic batches run past the split's {high - low} batches "
                              f"(its indices would reach the next split's); use fewer steps")
        return (self._data.batch(low + i * self._world + self._rank)
                for i in range(first, first + count))

    def train_batches(self, start: int, count: int) -> Iterator[Batch]:
        if self._cycle:
            return (self._cycle[i % len(self._cycle)] for i in range(start, start + count))
        return self._stream("train", start, count)

    def eval_batches(self, split: str, count: int) -> Iterator[Batch]:
        return self._stream("val" if split == "val" else "test", 0, count)


class FileSource:
    """Criteo files (TSV or npy) for one rank: ``make(split)`` builds the split's loader.

    Training steps are counted, not epochs: the training stream repeats the data set, so
    every rank runs the same number of steps even where its share of an epoch is a batch
    shorter (which would leave the other ranks waiting in a collective). Validation and test
    read ``count`` batches per rank, repeating a split smaller than that. Consecutive training
    segments continue one stream; only a resumed run re-reads and drops the batches it
    already trained on, so it sees the same stream."""

    def __init__(self, make, splits, train_loader) -> None:
        self._make, self._splits = make, splits
        self._train_loader = train_loader
        self.keys, self.cardinalities = list(train_loader.keys), list(train_loader.table_sizes())
        self._train: Optional[Iterator[Batch]] = None
        self._train_position = 0  # batches of self._train handed out so far

    @staticmethod
    def _repeat(split: str, loader) -> Iterator[Batch]:
        while True:
            empty = True
            for batch in loader:
                empty = False
                yield batch
            if empty:
                raise _no_batch(split, loader)

    def check_inputs(self) -> None:
        """Read the first batch of every split that is set, so a missing, empty, short or
        malformed file fails before the first training step (not after the last)."""
        for split in ("train", "val", "test"):
            if self._splits.get(split):
                loader = self._train_loader if split == "train" else self._make(split)
                if next(iter(loader), None) is None:
                    raise _no_batch(split, loader)

    def train_batches(self, start: int, count: int) -> Iterator[Batch]:
        if self._train is None or start != self._train_position:
            # the first segment, or a resume: read from the beginning up to ``start``
            self._train = self._repeat("train", self._train_loader)
            collections.deque(itertools.islice(self._train, start), maxlen=0)
            self._train_position = start
        return self._segment(count)

    def _segment(self, count: int) -> Iterator[Batch]:
        for batch in itertools.islice(self._train, count):
            self._train_position += 1
            yield batch

    def eval_batches(self, split: str, count: int) -> Optional[Iterator[Batch]]:
        if not self._splits.get(split):
            return None
        return itertools.islice(self._repeat(split, self._make(split)), count)


def _no_batch(split: str, loader) -> ConfigError:
    """A split too small for one batch on this rank, with its files and row count."""
    files = ", ".join(getattr(loader, "paths", None) or getattr(loader, "prefixes", []))
    rows = getattr(loader, "rows", None)  # npy: known up front, all ranks together
    count = f"{rows} row(s)" if rows is not None else \
        f"{loader.rows_read} good row(s) for rank {loader.rank}"
    need = loader.batch_size * loader.world_size
    return ConfigError(f"data.{split}: {files}: {count}, fewer than one batch per rank "
                       f"(run.batch_size={loader.batch_size} x {loader.world_size} rank(s) "
                       f"needs {need} rows)")


def _paths(value) -> List[str]:
    """The paths of a split that is set (the schema requires ``data.train``)."""
    return [str(p) for p in ([value] if isinstance(value, str) else value)]


def _no_directories(paths: List[str], key: str, kind: str) -> None:
    """Name a directory given where a data file belongs (its readers would call it
    missing)."""
    for p in paths:
        if "://" in p:
            continue
        if kind == "criteo_npy":
            from robe_torchrec.data.criteo_npy import npy_paths

            files = npy_paths(p)
        else:
            files = (p,)
        for f in files:
            if os.path.isdir(f):
                raise ConfigError(f"{key}: {f} is a directory, not a data file; give the "
                                  f"files in it (" + ("a prefix: <prefix>_dense.npy, ..."
                                                      if kind == "criteo_npy" else
                                                      f"{key}=[{f}/day_0,...]") + ")")


def _disjoint_splits(splits, npy: bool, split_eval_prefix: bool) -> None:
    """Refuse a file (or npy prefix) named by two splits: training, validation and test must
    not share rows. The one exception is npy's ``split_eval_prefix`` (the default), under
    which ``data.val`` and ``data.test`` may name one prefix: validation reads its first half
    and test its second."""
    halves = npy and split_eval_prefix
    seen = {}
    for split in ("train", "val", "test"):
        if not splits.get(split):
            continue
        for p in _paths(splits[split]):
            key = p if "://" in p else os.path.realpath(p)
            other = seen.get(key)
            if other is not None and other != split and not (halves and {other, split} == {"val", "test"}):
                raise ConfigError(f"data.{other} and data.{split} both name {p}: the splits "
                                  f"would share rows; give each split its own files" +
                                  (" (data.val and data.test may share one npy prefix with "
                                   "data.split_eval_prefix=true)" if npy else ""))
            seen.setdefault(key, split)


def _criteo(cfg: DictConfig, rank: int, world_size: int) -> FileSource:
    # the schema (robe_torchrec.train.schema.CriteoDataConfig) requires train and the sizes
    d, batch = cfg.data, cfg.run.batch_size
    npy = d.name == "criteo_npy"
    sizes = d.num_embeddings_per_feature
    sizes = int(sizes) if isinstance(sizes, int) else [int(n) for n in sizes]
    splits = {"train": _paths(d.train), "val": d.val, "test": d.test}
    for split, value in splits.items():
        if value:
            _no_directories(_paths(value), f"data.{split}", d.name)
    _disjoint_splits(splits, npy, npy and d.split_eval_prefix)
    if d.name == "criteo_tsv":
        from robe_torchrec.data.criteo_tsv import CriteoTsv

        def make(split: str):
            return CriteoTsv(_paths(splits[split]), batch, sizes, rank,
                             world_size, on_bad_row=d.on_bad_row, drop_last=True)
    else:
        from robe_torchrec.data.criteo_npy import CriteoNpy

        def make(split: str):
            prefixes = _paths(splits[split])
            # a val/test prefix is halved by CriteoNpy (torchrec's split of the last day)
            stage = split if split != "train" and d.split_eval_prefix else "train"
            return CriteoNpy(prefixes, batch, sizes, rank, world_size, drop_last=True,
                             stage=stage, mmap_mode=d.mmap_mode,
                             check_values=d.check_values)
    source = FileSource(make, splits, make("train"))
    source.check_inputs()
    return source


def build_data(cfg: DictConfig, rank: int, world_size: int) -> DataSource:
    """The ``data`` config group's source for this rank."""
    if cfg.data.name == "synthetic":
        return SyntheticSource(cfg.data, cfg.run.batch_size, rank, world_size)
    return _criteo(cfg, rank, world_size)
