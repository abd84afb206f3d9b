"""CriteoTsv: exact parsing, batching, sharding and bad-row handling on small TSV fixtures."""

from __future__ import annotations

import gzip
import logging
import math
import os

import pytest
import torch

from robe_torchrec.data import CriteoRowError, CriteoTsv, SyntheticCriteo
from tests.data.fixtures import random_rows, write_tsv

SHARED_SAMPLE = "/work/shared/data/criteo_kaggle_head10k.tsv"

# three hand-written rows and what they must become (ids folded into TABLE_ROWS)
TABLE_ROWS = [7, 5, 1000] + [100] * 23
HAND_ROWS = [
    ["1", "0", "1", "-3", "", "10", "2", "3", "4", "5", "6", "7", "8", "9",
     "0000000a", "", "ffffffff", *[f"{j:08x}" for j in range(3, 26)]],
    ["0", *[""] * 13, *[""] * 26],
    ["1", *[str(v) for v in range(100, 113)], "0000000C", "00000007", "000003e9", *["000000ff"] * 23],
]
HAND_DENSE_RAW = [
    [0, 1, 0, 0, 10, 2, 3, 4, 5, 6, 7, 8, 9],  # -3 clamped to 0, empty read as 0
    [0] * 13,
    list(range(100, 113)),
]
HAND_IDS = {0: [10 % 7, 0, 12 % 7], 1: [0, 0, 7 % 5], 2: [4294967295 % 1000, 0, 1001 % 1000]}
HAND_IDS.update({j: [j, 0, 255 % 100] for j in range(3, 26)})


def test_hand_written_rows_parse_exactly(tmp_path):
    path = write_tsv(tmp_path / "hand.tsv", HAND_ROWS)
    (batch,) = list(CriteoTsv(path, batch_size=8, num_embeddings_per_feature=TABLE_ROWS))
    expected_dense = torch.tensor([[math.log(1 + x) for x in row] for row in HAND_DENSE_RAW])
    torch.testing.assert_close(batch.dense_features, expected_dense, rtol=0, atol=1e-6)
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{j}" for j in range(26)]
    for j in range(26):
        assert kjt[f"cat_{j}"].values().tolist() == HAND_IDS[j], j
        assert kjt[f"cat_{j}"].lengths().tolist() == [1, 1, 1]


def test_batches_look_like_synthetic_ones(tmp_path):
    path = write_tsv(tmp_path / "a.tsv", random_rows(6))
    real = next(iter(CriteoTsv(path, batch_size=4, num_embeddings_per_feature=1000)))
    fake = SyntheticCriteo(batch_size=4).batch(0)
    assert real.sparse_features.keys() == fake.sparse_features.keys()
    for a, b in [
        (real.dense_features, fake.dense_features),
        (real.labels, fake.labels),
        (real.sparse_features.values(), fake.sparse_features.values()),
        (real.sparse_features.lengths(), fake.sparse_features.lengths()),
    ]:
        assert (a.dtype, a.shape) == (b.dtype, b.shape)


def test_table_sizes_and_keys(tmp_path):
    path = write_tsv(tmp_path / "a.tsv", random_rows(2))
    assert CriteoTsv(path, 2, num_embeddings_per_feature=TABLE_ROWS).table_sizes() == TABLE_ROWS
    assert CriteoTsv(path, 2, num_embeddings_per_feature=9).table_sizes() == [9] * 26
    assert CriteoTsv(path, 2).keys == SyntheticCriteo().keys
    with pytest.raises(ValueError, match="no table sizes"):
        CriteoTsv(path, 2).table_sizes()


def test_one_hash_size_folds_every_feature(tmp_path):
    rows = random_rows(20, seed=1, empty_rate=0.0)
    path = write_tsv(tmp_path / "a.tsv", rows)
    (batch,) = list(CriteoTsv(path, batch_size=20, num_embeddings_per_feature=97))
    raw = CriteoTsv(path, batch_size=20)  # None keeps the raw ids
    (raw_batch,) = list(raw)
    for j in range(26):
        want = [int(r[14 + j], 16) % 97 for r in rows]
        assert batch.sparse_features[f"cat_{j}"].values().tolist() == want
        assert raw_batch.sparse_features[f"cat_{j}"].values().tolist() == [int(r[14 + j], 16) for r in rows]


