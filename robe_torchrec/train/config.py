"""Checks of the composed Hydra config, so a bad setting fails at start with a message naming
the key, instead of deep inside TorchRec.

Example::

    >>> validate(cfg)   # raises ConfigError("pipeline.name: unknown pipeline 'x' ...")
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

# config_dir: the app's Hydra config folder (a checkout, an editable install or a wheel)
from robe_torchrec.dlrm import MODELS, OPTIMIZERS as _OPTIMIZERS
from robe_torchrec.hydra_configs import config_dir  # noqa: F401

PIPELINES = ("plain", "sparse_dist", "fused_sparse_dist", "semi_sync")
OPTIMIZERS = tuple(_OPTIMIZERS)
EMBEDDINGS = ("robe", "full")
SHARDING_TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise")
DATA = ("synthetic", "criteo_tsv", "criteo_npy")
MODES = ("train", "eval")
SYNTHETIC_MODES = ("realistic", "hard")


class ConfigError(ValueError):
    """A setting of the training config is invalid (the message names the key)."""


def _choice(value, allowed, key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r}; choose one of {', '.join(allowed)}")


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first invalid setting of ``cfg``."""
    _choice(cfg.pipeline.name, PIPELINES, "pipeline.name")
    _choice(cfg.optimizer.name, OPTIMIZERS, "optimizer.name")
    _choice(cfg.model.name, MODELS, "model.name")
    _choice(cfg.embedding.kind, EMBEDDINGS, "embedding.kind")
    _choice(cfg.data.name, DATA, "data.name")
    if cfg.data.name == "synthetic":
        _choice(cfg.data.get("mode", "hard"), SYNTHETIC_MODES, "data.mode")
    for t in cfg.sharding.types or []:
        _choice(t, SHARDING_TYPES, "sharding.types")

    emb = cfg.embedding
    if emb.dim <= 0:
        raise ConfigError(f"embedding.dim must be positive, got {emb.dim}")
    if emb.kind == "robe":
        if (emb.compression is None) == (emb.memory_size is None):
            raise ConfigError("embedding: give exactly one of embedding.compression and "
                              "embedding.memory_size (set the other to null)")
        if emb.compression is not None and emb.compression < 1:
            raise ConfigError(f"embedding.compression must be >= 1 (uncompressed / compressed), "
                              f"got {emb.compression}")
        if emb.memory_size is not None and emb.memory_size < emb.block_size:
            raise ConfigError(f"embedding.memory_size ({emb.memory_size}) must hold at least "
                              f"one block (embedding.block_size={emb.block_size})")
        if emb.block_size < 1:
            raise ConfigError(f"embedding.block_size must be >= 1, got {emb.block_size}")
        _choice(emb.get("hash", "reference"), ("reference", "mix"), "embedding.hash")
        _choice(emb.get("bounds_check", "error"), ("error", "unbounded"), "embedding.bounds_check")
    init_from = emb.get("init_from")
    if init_from and emb.kind != "robe":
        raise ConfigError("embedding.init_from fits a ROBE array to a full model's tables: it "
                          "needs embedding=robe")
    if init_from and not (Path(init_from) / ".metadata").is_file():
        raise ConfigError(f"embedding.init_from: no complete checkpoint at {init_from} (a "
                          f"step_N directory, holding DCP's .metadata, of an embedding=full run)")

    if emb.kind == "full" and cfg.optimizer.name == "adam":
        # torchrec 1.8 hands torch.optim.Adam's `betas` to FBGEMM's TBE, which takes
        # beta1/beta2 and has no Adam on CPU
        raise ConfigError("embedding=full with optimizer=adam is not supported (TorchRec 1.8 "
                          "cannot pass Adam's betas to FBGEMM's TBE); use optimizer=adagrad or "
                          "sgd for the full-table baseline")

    dense = list(cfg.model.dense_arch_layer_sizes)
    if not dense or dense[-1] != emb.dim:
        raise ConfigError(
            f"model.dense_arch_layer_sizes must end at the embedding dim (DLRM interacts the "
            f"dense output with the embeddings): got {dense}, embedding.dim={emb.dim}")
    over = list(cfg.model.over_arch_layer_sizes)
    if not over or over[-1] != 1:
        raise ConfigError(f"model.over_arch_layer_sizes must end at 1 (one logit), got {over}")
    fast = cfg.model.get("fast_interaction", False)
    if not isinstance(fast, bool):
        raise ConfigError(f"model.fast_interaction must be true or false, got {fast!r}")
    if fast and cfg.model.name != "dlrm":
        raise ConfigError(f"model.fast_interaction=true needs model=dlrm (the dot interaction); "
                          f"model={cfg.model.name} has no such interaction")

    run = cfg.run
    for key in ("steps", "log_every", "eval_every", "checkpoint_every", "eval_batches",
                "test_batches"):
        if run[key] < 0:
            raise ConfigError(f"run.{key} must be >= 0, got {run[key]}")
    if run.batch_size <= 0:
        raise ConfigError(f"run.batch_size must be positive, got {run.batch_size}")
    if str(run.resume).lower() not in ("auto", "true", "false"):
        raise ConfigError(f"run.resume must be auto, true or false, got {run.resume!r}")
    _reliability(run)
    if cfg.data.name == "synthetic" and not cfg.data.cardinality_scale > 0:
        raise ConfigError(f"data.cardinality_scale must be > 0 (it multiplies the Criteo "
                          f"table sizes), got {cfg.data.cardinality_scale}")

    mode = run.get("mode", "train")
    _choice(mode, MODES, "run.mode")
    checkpoint = run.get("checkpoint")
    if mode == "eval":
        if not checkpoint:
            raise ConfigError("run.mode=eval needs run.checkpoint=<run dir>/checkpoints/step_N")
        if not (Path(checkpoint) / ".metadata").is_file():
            raise ConfigError(f"run.checkpoint: no complete checkpoint at {checkpoint} (a "
                              f"step_N directory holding DCP's .metadata)")
    elif checkpoint:
        raise ConfigError(f"run.checkpoint is read by run.mode=eval only (got run.mode={mode}; "
                          f"run.resume continues training from the run dir's checkpoints)")
    if not isinstance(run.get("tensorboard", False), bool):
        raise ConfigError(f"run.tensorboard must be true or false, got {run.tensorboard!r}")
    if not isinstance(run.get("predictions", False), bool):
        raise ConfigError(f"run.predictions must be true or false, got {run.predictions!r}")
    if run.get("predictions") and mode != "eval":
        raise ConfigError("run.predictions=true needs run.mode=eval")


