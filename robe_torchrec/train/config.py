"""Checks of the composed Hydra config, so a bad setting fails at start with a message naming
the key, instead of deep inside TorchRec; and the config as the lower layers' own objects.

Each rule is checked once, by the layer that owns it:

- the key names and types: Hydra, against the schemas of :mod:`robe_torchrec.train.schema`,
  while it composes;
- the app's own options: those schemas' ``__post_init__`` (:func:`~robe_torchrec.train.schema.typed`);
- ROBE's settings: :class:`robe_torchrec.RobeConfig`; the model's layer sizes:
  :class:`robe_torchrec.dlrm.DLRMSpec` (built here by :func:`dlrm_spec`, their errors
  reported as :class:`ConfigError` naming the app's keys);
- here: what spans groups, and what reads the file system (checkpoints, the export path).

Example::

    >>> validate(cfg)   # raises ConfigError("pipeline.name: unknown value 'x'; choose ...")
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from omegaconf import DictConfig

from robe_torchrec.config import RobeConfig
from robe_torchrec.dlrm import DLRMSpec, OptimizerSpec
from robe_torchrec.train.schema import AppConfig, ConfigError, typed

#: the fields of RobeConfig and DLRMSpec under the app's keys, so their errors name what to set
_ROBE_KEYS = {k: f"embedding.{k}" for k in ("compression", "memory_size", "block_size", "hash",
                                            "bounds_check", "seed", "shared")}
_SPEC_KEYS = {"dense_arch": "model.dense_arch_layer_sizes",
              "over_arch": "model.over_arch_layer_sizes", "embedding_dim": "embedding.dim",
              "fast_interaction": "model.fast_interaction", "model": "model.name",
              "dcn_num_layers": "model.dcn_num_layers",
              "dcn_low_rank_dim": "model.dcn_low_rank_dim"}


@contextmanager
def _reported_as(owner: str, keys: Mapping[str, str]) -> Iterator[None]:
    """A lower layer's ValueError as a ConfigError in the app's terms: the owner's field
    names (``compression``, ``DLRMSpec.dense_arch``) become the app's keys
    (``embedding.compression``, ``model.dense_arch_layer_sizes``); the owner is named last."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        fields = re.compile(rf"\b(?:{owner}\.)?({'|'.join(map(re.escape, keys))})\b")
        message = fields.sub(lambda m: keys[m.group(1)], str(e).removeprefix(f"{owner}: "))
        raise ConfigError(f"{message} ({owner})") from e


def optimizer_spec(opt: Any, lr: float) -> OptimizerSpec:
    """An ``optimizer`` config group entry at learning rate ``lr`` (it has two)."""
    betas = getattr(opt, "betas", None)  # adam only
    with _reported_as("OptimizerSpec", {"name": "optimizer.name"}):
        return OptimizerSpec(opt.name, lr=lr, weight_decay=opt.weight_decay,
                             eps=getattr(opt, "eps", None),  # not sgd
                             betas=tuple(betas) if betas is not None else None)


def dlrm_spec(cfg: Any) -> DLRMSpec:
    """The ``model``, ``embedding`` and ``optimizer`` config groups (a composed DictConfig or
    its :class:`~robe_torchrec.train.schema.AppConfig`) as a spec; its RobeConfig and
    DLRMSpec check their settings, and a refusal is a :class:`ConfigError`."""
    emb, m, opt = cfg.embedding, cfg.model, cfg.optimizer
    robe = None
    if emb.kind == "robe":
        with _reported_as("RobeConfig", _ROBE_KEYS):
            robe = RobeConfig(compression=emb.compression, memory_size=emb.memory_size,
                              block_size=emb.block_size, hash=emb.hash, seed=emb.seed,
                              shared=emb.shared, bounds_check=emb.bounds_check)
    dcn = {"dcn_num_layers": m.dcn_num_layers, "dcn_low_rank_dim": m.dcn_low_rank_dim} \
        if m.name == "dcn" else {}
    with _reported_as("DLRMSpec", _SPEC_KEYS):
        return DLRMSpec(robe=robe, embedding_dim=emb.dim, model=m.name,
                        dense_arch=tuple(m.dense_arch_layer_sizes),
                        over_arch=tuple(m.over_arch_layer_sizes),
                        fast_interaction=m.fast_interaction if m.name == "dlrm" else False,
                        embedding_optimizer=optimizer_spec(opt, opt.embedding_lr),
                        dense_optimizer=optimizer_spec(opt, opt.dense_lr), **dcn)


def validate(cfg: DictConfig) -> AppConfig:
    """Raise :class:`ConfigError` for the first invalid setting of ``cfg``; return it typed."""
    app = typed(cfg)
    dlrm_spec(app)
    emb = app.embedding
    if emb.kind == "full" and app.optimizer.name == "adam":
        # torchrec 1.8 hands torch.optim.Adam's `betas` to FBGEMM's TBE, which takes
        # beta1/beta2 and has no Adam on CPU
        raise ConfigError("embedding=full with optimizer=adam is not supported (TorchRec 1.8 "
                          "cannot pass Adam's betas to FBGEMM's TBE); use optimizer=adagrad or "
                          "sgd for the full-table baseline")
    init_from = getattr(emb, "init_from", None)  # robe only
    if init_from and not (Path(init_from) / ".metadata").is_file():
        raise ConfigError(f"embedding.init_from: no complete checkpoint at {init_from} (a "
                          f"step_N directory, holding DCP's .metadata, of an embedding=full run)")
    run = app.run
    if run.mode == "eval" and not (Path(run.checkpoint) / ".metadata").is_file():
        raise ConfigError(f"run.checkpoint: no complete checkpoint at {run.checkpoint} (a "
                          f"step_N directory holding DCP's .metadata)")
    if run.export:
        _check_export(run.export)
    return app


def _check_export(export: str) -> None:
    """``run.export`` must name a file that can be written."""
    target = Path(export)
    if target.is_dir():
        raise ConfigError(f"run.export={export} is a directory; give the file to write, "
                          f"for example run.export={target / 'model.pt2'}")
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"run.export={export}: {parent} is a file, so the program "
                          f"cannot be written under it")


__all__ = ["ConfigError", "dlrm_spec", "optimizer_spec", "validate"]
