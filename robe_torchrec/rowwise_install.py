"""TorchRec's own ``torchrec.optim.RowWiseAdagrad`` on ROBE arrays.

``apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, model.parameters(), {...})`` is
how TorchRec users attach FBGEMM's EXACT_ROWWISE_ADAGRAD, and torchrec's constructor sizes
its state as ``[rows, 1]`` from a 2-D table: on the 1-D ROBE array it raises ``IndexError``
before any ROBE code runs. :func:`robe_torchrec.install` (run by ``import robe_torchrec``)
therefore calls :func:`install_rowwise_adagrad`, which wraps the class's ``__init__`` and ``step`` (the class
object itself, so ``resolve_optimizer`` still maps it to the fused row-wise Adagrad):

* a parameter that **is a ROBE array** (the current ``weight`` of a live
  ``RobeEmbeddingBagCollection`` / ``RobeEmbeddingCollection`` or of a sharded lookup, see
  :func:`is_robe_array`) gets no state in the optimizer (the module's ``fused_optimizer``
  keeps the row-wise state, one accumulator per ``block_size`` floats) and ``step`` refuses
  to update it (the fused backward does);
* **every other parameter** is handled by torchrec's unchanged code: an optimizer with no ROBE
  array among its parameters runs torchrec's ``__init__`` and ``step`` as they are, and in a
  mixed one the other parameters get torchrec's state and update.

Which tensors are arrays is asked of the modules rather than recorded on the tensors, so the
answer follows the module when it re-creates its weight (``to_empty``, ``.to(dtype)``,
``load_state_dict(assign=True)``, a copy).

Example::

    >>> import robe_torchrec        # robe_torchrec.install() installs the wrapper
    >>> apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    >>> ebc(kjt).values().sum().backward()          # fused row-wise Adagrad updated ebc.weight
    >>> ebc.fused_optimizer.param_state["sum"].shape  # one accumulator per block_size floats
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, List, Tuple

import torch
import torchrec.optim
from torch import nn

_ARRAY_OWNERS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class ArrayOwner(nn.Module):
    """Base of the modules whose ``weight`` is a ROBE array: they are registered when built
    (:meth:`register_array`) and again when unpickled or deep-copied (a copy is built
    without ``__init__``)."""

    def register_array(self) -> None:
        """From now on, whatever tensor is ``self.weight`` is a ROBE array."""
        _ARRAY_OWNERS.add(self)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.register_array()


def is_robe_array(tensor: Any) -> bool:
    """Whether ``tensor`` is the current ``weight`` of a live ROBE module or sharded lookup.

    Example::

        >>> is_robe_array(ebc.weight), is_robe_array(torch.nn.Parameter(torch.zeros(3)))
        (True, False)
    """
    if not isinstance(tensor, torch.Tensor):
        return False
    return any(getattr(owner, "weight", None) is tensor for owner in list(_ARRAY_OWNERS))


# --- the shared behaviour of torchrec's class (patched) and robe_torchrec.optim's subclass ---

def _entries(group: Any) -> List[Any]:
    params = group["params"] if isinstance(group, dict) else group
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _tensor(entry: Any) -> Any:
    return entry[1] if isinstance(entry, tuple) else entry  # (name, tensor) or tensor


def init_without_arrays(optimizer: torch.optim.Optimizer, params: Any, args: Tuple[Any, ...],
                        kwargs: Dict[str, Any], is_array: Callable[[Any], bool],
                        torchrec_init: Callable[..., None]) -> None:
    """Run torchrec's ``RowWiseAdagrad.__init__`` (``torchrec_init``) on ``params`` with the
    arrays (``is_array``) left out of its state, then put them back in their param groups:
    every other parameter gets exactly torchrec's state, and the arrays none."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    groups = ([dict(g) for g in params] if params and isinstance(params[0], dict)
              else [{"params": params}])
    entries = [_entries(g) for g in groups]
    arrays = [_tensor(e) for es in entries for e in es if is_array(_tensor(e))]
    if not arrays:
        torchrec_init(optimizer, params, *args, **kwargs)
        return
    kept = [{**g, "params": [e for e in es if not is_array(_tensor(e))]}
            for g, es in zip(groups, entries)]
    torchrec_init(optimizer, kept, *args, **kwargs)
    for group, es in zip(optimizer.param_groups, entries):
        group["params"] = [_tensor(e) for e in es]
        if "param_names" in group:
            group["param_names"] = [e[0] for e in es]
    optimizer.robe_arrays = {id(a) for a in arrays}  # type: ignore[attr-defined]


def refuse_array_grads(optimizer: torch.optim.Optimizer, owner: str) -> None:
    """Raise if ``step`` would have to update an array: the fused backward does that."""
    arrays = getattr(optimizer, "robe_arrays", ())
    if any(id(p) in arrays and p.grad is not None
           for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError(f"{owner}: a ROBE array is updated inside backward by its module "
                           "(RobeEmbeddingBagCollection.fused_optimizer holds the row-wise "
                           "state), not by step(); call apply_optimizer_in_backward on the "
                           "module's parameters and leave them out of dense optimizers")


# --- the install ------------------------------------------------------------------------

def _wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        init_without_arrays(self, params, args, kwargs, is_robe_array, original)

    __init__.robe_wraps = original  # type: ignore[attr-defined]
    return __init__


def _wrap_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self, closure: Any = None) -> Any:
        refuse_array_grads(self, "torchrec.optim.RowWiseAdagrad")
        return original(self, closure)

    # functools.wraps copied original's attributes, "hooked" included: torch.optim wraps a
    # class's step with its profiling hooks once and marks it so; a hooked original keeps
    # them from being added twice
    step.robe_wraps = original  # type: ignore[attr-defined]
    return step


def torchrec_init() -> Callable[..., None]:
    """torchrec's own ``RowWiseAdagrad.__init__``, whether or not the wrapper is installed."""
    init = torchrec.optim.RowWiseAdagrad.__init__
    return getattr(init, "robe_wraps", init)


def install_rowwise_adagrad() -> bool:
    """Make ``torchrec.optim.RowWiseAdagrad`` accept ROBE arrays (module docstring); True
    once the wrapper is in place. Idempotent; called by :func:`robe_torchrec.install` only.

    Example::

        >>> install_rowwise_adagrad()
        True
        >>> hasattr(torchrec.optim.RowWiseAdagrad.__init__, "robe_wraps")
        True
    """
    cls = torchrec.optim.RowWiseAdagrad
    if not hasattr(cls.__init__, "robe_wraps"):
        cls.__init__ = _wrap_init(cls.__init__)  # type: ignore[method-assign]
    if not hasattr(cls.step, "robe_wraps"):
        cls.step = _wrap_step(cls.step)  # type: ignore[method-assign]
    return True
