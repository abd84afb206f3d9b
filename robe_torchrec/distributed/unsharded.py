"""No TorchRec sharding entry point leaves a ROBE module unsharded.

A ROBE module that DMP does not shard stays a plain module inside DMP's DDP wrapper, where it
cannot train: its fused optimizer (``apply_optimizer_in_backward``) updates each rank's copy
on that rank's gradient alone and is missing from ``dmp.fused_optimizer``; on CPU, DDP's
backward dies with ``Cannot access accelerator device``; on the meta device its array is
re-created and the optimizer recorded on it is lost. That happens whenever the sharders lack
ours: TorchRec's ``get_default_sharders`` imported before :mod:`robe_torchrec` (the
``dlrm_main`` pattern), or a list built by hand, given to the planner or to DMP.

:func:`robe_torchrec.install` (run by ``import robe_torchrec``) therefore calls
:func:`install_dmp_check`, which wraps ``DistributedModelParallel.__init__`` (the class's, so
it holds whatever order things were imported in): before sharding, a ROBE module with no
sharder in ``sharders=``, or no entry in ``plan=``, raises :class:`UnshardedRobeModuleError`,
which names the module, the missing sharder and the one-line fix; after sharding, any ROBE
module still unsharded raises it too. Models without ROBE modules are not looked at twice.

TorchRec's composable entry points, ``torchrec.distributed.shard.shard_modules`` and
``shard``, cannot shard a ROBE module at all: after sharding they check that the model kept
every parameter, buffer and submodule name, and a sharded ROBE module keeps its array in
per-rank lookups, not in one ``weight`` (TorchRec's own sharded modules re-register dummy
tables to pass). Given sharders without ours, ``shard_modules`` would instead leave the
module unsharded, silently. :func:`install_shard_check` therefore makes both raise
:class:`UnshardedRobeModuleError` up front for a model with a ROBE module, naming the missing
sharder where it is missing, and the fix: ``DistributedModelParallel``.

A ROBE collection inside TorchRec's ``FeatureProcessedEmbeddingBagCollection`` is sharded by
the wrapper's sharder: DMP's check wants ours for the wrapper
(:class:`~robe_torchrec.distributed.fp_sharder.RobeFeatureProcessedEmbeddingBagCollectionSharder`),
and :func:`install_fp_sharder_check` makes TorchRec's own wrapper sharder refuse a ROBE
collection with the fix, where it would fail in the planner on a missing ``embedding_bags``.
A ROBE collection inside one of TorchRec's managed-collision modules (as
``ManagedCollisionEmbeddingCollection``) is refused by DMP's check, which says why and what
to use instead.

Example::

    >>> plan = planner.collective_plan(model, torchrec_default_sharders(), pg)
    >>> DistributedModelParallel(model, plan=plan)
    UnshardedRobeModuleError: ... plan with robe_torchrec.distributed.get_default_sharders() ...
    >>> shard_modules(model)
    UnshardedRobeModuleError: torchrec.distributed.shard.shard_modules cannot shard ...
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from robe_torchrec.array_module import RobeArrayModule
from robe_torchrec.distributed.fp_sharder import (
    RobeFeatureProcessedEmbeddingBagCollectionSharder,
    holds_robe,
    inner_collection,
)
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.embedding_collection import RobeEmbeddingCollection
from robe_torchrec.torchrec_compat import SHARD_IMPLEMENTATIONS

FIX = ("use robe_torchrec.distributed.get_default_sharders() (TorchRec's defaults plus ours) "
       "for the planner and DMP: planner.collective_plan(model, get_default_sharders(), pg), "
       "or add {sharder}() to your list")
#: the fix for a ROBE collection inside an FP-EBC whose sharder is TorchRec's
FP_FIX = ("use robe_torchrec.distributed.get_default_sharders() (TorchRec's defaults with "
          "RobeFeatureProcessedEmbeddingBagCollectionSharder in place of TorchRec's) for the "
          "planner and DMP, or put RobeFeatureProcessedEmbeddingBagCollectionSharder() in "
          "your list in its place")


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


def _consequence(module: RobeArrayModule, who: str = "DMP", where: str = " inside DDP") -> str:
    fused = bool(getattr(module.weight, "_optimizer_classes", None))
    return (f"{who} would leave it unsharded{where}, where it does not train"
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
    for path, module in found:
        _refuse_managed_collision(model, path, module)
    if sharders is not None:
        # DMP and the planner keep the last sharder of a module type
        types = {getattr(s, "module_type", None): s for s in sharders}
        for path, module in found:
            wrapper = _feature_processed_wrapper(model, path)
            if wrapper is not None and type(wrapper) in types:
                _check_wrapper_sharder(path.rsplit(".", 1)[0], wrapper, types[type(wrapper)])
                continue  # sharded with its wrapper, by the wrapper's sharder
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


def _feature_processed_wrapper(model: nn.Module, path: str) -> Optional[nn.Module]:
    """The FeatureProcessedEmbeddingBagCollection whose collection is the ROBE module at
    ``path``, if that is what holds it."""
    if "." not in path:
        return None
    parent = model.get_submodule(path.rsplit(".", 1)[0])
    return parent if holds_robe(parent) else None


def _refuse_managed_collision(model: nn.Module, path: str, module: nn.Module) -> None:
    """Raise :class:`UnshardedRobeModuleError` if the ROBE module at ``path`` is the
    collection of one of TorchRec's managed-collision modules."""
    if "." not in path:
        return
    parent_path = path.rsplit(".", 1)[0]
    parent = model.get_submodule(parent_path)
    if isinstance(parent, BaseManagedCollisionEmbeddingCollection):
        raise UnshardedRobeModuleError(
            f"DistributedModelParallel: {_describe(parent_path, parent)} holds "
            f"{_describe(path, module)}. TorchRec shards a managed-collision module's "
            "collection as a stock one, with tables whose rows it resets when it evicts an "
            "id; a ROBE module has no rows of its own (every row is read from one hashed "
            "array), so it cannot be sharded there. Fix: drop the managed-collision module "
            "and give the ROBE module the raw ids: it hashes any 64-bit id itself with "
            'RobeConfig(bounds_check="unbounded", hash="mix")')


