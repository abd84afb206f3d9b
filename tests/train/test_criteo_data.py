"""The app trains on real-Criteo-format files (TSV and npy) through the data config group."""

from __future__ import annotations

import pytest

from robe_torchrec.train.config import ConfigError
from robe_torchrec.train.trainer import train
from tests.data.fixtures import random_rows, write_tsv
from tests.train.helpers import compose, one_rank_group


@pytest.mark.slow
def test_train_on_criteo_tsv_and_npy(tmp_path):
    from robe_torchrec.data.criteo_npy import tsv_to_npy

    write_tsv(tmp_path / "day_0.tsv", random_rows(200, seed=0))
    write_tsv(tmp_path / "day_1.tsv", random_rows(100, seed=1))
    tsv_to_npy(tmp_path / "day_0.tsv", tmp_path / "day_0")
    tsv_to_npy(tmp_path / "day_1.tsv", tmp_path / "day_1")
    sizes = "data.num_embeddings_per_feature=1000"
    with one_rank_group():
        # 200 rows = 6 batches of 32: 10 steps repeat the file
        tsv = train(compose("data=criteo_tsv", f"data.train=[{tmp_path / 'day_0.tsv'}]",
                            f"data.val={tmp_path / 'day_1.tsv'}", sizes, "run.steps=10"),
                    tmp_path / "tsv")
        npy = train(compose("data=criteo_npy", f"data.train={tmp_path / 'day_0'}",
                            f"data.val={tmp_path / 'day_1'}", f"data.test={tmp_path / 'day_1'}",
                            sizes, "run.steps=4"), tmp_path / "npy")
    assert tsv["step"] == 10 and 0 <= tsv["val_auc"] <= 1 and "test_auc" not in tsv
    assert npy["step"] == 4 and "val_auc" in npy and "test_auc" in npy


def test_criteo_without_train_files_is_refused(tmp_path):
    with one_rank_group(), pytest.raises(ConfigError, match="data.train is required"):
        train(compose("data=criteo_tsv", "run.steps=1"), tmp_path)


class _CountingLoader:
    """A re-iterable loader of 5 batches (ints) that counts the batches it produces."""

    keys = ["cat_0"]

    def __init__(self) -> None:
        self.produced = 0

    def table_sizes(self):
        return [10]

    def __iter__(self):
        for i in range(5):
            self.produced += 1
            yield i


def test_file_source_continues_segments_and_rereads_only_on_resume():
    from robe_torchrec.train.data import FileSource

    loader = _CountingLoader()
    source = FileSource(make=None, splits={"train": ["x"]}, train_loader=loader)
    assert list(source.train_batches(0, 3)) == [0, 1, 2]
    assert list(source.train_batches(3, 4)) == [3, 4, 0, 1]  # the stream repeats the data
    assert loader.produced == 7  # nothing read twice
    # a resume at step 2: read from the start again, drop two batches
    assert list(source.train_batches(2, 2)) == [2, 3]
    assert loader.produced == 7 + 4


def _tsv_cfg(tmp_path, **splits):
    return compose("data=criteo_tsv", "data.num_embeddings_per_feature=1000",
                   *(f"data.{k}={v}" for k, v in splits.items()))


def test_inputs_are_checked_before_the_first_step(tmp_path):
    """A mistyped val/test path, an empty or short file fail while the source is built
    (before training), naming the file and the row count."""
    from robe_torchrec.train.data import build_data

    good = write_tsv(tmp_path / "good.tsv", random_rows(40))
    empty = write_tsv(tmp_path / "empty.tsv", [])
    short = write_tsv(tmp_path / "short.tsv", random_rows(20))
    build_data(_tsv_cfg(tmp_path, train=good, val=write_tsv(tmp_path / "val.tsv", random_rows(40, seed=1))), 0, 1)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope.tsv'} does not exist"):
        build_data(_tsv_cfg(tmp_path, train=good, test=tmp_path / "nope.tsv"), 0, 1)
    with pytest.raises(ConfigError, match=f"data.val: {empty}: 0 good row"):
        build_data(_tsv_cfg(tmp_path, train=good, val=empty), 0, 1)
    with pytest.raises(ConfigError, match=rf"data.train: {short}: 20 good row\(s\) for rank 0, "
                                          r"fewer than one batch per rank \(run.batch_size=32 "
                                          r"x 1 rank\(s\) needs 32 rows\)"):
        build_data(_tsv_cfg(tmp_path, train=short), 0, 1)
    with pytest.raises(ConfigError, match=rf"{good}: 20 good row\(s\) for rank 1"):
        build_data(_tsv_cfg(tmp_path, train=good), 1, 2)
