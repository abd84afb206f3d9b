"""tsv_to_npy and CriteoNpy: the written files, agreement with CriteoTsv, rank shares, layout errors."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils

from robe_torchrec.data import CriteoNpy, CriteoRowError, CriteoTsv, check_npy_prefix, npy_paths, tsv_to_npy
from tests.data.fixtures import random_rows, write_tsv

TABLE_ROWS = [50 + 7 * j for j in range(26)]


def _row_numbers(batches):
    # dense column 0 of the fixtures is log1p(row number)
    return [round(math.expm1(v)) for b in batches for v in b.dense_features[:, 0].tolist()]


def _assert_same_batches(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g.dense_features, w.dense_features)
        assert torch.equal(g.labels, w.labels)
        assert g.sparse_features.keys() == w.sparse_features.keys()
        assert torch.equal(g.sparse_features.values(), w.sparse_features.values())
        assert torch.equal(g.sparse_features.lengths(), w.sparse_features.lengths())


def test_converted_files_hold_the_tsv_rows(tmp_path):
    rows = random_rows(7, seed=3)
    tsv = write_tsv(tmp_path / "day.tsv", rows)
    result = tsv_to_npy(tsv, tmp_path / "day")
    assert (result.rows, result.skipped_rows) == (7, 0)
    dense, sparse, labels = (np.load(p) for p in npy_paths(tmp_path / "day"))
    assert (dense.dtype, dense.shape) == (np.float32, (7, 13))
    assert (sparse.dtype, sparse.shape) == (np.int64, (7, 26))
    assert (labels.dtype, labels.shape) == (np.int32, (7, 1))
    want_dense = [[math.log1p(max(int(v or 0), 0)) for v in r[1:14]] for r in rows]
    np.testing.assert_allclose(dense, np.array(want_dense), rtol=0, atol=1e-6)
    assert sparse.tolist() == [[int(v or "0", 16) for v in r[14:]] for r in rows]
    assert labels[:, 0].tolist() == [int(r[0]) for r in rows]
    # torchrec reads the header with read_array_header_1_0; the rewritten header must pass
    assert BinaryCriteoUtils.get_shape_from_npy(result.sparse_path) == (7, 26)


@pytest.mark.parametrize("mmap_mode", [False, True])
def test_npy_batches_equal_tsv_batches(tmp_path, mmap_mode):
    rows = random_rows(23, seed=4)
    tsv = [write_tsv(tmp_path / "a.tsv", rows[:15]), write_tsv(tmp_path / "b.tsv", rows[15:])]
    tsv_to_npy(tsv, tmp_path / "all")
    want = list(CriteoTsv(tsv, batch_size=5, num_embeddings_per_feature=TABLE_ROWS))
    data = CriteoNpy(tmp_path / "all", batch_size=5, num_embeddings_per_feature=TABLE_ROWS, mmap_mode=mmap_mode)
    got = list(data)
    _assert_same_batches(got, want)
    assert len(data) == 5
    assert data.table_sizes() == TABLE_ROWS
    got[0].dense_features.add_(1)  # tensors are the caller's to modify, never the file's
    assert torch.equal(next(iter(data)).dense_features, want[0].dense_features)


def test_two_prefixes_read_as_one_stream(tmp_path):
    rows = random_rows(9)
    tsv_to_npy(write_tsv(tmp_path / "a.tsv", rows[:4]), tmp_path / "a")
    tsv_to_npy(write_tsv(tmp_path / "b.tsv", rows[4:]), tmp_path / "b")
    batches = list(CriteoNpy([tmp_path / "a", tmp_path / "b"], batch_size=3))
    assert _row_numbers(batches) == list(range(9))
    assert len(list(CriteoNpy([tmp_path / "a", tmp_path / "b"], batch_size=4, drop_last=True))) == 2


def test_ranks_get_equal_batch_counts_and_every_row_once(tmp_path):
    tsv_to_npy(write_tsv(tmp_path / "a.tsv", random_rows(10)), tmp_path / "a")
    seen, counts = [], []
    for rank in range(3):
        data = CriteoNpy(tmp_path / "a", batch_size=2, rank=rank, world_size=3)
        batches = list(data)
        counts.append((len(data), len(batches)))
        seen += _row_numbers(batches)
    assert counts == [(2, 2)] * 3
    assert sorted(seen) == list(range(10))


def test_val_and_test_stages_split_one_prefix(tmp_path):
    tsv_to_npy(write_tsv(tmp_path / "a.tsv", random_rows(7)), tmp_path / "a")
    assert _row_numbers(CriteoNpy(tmp_path / "a", batch_size=3, stage="val")) == [0, 1, 2, 3]
    assert _row_numbers(CriteoNpy(tmp_path / "a", batch_size=3, stage="test")) == [4, 5, 6]
    with pytest.raises(ValueError, match='stage="val" reads half of one prefix; got 2 prefixes'):
        CriteoNpy([tmp_path / "a", tmp_path / "a"], batch_size=3, stage="val")


def test_fewer_rows_than_ranks_is_an_error(tmp_path):
    tsv_to_npy(write_tsv(tmp_path / "a.tsv", random_rows(3)), tmp_path / "a")
    assert len(CriteoNpy(tmp_path / "a", batch_size=2, rank=2, world_size=3)) == 1
    with pytest.raises(ValueError, match=r"3 rows \(stage 'train'\) for 4 ranks"):
        CriteoNpy(tmp_path / "a", batch_size=2, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"1 rows \(stage 'test'\) for 2 ranks"):
        CriteoNpy(tmp_path / "a", batch_size=2, world_size=2, stage="test")


@pytest.mark.filterwarnings("ignore:Local function is not supported by pickle")  # torchrec's own
def test_reads_files_written_by_torchrec(tmp_path):
    rows = random_rows(6, seed=5)
    tsv = write_tsv(tmp_path / "day_0", rows)
    out = npy_paths(tmp_path / "tr")
    # "criteo_1tb": with "criteo_kaggle" torchrec drops the labels of any path containing "test"
    BinaryCriteoUtils.tsv_to_npys(str(tsv), *out, dataset_name="criteo_1tb")
    (batch,) = list(CriteoNpy(tmp_path / "tr", batch_size=6, num_embeddings_per_feature=TABLE_ROWS))
    (want,) = list(CriteoTsv(tsv, batch_size=6, num_embeddings_per_feature=TABLE_ROWS))
    assert torch.equal(batch.sparse_features.values(), want.sparse_features.values())
    assert torch.equal(batch.labels, want.labels)
    # dense as stored: torchrec's own log(x - min + 2)
    assert torch.equal(batch.dense_features, torch.from_numpy(np.load(out[0])))


def test_numpy_global_rng_is_left_alone(tmp_path):
    tsv_to_npy(write_tsv(tmp_path / "a.tsv", random_rows(3)), tmp_path / "a")
    np.random.seed(123)
    want = np.random.rand()
    np.random.seed(123)
    CriteoNpy(tmp_path / "a", batch_size=2)
    assert np.random.rand() == want


def _write_prefix(prefix, n=4, dense=None, sparse=None, labels=None):
    arrays = [
        np.zeros((n, 13), np.float32) if dense is None else dense,
        np.zeros((n, 26), np.int64) if sparse is None else sparse,
        np.zeros((n, 1), np.int32) if labels is None else labels,
    ]
    for path, arr in zip(npy_paths(prefix), arrays):
        np.save(path, arr)


@pytest.mark.parametrize(
    "arrays, message",
    [
        (dict(sparse=np.zeros((3, 26), np.int64)), "{p}: row counts differ: x_dense.npy 4, x_sparse.npy 3, x_labels.npy 4"),
        (dict(dense=np.zeros((4, 12), np.float32)), "{p}_dense.npy: expected shape (N, 13), got (4, 12)"),
        (dict(labels=np.zeros(4, np.int32)), "{p}_labels.npy: expected shape (N, 1), got (4,)"),
        (dict(sparse=np.zeros((4, 26), np.float32)), "{p}_sparse.npy: expected a integer (categorical ids) dtype, got float32"),
        (dict(dense=np.zeros((4, 13), np.int32)), "{p}_dense.npy: expected a floating (normalised dense features) dtype, got int32"),
        (dict(dense=np.zeros((0, 13), np.float32), sparse=np.zeros((0, 26), np.int64), labels=np.zeros((0, 1), np.int32)), "{p}: the npy files have no rows"),
    ],
)
def test_bad_npy_layouts_are_named(tmp_path, arrays, message):
    prefix = tmp_path / "x"
    _write_prefix(prefix, **arrays)
    with pytest.raises(ValueError) as err:
        CriteoNpy(prefix, batch_size=2)
    assert str(err.value) == message.format(p=prefix)


def test_missing_and_truncated_npy_files(tmp_path):
    prefix = tmp_path / "x"
    _write_prefix(prefix)
    os.remove(npy_paths(prefix)[2])
    with pytest.raises(FileNotFoundError, match="x_labels.npy does not exist .*x_dense.npy, x_sparse.npy, x_labels.npy"):
        CriteoNpy(prefix, batch_size=2)
    _write_prefix(prefix)
    sparse = npy_paths(prefix)[1]
    with open(sparse, "r+b") as f:
        f.truncate(200)
    with pytest.raises(ValueError, match=f"^{sparse}: not a readable .npy array"):
        check_npy_prefix(prefix)


def test_converter_bad_rows_error_or_skip(tmp_path):
    rows = random_rows(6)
    rows[4] = rows[4][:17]
    tsv = write_tsv(tmp_path / "a.tsv", rows)
    with pytest.raises(CriteoRowError, match=f"^{tsv} line 5: expected 40"):
        tsv_to_npy(tsv, tmp_path / "out", chunk_rows=2)
    assert sorted(os.listdir(tmp_path)) == ["a.tsv"]  # nothing half-written left behind
    result = tsv_to_npy(tsv, tmp_path / "out", on_bad_row="skip", chunk_rows=2)
    assert (result.rows, result.skipped_rows) == (5, 1)
    assert result.skipped_examples == [f"{tsv} line 5: expected 40 tab-separated fields, got 17"]
    assert _row_numbers(CriteoNpy(tmp_path / "out", batch_size=8)) == [0, 1, 2, 3, 5]


@pytest.mark.parametrize("part, value, message", [
    ("dense", np.nan, "{p}_dense.npy row 2: dense values must be finite"),
    ("dense", np.inf, "{p}_dense.npy row 2: dense values must be finite"),
    ("labels", 2, "{p}_labels.npy row 2: labels must be 0 or 1, got 2"),
    ("labels", -1, "{p}_labels.npy row 2: labels must be 0 or 1, got -1"),
    ("labels", 0.5, "{p}_labels.npy row 2: labels must be 0 or 1, got 0.5"),
])
def test_nonfinite_dense_and_bad_labels_name_file_and_row(tmp_path, part, value, message):
    prefix = tmp_path / "x"
    arrays = {"dense": np.zeros((4, 13), np.float32),
              "labels": np.zeros((4, 1), np.float32 if value == 0.5 else np.int32)}
    arrays[part][2, 0] = value
    _write_prefix(prefix, **arrays)
    with pytest.raises(ValueError) as err:
        CriteoNpy(prefix, batch_size=2)
    assert str(err.value).startswith(message.format(p=prefix))
    CriteoNpy(prefix, batch_size=2, check_values=False)  # the check can be turned off