def _check_wrapper_sharder(path: str, wrapper: nn.Module, sharder: Any) -> None:
    """Raise :class:`UnshardedRobeModuleError` unless ``sharder``, the one DMP would use for
    the FP-EBC ``wrapper``, can shard the ROBE collection inside it."""
    if isinstance(sharder, RobeFeatureProcessedEmbeddingBagCollectionSharder):
        return
    raise UnshardedRobeModuleError(
        f"DistributedModelParallel: sharders= shards {_describe(path, wrapper)} with "
        f"{type(sharder).__name__}, which cannot shard the ROBE collection inside it. Fix: "
        + FP_FIX)


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


def install_dmp_check() -> bool:
    """Make ``DistributedModelParallel`` refuse to leave a ROBE module unsharded (module
    docstring); True once it does. Idempotent; called by :func:`robe_torchrec.install` only.

    Example::

        >>> install_dmp_check()
        True
        >>> hasattr(DistributedModelParallel.__init__, "robe_wraps")
        True
    """
    cls = DistributedModelParallel
    if not hasattr(cls.__init__, "robe_wraps"):
        cls.__init__ = _wrap_init(cls.__init__)  # type: ignore[method-assign]
    return True


# --- torch's DistributedDataParallel -----------------------------------------------------

DDP_FIX = ("shard it with DistributedModelParallel(model, sharders=robe_torchrec.distributed"
           ".get_default_sharders()), whose data_parallel plan averages the array's gradient "
           "over the ranks before the fused update, or train it under DDP on dense gradients "
           "(no apply_optimizer_in_backward: DDP then averages the array's gradient as any "
           "parameter's)")


def check_data_parallel(model: nn.Module) -> None:
    """Raise :class:`UnshardedRobeModuleError` if ``DistributedDataParallel(model)`` holds a
    ROBE module with an in-backward optimizer: that optimizer updates each rank's array from
    the rank's own batch inside backward, the array never has a gradient for DDP to average,
    and the ranks' arrays drift apart with no error."""
    for path, module in robe_modules(model):
        if getattr(module.weight, "_optimizer_classes", None):
            raise UnshardedRobeModuleError(
                f"DistributedDataParallel: {_describe(path, module)} has an in-backward "
                "optimizer (apply_optimizer_in_backward), which updates each rank's copy of "
                "the array from that rank's batch alone: DDP never sees a gradient of it, "
                "and the ranks' arrays would drift apart. Fix: " + DDP_FIX)


