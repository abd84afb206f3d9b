"""``DistributedModelParallel`` never leaves a ROBE module unsharded.

A ROBE module that DMP does not shard stays a plain module inside DMP's DDP wrapper, where it
cannot train: its fused optimizer (``apply_optimizer_in_backward``) updates each rank's copy
on that rank's gradient alone and is missing from ``dmp.fused_optimizer``; on CPU, DDP's
backward dies with ``Cannot access accelerator device``; on the meta device its array is
re-created and the optimizer recorded on it is lost. That happens whenever the sharders lack
ours: TorchRec's ``get_default_sharders`` imported before :mod:`robe_torchrec` (the
``dlrm_main`` pattern), or a list built by hand, given to the planner or to DMP.

Importing :mod:`robe_torchrec.distributed` (which ``import robe_torchrec`` does) therefore
wraps ``DistributedModelParallel.__init__`` (the class's, so it holds whatever order things
were imported in): before sharding, a ROBE module with no sharder in ``sharders=``, or no
entry in ``plan=``, raises :class:`UnshardedRobeModuleError`, which names the module, the
missing sharder and the one-line fix; after sharding, any ROBE module still unsharded raises
it too. Models without ROBE modules are not looked at twice.

Example::

    >>> plan = planner.collective_plan(model, torchrec_default_sharders(), pg)
    >>> DistributedModelParallel(model, plan=plan)
    UnshardedRobeModuleError: ... plan with robe_torchrec.distributed.get_default_sharders() ...
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, List, Optional, Tuple

from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel

from robe_torchrec.array_module import RobeArrayModule
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.embedding_collection import RobeEmbeddingCollection

FIX = ("use robe_torchrec.distributed.get_default_sharders() (TorchRec's defaults plus ours) "
       "for the planner and DMP: planner.collective_plan(model, get_default_sharders(), pg), "
       "or add {sharder}() to your list")


class UnshardedRobeModuleError(ValueError):
    """``DistributedModelParallel`` would leave a ROBE module unsharded (see the module
    docstring)."""


def robe_modules(model: nn.Module) -> List[Tuple[str, RobeArrayModule]]:
    """``(path, module)`` of every unsharded ROBE module in ``model``."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, RobeArrayModule)]


def sharder_name(module: nn.Module) -> str:
    """The name of the sharder that shards ``module``'s kind of ROBE module."""
    if isinstance(module, RobeEmbeddingCollection):
        return "RobeEmbeddingCollectionSharder"
    return "RobeEmbeddingBagCollectionSharder"


def _consequence(module: RobeArrayModule) -> str:
    fused = bool(getattr(module.weight, "_optimizer_classes", None))
    return ("DMP would leave it unsharded inside DDP, where it does not train"
            + (" (its fused optimizer would never step as a sharded one)" if fused else ""))


def _describe(path: str, module: nn.Module) -> str:
    name = type(module).__name__
    return f"{name} {path!r}" if path else f"{name} (the model itself)"


def check_before_sharding(model: nn.Module, plan: Any, sharders: Optional[List[Any]]) -> None:
    """Raise :class:`UnshardedRobeModuleError` if ``DistributedModelParallel(model, plan=plan,
    sharders=sharders)`` would leave a ROBE module of ``model`` unsharded."""
    found = robe_modules(model)
    if not found:
        return
    if sharders is not None:
        types = {getattr(s, "module_type", None) for s in sharders}
        for path, module in found:
            if type(module) not in types:
                sharder = sharder_name(module)
                exact = ("" if type(module) in (RobeEmbeddingBagCollection,
                                                RobeEmbeddingCollection)
                         else f" (DMP matches the exact type {type(module).__name__}: give a "
                              "sharder whose module_type is that class)")
                raise UnshardedRobeModuleError(
                    f"DistributedModelParallel: sharders= has no {sharder} for "
                    f"{_describe(path, module)}{exact}, so {_consequence(module)}. Fix: "
                    + FIX.format(sharder=sharder))
    if plan is not None:
        planned = set(getattr(plan, "plan", {}) or {})
        for path, module in found:
            prefixes = {path.rsplit(".", i)[0] for i in range(path.count(".") + 1)} | {""}
            if not planned & prefixes:
                sharder = sharder_name(module)
                raise UnshardedRobeModuleError(
                    f"DistributedModelParallel: the plan has no entry for "
                    f"{_describe(path, module)}: it was planned with sharders that lack {sharder} "
                    "(TorchRec's get_default_sharders() imported before robe_torchrec, or a "
                    f"list built by hand), so {_consequence(module)}. Fix: "
                    + FIX.format(sharder=sharder))


def check_after_sharding(dmp: DistributedModelParallel) -> None:
    """Raise :class:`UnshardedRobeModuleError` if a ROBE module is still unsharded in ``dmp``."""
    found = robe_modules(dmp.module)
    if found:
        path, module = found[0]
        sharder = sharder_name(module)
        raise UnshardedRobeModuleError(
            f"DistributedModelParallel left {_describe(path, module)} unsharded, so "
            f"{_consequence(module)}. Fix: " + FIX.format(sharder=sharder))


def _wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs).arguments
        except TypeError:  # let DMP report its own argument errors
            bound = {}
        model = bound.get("module")
        if isinstance(model, nn.Module):
            check_before_sharding(model, bound.get("plan"), bound.get("sharders"))
        original(self, *args, **kwargs)
        if isinstance(model, nn.Module):
            check_after_sharding(self)

    __init__.robe_wraps = original  # type: ignore[attr-defined]
    return __init__


def install_dmp_check() -> None:
    """Make ``DistributedModelParallel`` refuse to leave a ROBE module unsharded (module
    docstring). Idempotent; done on import of :mod:`robe_torchrec.distributed`.

    Example::

        >>> install_dmp_check()
        >>> hasattr(DistributedModelParallel.__init__, "robe_wraps")
        True
    """
    cls = DistributedModelParallel
    if not hasattr(cls.__init__, "robe_wraps"):
        cls.__init__ = _wrap_init(cls.__init__)  # type: ignore[method-assign]
