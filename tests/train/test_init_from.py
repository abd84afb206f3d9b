"""embedding.init_from: the app starts a ROBE-Z model from the least-squares fit of the full
tables of a checkpoint written by a full-table run (DMP-sharded tables, read back in one
process)."""

import pytest
import torch

from robe_torchrec.compress import least_squares_array, load_embedding_bag_collection, table_weights
from robe_torchrec.train.checkpoint import load_unsharded
from robe_torchrec.train.config import ConfigError, validate
from robe_torchrec.train.data import build_data
from robe_torchrec.train.model import build_model, build_predict_model
from robe_torchrec.train.trainer import run as run_app
from tests.train.helpers import compose, one_rank_group

STEPS = 2


def test_robe_starts_from_the_fit_of_a_full_model_checkpoint(tmp_path):
    every = ["run.steps=2", "run.checkpoint_every=2"]
    with one_rank_group():
        run_app(compose("embedding=full", *every), tmp_path / "full")
        ckpt = tmp_path / "full" / "checkpoints" / f"step_{STEPS}"
        # the trained tables, read two ways: the app's serving loader and the compress helper
        cfg_full = compose("embedding=full")
        data = build_data(cfg_full, 0, 1)
        predict, _ = build_predict_model(cfg_full, data.keys, data.cardinalities)
        load_unsharded(ckpt, predict)
        trained = table_weights(predict.sparse_arch.embedding_bag_collection)
        loaded = table_weights(load_embedding_bag_collection(
            ckpt, predict.sparse_arch.embedding_bag_collection.embedding_bag_configs()))
        assert trained.keys() == loaded.keys()
        assert all(torch.equal(trained[k], loaded[k]) for k in trained)

        cfg = compose(f"embedding.init_from={ckpt}", "embedding.compression=10")
        validate(cfg)
        model, _ = build_model(cfg, data.keys, data.cardinalities, torch.device("cpu"))
        robe = model.model.sparse_arch.embedding_bag_collection
        assert torch.equal(robe.weight.detach(), least_squares_array(robe.layout, trained))

        out = run_app(compose(f"embedding.init_from={ckpt}", *every), tmp_path / "robe")
        assert 0.0 <= out["test_auc"] <= 1.0
        # a ROBE checkpoint holds no full tables: refused, naming the fix
        robe_ckpt = tmp_path / "robe" / "checkpoints" / f"step_{STEPS}"
        with pytest.raises(ValueError, match="needs a checkpoint of a full-table model"):
            build_model(compose(f"embedding.init_from={robe_ckpt}"), data.keys,
                        data.cardinalities, torch.device("cpu"))
    with pytest.raises(ConfigError, match="needs embedding=robe"):
        validate(compose("embedding=full", f"+embedding.init_from={ckpt}"))
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        validate(compose(f"embedding.init_from={tmp_path / 'nothing'}"))
    with pytest.raises(ConfigError, match="data.mode: unknown value 'soft'"):
        validate(compose("data.mode=soft"))
