"""What a checkpoint must agree on with the config that resumes it.

:func:`fingerprint` flattens the settings that decide what a checkpoint means (model,
embedding layout, optimizer, the training data stream, batch size, seeds, world size) into
``{"dotted.key": value}``; the app stores it in every checkpoint's manifest. On resume
:func:`compare` splits the differences into those that may change (learning rates, applied
and logged) and those that refuse the resume (listed in the error).

Example::

    >>> saved = fingerprint(cfg_then, world_size=1)
    >>> changes = compare(saved, fingerprint(cfg_now, world_size=2))
    >>> changes.refused
    {'world_size': (1, 2)}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

from omegaconf import DictConfig, OmegaConf

from robe_torchrec.train.config import ConfigError

#: data keys that do not change the training stream (eval splits, reader settings)
_DATA_KEYS_FREE = ("val", "test", "on_bad_row", "mmap_mode", "check_values",
                   "split_eval_prefix")
#: may differ on resume: the new value is applied to the optimizer's param groups
ALLOWED = ("optimizer.dense_lr", "optimizer.embedding_lr")

_WHY = {
    "world_size": "the data position is counted in global batches of run.batch_size x world "
                  "size, so another world size would skip or repeat samples",
    "run.batch_size": "the data position is counted in batches",
}


class ResumeMismatch(ConfigError):
    """The checkpoint was made with a config that differs in a setting that matters."""


def _flatten(obj: Any, prefix: str, out: Dict[str, Any]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = obj


def fingerprint(cfg: DictConfig, world_size: int) -> Dict[str, Any]:
    """The resume-relevant settings of ``cfg``, flat and JSON-able."""
    c = OmegaConf.to_container(cfg, resolve=True)
    out: Dict[str, Any] = {}
    for group in ("model", "embedding", "optimizer"):
        _flatten(c[group], group, out)
    _flatten({k: v for k, v in c["data"].items() if k not in _DATA_KEYS_FREE}, "data", out)
    out["run.batch_size"] = c["run"]["batch_size"]
    out["run.seed"] = c["run"]["seed"]
    out["world_size"] = world_size
    return out


@dataclass
class Changes:
    """``{key: (checkpoint's value, config's value)}``, split by whether they may differ."""

    allowed: Dict[str, Tuple[Any, Any]] = field(default_factory=dict)
    refused: Dict[str, Tuple[Any, Any]] = field(default_factory=dict)


def compare(saved: Dict[str, Any], now: Dict[str, Any]) -> Changes:
    changes = Changes()
    for key in sorted(set(saved) | set(now)):
        then, new = saved.get(key, "<unset>"), now.get(key, "<unset>")
        if then != new:
            (changes.allowed if key in ALLOWED else changes.refused)[key] = (then, new)
    return changes


def refusal(checkpoint: str, refused: Dict[str, Tuple[Any, Any]]) -> ResumeMismatch:
    lines = [f"  {k}: {a!r} -> {b!r}" + (f" ({_WHY[k]})" if k in _WHY else "")
             for k, (a, b) in refused.items()]
    return ResumeMismatch(
        f"checkpoint {checkpoint} was made with another config; these settings differ "
        f"(checkpoint -> now):\n" + "\n".join(lines) + "\nResume with the checkpoint's "
        f"values, or start a new run in another run dir. On resume only "
        f"{', '.join(ALLOWED)} and run.steps may change.")