def test_files_are_one_stream_and_drop_last(tmp_path):
    rows = random_rows(9)
    a = write_tsv(tmp_path / "a.tsv", rows[:5])
    b = write_tsv(tmp_path / "b.tsv", rows[5:])
    batches = list(CriteoTsv([a, b], batch_size=4))
    assert [len(x.labels) for x in batches] == [4, 4, 1]
    order = torch.cat([x.dense_features[:, 0] for x in batches])
    torch.testing.assert_close(order, torch.log1p(torch.arange(9.0)))
    assert [len(x.labels) for x in CriteoTsv([a, b], batch_size=4, drop_last=True)] == [4, 4]


def test_ranks_read_disjoint_shares_covering_all_rows(tmp_path):
    rows = random_rows(11)
    paths = [write_tsv(tmp_path / "a.tsv", rows[:7]), write_tsv(tmp_path / "b.tsv", rows[7:])]
    seen = []
    for rank in range(3):
        got = [
            round(math.expm1(v))
            for x in CriteoTsv(paths, batch_size=2, rank=rank, world_size=3)
            for v in x.dense_features[:, 0].tolist()
        ]
        assert got == list(range(rank, 11, 3))
        seen += got
    assert sorted(seen) == list(range(11))


def test_short_row_error_names_file_and_line(tmp_path):
    rows = random_rows(5)
    rows[2] = rows[2][:17]
    path = write_tsv(tmp_path / "criteo_kaggle_head10k.tsv", rows)
    with pytest.raises(ValueError) as err:
        list(CriteoTsv(path, batch_size=2))
    assert str(err.value) == f"{path} line 3: expected 40 tab-separated fields, got 17"
    assert (err.value.path, err.value.line) == (str(path), 3)


@pytest.mark.parametrize(
    "column, value, message",
    [
        (0, "2", "field 1 (label): expected 0 or 1, got '2'"),
        (0, "", "field 1 (label): expected 0 or 1, got ''"),
        (4, "1.5", "field 5 (int_3): expected an integer or empty, got '1.5'"),
        (20, "zz12", "field 21 (cat_6): expected a hex id or empty, got 'zz12'"),
        (39, "-00000a", "field 40 (cat_25): '-00000a' is not a 63-bit hex id"),
        (14, "f" * 20, "field 15 (cat_0): '" + "f" * 20 + "' is not a 63-bit hex id"),
    ],
)
def test_bad_value_error_names_field(tmp_path, column, value, message):
    rows = random_rows(4)
    rows[1][column] = value
    path = write_tsv(tmp_path / "x.tsv", rows)
    with pytest.raises(CriteoRowError) as err:
        list(CriteoTsv(path, batch_size=4))
    assert str(err.value) == f"{path} line 2: {message}"


def test_error_in_second_file_counts_lines_of_that_file(tmp_path):
    a = write_tsv(tmp_path / "a.tsv", random_rows(4))
    bad = random_rows(3)
    bad[2] = "garbage"
    b = write_tsv(tmp_path / "b.tsv", bad)
    with pytest.raises(CriteoRowError, match=f"^{b} line 3: expected 40 tab-separated fields, got 1$"):
        list(CriteoTsv([a, b], batch_size=2))


def test_truncated_last_line_is_caught(tmp_path):
    rows = random_rows(3, empty_rate=0.0)
    text = "".join("\t".join(r) + "\n" for r in rows)
    path = tmp_path / "cut.tsv"
    path.write_text(text[:-5])  # cut inside the last hex id, newline gone
    with pytest.raises(CriteoRowError, match=r"line 3: last line has no newline and field 40 \(cat_25\)"):
        list(CriteoTsv(path, batch_size=2))
    # a complete last line without a newline is fine
    path.write_text(text[:-1])
    assert sum(len(b.labels) for b in CriteoTsv(path, batch_size=2)) == 3