def _checking_new(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DistributedDataParallel.__new__`` that checks the model first. ``__new__``, not
    ``__init__``: the warnings DDP's ``__init__`` gives (deprecated arguments) then still
    name the line that built it, not this wrapper."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("module")
        if isinstance(model, nn.Module):
            check_data_parallel(model)
        if original is object.__new__:  # it takes no arguments beyond the class
            return original(cls)
        return original(cls, *args, **kwargs)

    __new__.robe_wraps = original  # type: ignore[attr-defined]
    return __new__


def install_ddp_check() -> bool:
    """Make ``torch.nn.parallel.DistributedDataParallel`` refuse a ROBE module with an
    in-backward optimizer (:func:`check_data_parallel`); True once it does. DMP's own DDP
    wrapper is not affected: it wraps a model whose ROBE modules are sharded. Idempotent;
    called by :func:`robe_torchrec.install` only.

    Example::

        >>> install_ddp_check()
        True
        >>> hasattr(DistributedDataParallel.__new__, "robe_wraps")
        True
    """
    cls = DistributedDataParallel
    if not hasattr(cls.__new__, "robe_wraps"):
        cls.__new__ = staticmethod(_checking_new(cls.__new__))  # type: ignore[method-assign]
    return True


# --- torchrec.distributed.shard: shard_modules and shard ---------------------------------

#: the module whose public shard / shard_modules call the wrapped functions
SHARD_MODULE = "torchrec.distributed.shard"

#: wrapped function -> (the public function a user calls, its argument naming the sharders)
_ENTRY_POINTS: Dict[str, Tuple[str, str]] = {
    "_shard": (f"{SHARD_MODULE}.shard", "sharder"),
    "_shard_modules": (f"{SHARD_MODULE}.shard_modules", "sharders"),
}

_NAMES_KEPT = ("after sharding it checks that the model kept every parameter, buffer and "
               "submodule name, and a sharded ROBE module keeps its array in per-rank lookups "
               "instead of one weight")


def check_composable_sharding(api: str, model: nn.Module, argument: str,
                              sharders: Optional[List[Any]]) -> None:
    """Raise :class:`UnshardedRobeModuleError` if ``model`` has an unsharded ROBE module:
    ``api`` (TorchRec's ``shard`` or ``shard_modules``) cannot shard it (module docstring).
    ``sharders``: what the caller gave as ``argument`` (None: the defaults, which have ours).
    """
    found = robe_modules(model)
    if not found:
        return
    path, module = found[0]
    sharder = sharder_name(module)
    described = _describe(path, module)
    if sharders is not None and type(module) not in {getattr(s, "module_type", None)
                                                      for s in sharders}:
        if argument == "sharders":  # shard_modules skips a module it has no sharder for
            missing = (f"sharders= has no {sharder} for {described}, so "
                       + _consequence(module, api.rsplit(".", 1)[1], ""))
        else:
            missing = f"sharder= is {type(sharders[0]).__name__}, not {sharder}, for {described}"
        why = f"{api}: {missing}; and even with {sharder} it cannot shard it: {_NAMES_KEPT}"
    else:
        why = f"{api} cannot shard {described}: {_NAMES_KEPT}"
    raise UnshardedRobeModuleError(
        f"{why}. Fix: DistributedModelParallel(model, sharders=robe_torchrec.distributed"
        f".get_default_sharders()) in place of {api}; that list has {sharder}")


def _wrap_composable(original: Callable[..., Any], api: str,
                     argument: str) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # let TorchRec report its own argument errors
            bound = {}
        model = bound.get("module")
        if isinstance(model, nn.Module):
            given = bound.get(argument)
            sharders = [given] if argument == "sharder" and given is not None else given
            check_composable_sharding(api, model, argument, sharders)
        return original(*args, **kwargs)

    wrapper.robe_wraps = original  # type: ignore[attr-defined]
    return wrapper


def install_shard_check() -> bool:
    """Make ``torchrec.distributed.shard.shard_modules`` and ``shard`` refuse a model with a
    ROBE module (module docstring); True once both do (False on a release without the
    functions they call, :data:`~robe_torchrec.torchrec_compat.SHARD_IMPLEMENTATIONS`).
    Wraps those functions in their module, where the public ones look them up at each call,
    so it holds whatever order things were imported in. Idempotent; called by
    :func:`robe_torchrec.install` only.

    Example::

        >>> install_shard_check()
        True
    """
    module = importlib.import_module(SHARD_MODULE)
    wrapped = 0
    for name in SHARD_IMPLEMENTATIONS:
        current = getattr(module, name, None)
        if current is None:
            continue
        if not hasattr(current, "robe_wraps"):
            setattr(module, name, _wrap_composable(current, *_ENTRY_POINTS[name]))
        wrapped += 1
    return wrapped == len(SHARD_IMPLEMENTATIONS)


# --- TorchRec's FeatureProcessedEmbeddingBagCollectionSharder ------------------------

def _refuse_robe(original, action: str):
    @functools.wraps(original)
    def method(self, module, *args, **kwargs):
        if holds_robe(module):
            raise UnshardedRobeModuleError(
                f"TorchRec's {type(self).__name__} cannot {action} the "
                f"{type(inner_collection(module)).__name__} inside this "
                "FeatureProcessedEmbeddingBagCollection: it hands the collection to "
                "TorchRec's EmbeddingBagCollectionSharder. Fix: " + FP_FIX)
        return original(self, module, *args, **kwargs)

    method.robe_wraps = original  # type: ignore[attr-defined]
    return method


def install_fp_sharder_check() -> bool:
    """Make TorchRec's ``FeatureProcessedEmbeddingBagCollectionSharder`` refuse an FP-EBC
    around a ROBE module with :class:`~robe_torchrec.distributed.UnshardedRobeModuleError`
    (naming the fix), where it would fail on a missing ``embedding_bags`` in the planner or
    in DMP. Our subclass overrides both methods, so it is not affected. True once installed;
    idempotent; called by :func:`robe_torchrec.install` only.

    Example::

        >>> install_fp_sharder_check()
        True
    """
    cls = FeatureProcessedEmbeddingBagCollectionSharder
    for name, action in (("shardable_parameters", "plan"), ("shard", "shard")):
        current = getattr(cls, name)
        if not hasattr(current, "robe_wraps"):
            setattr(cls, name, _refuse_robe(current, action))
    return True
