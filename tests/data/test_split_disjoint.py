"""Training, validation and test data share no sample, for every world size and loader.

Every rank of world sizes 1, 2 and 3 reads its share of each split; the samples (dense
features, ids and label, as bytes) of one split, over all ranks and all world sizes, must
not appear in another split. A model trained on 2 ranks and scored on 1 process must not be
tested on its own validation data."""

from __future__ import annotations

from typing import Dict, Iterable, Set

import pytest

from robe_torchrec.data.criteo_npy import tsv_to_npy
from robe_torchrec.train.config import ConfigError
from robe_torchrec.train.data import build_data
from tests.data.fixtures import random_rows, write_tsv
from tests.train.helpers import compose

WORLD_SIZES = (1, 2, 3)


def _samples(batches: Iterable) -> Set[bytes]:
    out = set()
    for b in batches:
        kjt = b.sparse_features
        ids = kjt.values().view(len(kjt.keys()), -1)  # one id per bag and feature
        for i in range(b.labels.numel()):
            out.add(b.dense_features[i].numpy().tobytes() + ids[:, i].numpy().tobytes()
                    + b.labels[i:i + 1].numpy().tobytes())
    return out


def _splits(cfg, steps: int, eval_batches: int) -> Dict[str, Set[bytes]]:
    """Every world size's and rank's samples of each split, together."""
    seen: Dict[str, Set[bytes]] = {"train": set(), "val": set(), "test": set()}
    for world in WORLD_SIZES:
        for rank in range(world):
            source = build_data(cfg, rank, world)
            seen["train"] |= _samples(source.train_batches(0, steps))
            for split in ("val", "test"):
                seen[split] |= _samples(source.eval_batches(split, eval_batches))
    return seen


def _assert_disjoint(seen: Dict[str, Set[bytes]]) -> None:
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert seen[a] and seen[b]
        shared = seen[a] & seen[b]
        assert not shared, f"{a} and {b} share {len(shared)} sample(s)"


def test_synthetic_splits_are_disjoint_across_world_sizes():
    cfg = compose("run.batch_size=4", "data.num_sparse=2")
    _assert_disjoint(_splits(cfg, steps=6, eval_batches=4))


def test_synthetic_training_stream_is_unchanged():
    """Training batches keep their indices (step * world + rank): old runs resume alike."""
    from robe_torchrec.data.synthetic import SyntheticCriteo

    cfg = compose("run.batch_size=4", "data.num_sparse=2")
    data = SyntheticCriteo(batch_size=4, cardinality_scale=cfg.data.cardinality_scale,
                           seed=cfg.data.seed, num_sparse=2, mode=cfg.data.mode)
    got = next(build_data(cfg, 1, 3).train_batches(2, 1))
    assert _samples([got]) == _samples([data.batch(2 * 3 + 1)])


def _tsv_files(tmp_path):
    return {split: write_tsv(tmp_path / f"{split}.tsv", random_rows(30, seed=seed))
            for seed, split in enumerate(("train", "val", "test"))}


def test_tsv_splits_are_disjoint_across_world_sizes(tmp_path):
    files = _tsv_files(tmp_path)
    cfg = compose("data=criteo_tsv", "data.num_embeddings_per_feature=1000",
                  "run.batch_size=4", *(f"data.{k}={v}" for k, v in files.items()))
    _assert_disjoint(_splits(cfg, steps=4, eval_batches=2))


def test_npy_splits_are_disjoint_across_world_sizes(tmp_path):
    """Train from its own prefix; validation and test the two halves of one prefix."""
    files = _tsv_files(tmp_path)
    tsv_to_npy(files["train"], tmp_path / "train")
    tsv_to_npy([files["val"], files["test"]], tmp_path / "eval")
    cfg = compose("data=criteo_npy", "data.num_embeddings_per_feature=1000", "run.batch_size=4",
                  f"data.train={tmp_path / 'train'}", f"data.val={tmp_path / 'eval'}",
                  f"data.test={tmp_path / 'eval'}")
    _assert_disjoint(_splits(cfg, steps=4, eval_batches=2))


@pytest.mark.parametrize("kind", ["criteo_tsv", "criteo_npy"])
def test_a_file_in_two_splits_is_refused(tmp_path, kind):
    files = _tsv_files(tmp_path)
    if kind == "criteo_npy":
        tsv_to_npy(files["train"], tmp_path / "train")
        tsv_to_npy(files["val"], tmp_path / "val")
        train, val = tmp_path / "train", tmp_path / "val"
    else:
        train, val = files["train"], files["val"]
    base = [f"data={kind}", "data.num_embeddings_per_feature=1000", "run.batch_size=4"]
    with pytest.raises(ConfigError, match=f"data.train and data.test both name {train}: "
                                          "the splits would share rows"):
        build_data(compose(*base, f"data.train={train}", f"data.test={train}"), 0, 1)
    if kind == "criteo_npy":
        # without the halves, one prefix for val and test is refused too
        with pytest.raises(ConfigError, match="data.val and data.test both name"):
            build_data(compose(*base, f"data.train={train}", f"data.val={val}",
                               f"data.test={val}", "data.split_eval_prefix=false"), 0, 1)
