"""``run.tensorboard=true`` writes the values of metrics.csv as TensorBoard scalars."""

from __future__ import annotations

import pytest
from hydra.errors import HydraException

from robe_torchrec.train.trainer import train
from tests.train.helpers import compose, one_rank_group


def test_tensorboard_scalars_match_metrics_csv(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with one_rank_group():
        results = train(compose("run.steps=4", "run.tensorboard=true", "data.num_sparse=4"),
                        tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/auc", "train/log_loss", "train/samples_per_s", "val/auc", "val/log_loss",
            "test/auc", "test/log_loss"} <= tags, tags
    assert [e.step for e in events.Scalars("train/log_loss")] == [2, 4]
    test_auc = events.Scalars("test/auc")[-1]
    assert test_auc.step == 4 and test_auc.value == pytest.approx(results["test_auc"], rel=1e-6)


def test_tensorboard_is_off_by_default_and_checked(tmp_path):
    with one_rank_group():
        train(compose("run.steps=2", "data.num_sparse=4"), tmp_path)
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(HydraException, match="run.tensorboard=maybe"):  # typed: a bool
        compose("run.tensorboard=maybe")