def _reliability(run: DictConfig) -> None:
    """The checkpoint-keeping and non-finite-guard settings of ``run``."""
    for key in ("keep_checkpoints", "check_every", "max_rollbacks"):
        if run.get(key, 0) < 0:
            raise ConfigError(f"run.{key} must be >= 0, got {run[key]}"
                              + (" (0 keeps every checkpoint)" if key == "keep_checkpoints"
                                 else ""))
    _choice(run.get("on_nonfinite", "stop"), ("stop", "rollback"), "run.on_nonfinite")
    _choice(run.get("existing_checkpoints", "refuse"), ("refuse", "move"),
            "run.existing_checkpoints")
    scale = run.get("rollback_lr_scale", 0.5)
    if not 0 < scale < 1:
        raise ConfigError(f"run.rollback_lr_scale must be in (0, 1) (the learning rates are "
                          f"multiplied by it on each rollback), got {scale}")
    if not isinstance(run.get("allow_unverified", False), bool):
        raise ConfigError(f"run.allow_unverified must be true or false, got "
                          f"{run.allow_unverified!r}")
    timeout = run.get("collective_timeout", 1800)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"run.collective_timeout must be a number of seconds > 0, got "
                          f"{timeout!r}")
    export = run.get("export")
    if export:
        target = Path(export)
        if target.is_dir():
            raise ConfigError(f"run.export={export} is a directory; give the file to write, "
                              f"for example run.export={target / 'model.pt2'}")
        parent = next((p for p in target.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ConfigError(f"run.export={export}: {parent} is a file, so the program "
                              f"cannot be written under it")
