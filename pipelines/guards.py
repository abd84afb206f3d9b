"""Refuse models that FusedSparseDist and SemiSync would train silently wrong.

Both pipelines look up the embeddings of batch i+1 before the dense optimizer of batch i
has stepped (SemiSync: even before the embedding backward of batch i). That is only the
same training as the textbook loop when

* every embedding parameter is updated inside backward by a fused optimizer (a table the
  dense optimizer updates would be read before its update), and
* no feature processor sits in front of an embedding (its parameters are trained by the
  dense optimizer and it runs inside the lookup that was moved ahead of that step).

Example::

    >>> check_pipeline_model(dmp_model, dense_optimizer, "fused_sparse_dist")  # raises
    PipelineModelError: fused_sparse_dist cannot train this model: ...
"""

from __future__ import annotations

from typing import List, Set, Tuple

import torch
from torch import nn
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollectionInterface,
    EmbeddingCollectionInterface,
)

# Both generations of TorchRec's feature processors, and the modules that hold them.
from torchrec.modules import feature_processor as _fp_old
from torchrec.modules import feature_processor_ as _fp_new
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor

_FEATURE_PROCESSOR_TYPES: Tuple[type, ...] = (
    FeatureProcessedEmbeddingBagCollection,
    _fp_new.FeatureProcessor,
    _fp_new.FeatureProcessorsCollection,
    _fp_old.BaseFeatureProcessor,
    _fp_old.BaseGroupedFeatureProcessor,
    BaseGroupedFeatureProcessor,
)


class PipelineModelError(ValueError):
    """The model cannot be trained correctly by the requested pipeline."""


def _is_embedding_module(module: nn.Module) -> bool:
    return isinstance(module, (ShardedModule, EmbeddingBagCollectionInterface,
                               EmbeddingCollectionInterface))


def _is_feature_processed(module: nn.Module) -> bool:
    if isinstance(module, _FEATURE_PROCESSOR_TYPES):
        return True
    # the sharded FP-EBC (and its quantised form) are not subclasses of the unsharded one
    return "FeatureProcessed" in type(module).__name__


def _embedding_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Outermost embedding modules (a sharded EBC's inner lookups are not listed again)."""
    found: List[Tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        if _is_embedding_module(module):
            found.append((name, module))
    return found


def _fused_optimizer_params(module: nn.Module) -> Set[int]:
    """Parameters a sharded module's ``fused_optimizer`` (a KeyedOptimizer) updates."""
    fused = getattr(module, "fused_optimizer", None)
    if fused is None:
        return set()
    ids = {id(p) for group in getattr(fused, "param_groups", []) for p in group["params"]}
    ids.update(id(p) for p in getattr(fused, "params", {}).values())
    return ids


def _dense_params(optimizer: torch.optim.Optimizer) -> Set[int]:
    ids: Set[int] = set()
    for group in getattr(optimizer, "param_groups", []):
        for p in group["params"]:
            ids.add(id(p))
    return ids


def check_pipeline_model(model: nn.Module, optimizer: torch.optim.Optimizer,
                         pipeline: str) -> None:
    """Raise :class:`PipelineModelError` if ``pipeline`` (a name for the message) would train
    ``model`` differently from the textbook loop: a feature processor anywhere in the model,
    or an embedding parameter that is not updated by a fused (in-backward) optimizer or that
    the dense ``optimizer`` also updates."""
    problems: List[str] = []
    for name, module in model.named_modules():
        if _is_feature_processed(module):
            problems.append(
                f"'{name or type(model).__name__}' ({type(module).__name__}) is a feature "
                "processor: its weights are trained by the dense optimizer, but the "
                "pipeline runs it for the next batch before that optimizer steps")
            break
    dense = _dense_params(optimizer)
    embeddings = _embedding_modules(model)
    for name, module in embeddings:
        fused = _fused_optimizer_params(module)
        for pname, p in module.named_parameters():
            if not p.requires_grad:
                continue
            full = f"{name}.{pname}" if name else pname
            if id(p) in dense:
                problems.append(f"embedding parameter '{full}' is updated by the dense "
                                "optimizer (after the next batch's lookup has read it)")
            elif not getattr(p, "_in_backward_optimizers", None) and id(p) not in fused:
                problems.append(
                    f"embedding parameter '{full}' has no optimizer fused into backward "
                    "(use torchrec.optim.apply_optimizer_in_backward, or a fused sharding "
                    "kernel; a data-parallel table trained by the dense optimizer is not "
                    "supported)")
    if problems:
        raise PipelineModelError(
            f"{pipeline} cannot train this model (it would train it silently wrong): "
            + "; ".join(problems)
            + ". Use the 'sparse_dist' or 'plain' pipeline for it.")


def uses_streams(device: torch.device) -> bool:
    """Whether TorchRec's pipelines create side streams on ``device`` (CUDA and MTIA)."""
    return device.type in ("cuda", "mtia")


__all__ = ["PipelineModelError", "check_pipeline_model", "uses_streams"]