def test_skip_counts_and_reports_bad_rows(tmp_path, caplog):
    rows = random_rows(8)
    rows[1] = rows[1][:17]
    rows[5][3] = "x"
    path = write_tsv(tmp_path / "x.tsv", rows)
    data = CriteoTsv(path, batch_size=3, on_bad_row="skip")
    with caplog.at_level(logging.WARNING):
        batches = list(data)
    kept = [round(math.expm1(v)) for b in batches for v in b.dense_features[:, 0].tolist()]
    assert kept == [0, 2, 3, 4, 6, 7]
    assert (data.rows_read, data.skipped_rows) == (6, 2)
    assert data.skipped_examples == [
        f"{path} line 2: expected 40 tab-separated fields, got 17",
        f"{path} line 6: field 4 (int_2): expected an integer or empty, got 'x'",
    ]
    assert "skipped 2 malformed rows" in caplog.text
    # counters restart with each pass
    list(data)
    assert data.skipped_rows == 2


def test_bad_row_belongs_to_one_rank(tmp_path):
    rows = random_rows(6)
    rows[4] = rows[4][:30]  # line 5 (index 4): rank 1 of 3 owns it
    path = write_tsv(tmp_path / "x.tsv", rows)
    assert len(list(CriteoTsv(path, batch_size=8, rank=0, world_size=3))) == 1
    with pytest.raises(CriteoRowError, match="line 5: expected 40 tab-separated fields, got 30"):
        list(CriteoTsv(path, batch_size=8, rank=1, world_size=3))


def test_gzip_and_crlf_files_read_like_plain_ones(tmp_path):
    rows = random_rows(5)
    plain = write_tsv(tmp_path / "a.tsv", rows)
    crlf = write_tsv(tmp_path / "b.tsv", rows, newline="\r\n")
    gz = tmp_path / "c.tsv.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    want = next(iter(CriteoTsv(plain, batch_size=5, num_embeddings_per_feature=1000)))
    for path in (crlf, gz):
        got = next(iter(CriteoTsv(path, batch_size=5, num_embeddings_per_feature=1000)))
        assert torch.equal(got.dense_features, want.dense_features)
        assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
        assert torch.equal(got.labels, want.labels)


def test_bad_arguments(tmp_path):
    path = write_tsv(tmp_path / "a.tsv", random_rows(2))
    with pytest.raises(FileNotFoundError, match="nope.tsv does not exist"):
        CriteoTsv(tmp_path / "nope.tsv", batch_size=2)
    with pytest.raises(ValueError, match="on_bad_row"):
        CriteoTsv(path, batch_size=2, on_bad_row="ignore")
    with pytest.raises(ValueError, match="has 3 entries"):
        CriteoTsv(path, batch_size=2, num_embeddings_per_feature=[1, 2, 3])
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        CriteoTsv(path, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        CriteoTsv(path, batch_size=0)


@pytest.mark.skipif(not os.path.exists(SHARED_SAMPLE), reason="shared Criteo sample not present")
def test_shared_kaggle_sample():
    data = CriteoTsv(SHARED_SAMPLE, batch_size=4096, num_embeddings_per_feature=TABLE_ROWS)
    batches = list(data)
    assert [len(b.labels) for b in batches] == [4096, 4096, 1808]
    assert (data.rows_read, data.skipped_rows) == (10_000, 0)
    labels = torch.cat([b.labels for b in batches])
    assert abs(labels.mean().item() - 0.218) < 0.001  # the sample's README: 21.8% positives
    for b in batches:
        for j, n in enumerate(TABLE_ROWS):
            v = b.sparse_features[f"cat_{j}"].values()
            assert 0 <= v.min() and v.max() < n
        assert (b.dense_features >= 0).all()


def test_truncated_and_corrupt_gzip_name_the_file(tmp_path):
    rows = random_rows(2000)
    data = gzip.compress(write_tsv(tmp_path / "a.tsv", rows).read_bytes())
    cut = tmp_path / "cut.tsv.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"^{cut}: cannot read past line \d+: the compressed "
                                         r"stream ends early: truncated .gz file\?"):
        list(CriteoTsv(cut, batch_size=64))
    bad = tmp_path / "bad.tsv.gz"
    bad.write_bytes(b"this is not gzip\n" * 4)
    with pytest.raises(ValueError, match=rf"^{bad}: cannot read past line 0: BadGzipFile"):
        list(CriteoTsv(bad, batch_size=64))
