"""Config composition and the clear errors of bad configs (fast, in-process)."""

from __future__ import annotations

import pytest
import torch
from hydra.errors import HydraException

from torchrec.models.dlrm import InteractionArch

from robe_torchrec.interaction import FastInteractionArch
from robe_torchrec.hydra_configs import config_dir
from robe_torchrec.train.config import ConfigError, validate
from robe_torchrec.train.pipeline import make_pipeline
from tests.train.helpers import compose


def test_default_config_composes_and_is_valid():
    cfg = compose()
    app = validate(cfg)  # typed: each group's option as its dataclass
    assert (type(app.embedding).__name__, app.embedding.block_size) == ("RobeEmbeddingConfig", 8)
    assert (cfg.model.name, cfg.embedding.kind, cfg.pipeline.name, cfg.optimizer.name) == \
        ("dlrm", "robe", "sparse_dist", "adagrad")
    assert cfg.model.dense_arch_layer_sizes[-1] == cfg.embedding.dim  # interpolated
    assert (config_dir() / "config.yaml").is_file()


@pytest.mark.parametrize("overrides", [
    ["model=dcn", "embedding=full", "optimizer=sgd", "pipeline=plain", "sharding=row_wise"],
    ["model=dcn", "optimizer=adam"],
    ["embedding.compression=null", "embedding.memory_size=4096", "embedding.shared=false",
     "embedding.hash=mix", "sharding=table_wise", "optimizer=sgd"],
    ["pipeline=fused_sparse_dist"], ["pipeline=semi_sync"], ["sharding=data_parallel"],
    ["embedding.bounds_check=unbounded", "embedding.hash=mix"],
])
def test_every_group_option_is_valid(overrides):
    validate(compose(*overrides))


@pytest.mark.parametrize("overrides, message", [
    # the app's own options: the schemas' rules (robe_torchrec/train/schema.py)
    (["pipeline.name=turbo"], "pipeline.name: unknown value 'turbo'"),
    (["optimizer.name=lamb"], "optimizer.name: unknown value 'lamb'"),
    (["optimizer.name=sgd"], "optimizer.name=sgd does not match the optimizer=adagrad config"),
    (["run.resume=maybe"], "run.resume must be auto, true or false"),
    (["run.steps=0"], "run.steps must be >= 1, got 0"),
    (["sharding.types=[diagonal]"], "sharding.types: unknown value 'diagonal'"),
    (["data.cardinality_scale=0"], "data.cardinality_scale must be > 0"),
    (["embedding.dim=0"], "embedding.dim must be >= 1, got 0"),
    (["run.keep_checkpoints=-1"], r"run.keep_checkpoints must be >= 0, got -1 \(0 keeps every"),
    (["run.on_nonfinite=ignore"], "run.on_nonfinite: unknown value 'ignore'"),
    (["run.rollback_lr_scale=2"], r"run.rollback_lr_scale must be in \(0, 1\)"),
    (["run.existing_checkpoints=delete"], "run.existing_checkpoints: unknown value 'delete'"),
    (["data=criteo_tsv"], "data.train is required"),
    # ROBE's settings: RobeConfig's checks, in the app's keys
    (["embedding.compression=0.5"], r"embedding.compression must be >= 1, got 0.5 \(RobeConfig\)"),
    (["embedding.memory_size=100"],
     "give exactly one of embedding.memory_size or embedding.compression"),
    (["embedding.compression=null", "embedding.memory_size=4"],
     "embedding.memory_size=4 holds less than one block of embedding.block_size=8 floats"),
    (["embedding.block_size=0"], "embedding.block_size must be >= 1"),
    (["embedding.bounds_check=clamp"], "embedding.bounds_check must be 'error' or 'unbounded'"),
    (["embedding.hash=md5"], "embedding.hash 'md5': expected 'reference' or 'mix'"),
    # the model's layer sizes: DLRMSpec's checks
    (["embedding.dim=8", "model.dense_arch_layer_sizes=[64,16]"],
     r"model.dense_arch_layer_sizes must end at embedding.dim \(8\), got \(64, 16\) "
     r"\(DLRMSpec\)"),
    (["model.over_arch_layer_sizes=[64,2]"], "model.over_arch_layer_sizes must end at 1"),
    # across groups
    (["embedding=full", "optimizer=adam"], "embedding=full with optimizer=adam is not supported"),
    # a key added with + that the option's schema does not have
    (["model=dcn", "+model.fast_interaction=true"],
     "model.fast_interaction needs model=dlrm: model=dcn has no such key"),
    (["+embedding.blok_size=3"], "embedding.blok_size: no such key in embedding=robe"),
])
def test_bad_config_is_refused_with_the_key_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))


@pytest.mark.parametrize("overrides, key, message", [
    (["run.steps=abc"], "run.steps", "could not be converted to Integer"),
    (["model.fast_interaction=maybe"], "model.fast_interaction", "is not a valid bool"),
    (["embedding.block_size=2.5"], "embedding.block_size", "could not be converted to Integer"),
    (["embedding.blok_size=3"], "embedding.blok_size", "Could not override"),
])
def test_wrong_type_or_unknown_key_fails_while_hydra_composes(overrides, key, message):
    with pytest.raises(HydraException) as caught:
        compose(*overrides)
    # Hydra names the override, its cause the key (full_key: ...)
    text = f"{caught.value}\n{caught.value.__cause__}"
    assert key in text and message in text, text


def test_a_typo_in_a_config_file_fails_while_hydra_composes(tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "configs"
    shutil.copytree(config_dir(), copy)
    robe = copy / "embedding" / "robe.yaml"
    robe.write_text(robe.read_text().replace("block_size: 8", "blok_size: 8"))
    monkeypatch.setenv("ROBE_TRAIN_CONFIGS", str(copy))
    with pytest.raises(HydraException, match=r"(?s)Key 'blok_size' not in "
                                             r"'RobeEmbeddingConfig'.*full_key: embedding"
                                             r".blok_size"):
        compose()


def test_config_files_without_their_schema_are_refused(tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "configs"
    shutil.copytree(config_dir(), copy)
    sgd = copy / "optimizer" / "sgd.yaml"
    sgd.write_text("\n".join(line for line in sgd.read_text().splitlines()
                             if "schema" not in line and "_self_" not in line
                             and line != "defaults:"))
    monkeypatch.setenv("ROBE_TRAIN_CONFIGS", str(copy))
    with pytest.raises(ConfigError, match="optimizer: its config file has no schema"):
        validate(compose("optimizer=sgd"))


def test_schema_choices_are_those_of_the_layers_below():
    """The app's lists of names agree with the factories that take them."""
    from robe_torchrec.data.synthetic import MODES
    from robe_torchrec.dlrm import MODELS, OPTIMIZERS
    from robe_torchrec.pipelines import PIPELINES
    from robe_torchrec.train.schema import (PipelineConfig, SyntheticDataConfig, options)

    assert sorted(PipelineConfig.NAMES) == sorted(PIPELINES)
    assert sorted(SyntheticDataConfig.MODES) == sorted(MODES)
    assert sorted(options("optimizer")) == sorted(OPTIMIZERS)
    assert sorted(options("model")) == sorted(MODELS)
    for group in ("data", "embedding", "model", "optimizer"):
        assert sorted(options(group)) == sorted(p.stem for p in (config_dir() / group).glob(
            "*.yaml")), group


@pytest.mark.parametrize("fast, arch", [("true", FastInteractionArch),
                                        ("false", InteractionArch)])
def test_model_interaction_follows_the_config(fast, arch):
    from robe_torchrec.data.synthetic import SyntheticCriteo
    from robe_torchrec.train.model import build_model

    cfg = compose(f"model.fast_interaction={fast}")
    data = SyntheticCriteo(cardinality_scale=cfg.data.cardinality_scale)
    model, _ = build_model(cfg, data.keys, data.cardinalities, torch.device("cpu"))
    assert type(model.model.inter_arch) is arch


def test_production_config_and_trainer_know_no_fault_injection():
    """The fault test's crash lives in tests/train/faulty_app.py, not in the app."""
    import inspect
    import re

    from robe_torchrec.train import trainer

    with pytest.raises(HydraException, match="fault"):
        compose("fault.kill_rank=1")
    for text in (inspect.getsource(trainer), (config_dir() / "config.yaml").read_text()):
        assert not re.search(r"\bfault", text, re.IGNORECASE)


def test_unknown_group_option_is_a_hydra_error():
    with pytest.raises(HydraException, match="pipeline"):
        compose("pipeline=turbo")


def test_pipeline_factory_refuses_unknown_names():
    with pytest.raises(ConfigError, match="unknown pipeline 'turbo'"):
        make_pipeline("turbo", torch.nn.Linear(1, 1), None, torch.device("cpu"))


def test_component_builds_the_torchrun_command():
    import sys

    from robe_torchrec.components import train

    app = train("run.steps=5", "model=dcn", j="2x4", max_restarts=2, run_dir="/shared/r1")
    role = app.roles[0]
    cmd = role.args[-1]
    # torchrun through this interpreter if the node has it (local schedulers), else the image's
    assert cmd.startswith(f'"$$([ -x {sys.executable} ] && echo {sys.executable} || echo '
                          'python)" -m torch.distributed.run --max_restarts 2 ')
    assert "-m robe_torchrec.train run.steps=5 model=dcn hydra.run.dir=/shared/r1" in cmd
    assert "--nproc_per_node 4" in cmd and role.num_replicas == 2
    assert "--max_restarts" not in train("run.steps=5").roles[0].args[-1]
    assert train(python="/opt/py").roles[0].args[-1].startswith(
        "/opt/py -m torch.distributed.run --rdzv_backend ")


def test_raw_ids_reach_the_model_through_the_app_config():
    """``embedding.bounds_check=unbounded embedding.hash=mix``: the model hashes raw 64-bit
    ids, as the out-of-range error's hint says."""
    from robe_torchrec.train.model import dlrm_spec

    robe = dlrm_spec(compose("embedding.bounds_check=unbounded", "embedding.hash=mix")).robe
    assert (robe.bounds_check, robe.hash) == ("unbounded", "mix")
    assert dlrm_spec(compose()).robe.bounds_check == "error"
