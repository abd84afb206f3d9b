"""Fused (in-backward) optimizers for ROBE arrays, exposed as TorchRec ``FusedOptimizer``.

The update itself runs inside ``robe::backward_fused_`` (or, for data-parallel arrays,
:func:`robe_torchrec.ops.dense_update.apply_dense_update_`); this class only holds what it
needs (hyper-parameters in ``param_groups``, so LR schedulers work, and the state tensors,
named as ``torch.optim`` names them) and translates a ``torch.optim`` class plus kwargs,
as ``apply_optimizer_in_backward`` records them, into the op's arguments.

Example::

    >>> from torchrec.optim import apply_optimizer_in_backward
    >>> apply_optimizer_in_backward(torch.optim.Adagrad, robe_ebc.parameters(), {"lr": 0.05})
    >>> robe_ebc(kjt).values().sum().backward()     # the array is updated here
    >>> robe_ebc.fused_optimizer.param_groups[0]["lr"] = 0.01   # takes effect next backward
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple, Type

import torch
from torchrec.optim.fused import FusedOptimizer

from robe_torchrec.ops.meta import Optimizer

_SUPPORTED: Dict[Type[torch.optim.Optimizer], Optimizer] = {
    torch.optim.SGD: Optimizer.SGD,
    torch.optim.Adagrad: Optimizer.ADAGRAD,
    torch.optim.Adam: Optimizer.ADAM,
}

# kwargs we accept only at their torch.optim default value (anything else is refused
# rather than silently ignored)
_FIXED_DEFAULTS: Dict[Optimizer, Dict[str, Any]] = {
    Optimizer.SGD: {"momentum": 0, "dampening": 0, "nesterov": False, "maximize": False},
    Optimizer.ADAGRAD: {"lr_decay": 0, "maximize": False},
    Optimizer.ADAM: {"amsgrad": False, "maximize": False},
}
_TUNABLE = {
    Optimizer.SGD: {"lr", "weight_decay"},
    Optimizer.ADAGRAD: {"lr", "eps", "weight_decay", "initial_accumulator_value"},
    Optimizer.ADAM: {"lr", "eps", "betas", "weight_decay"},
}
_IGNORED = {"foreach", "fused", "differentiable", "capturable"}


def resolve_optimizer(optimizer_class: Type[torch.optim.Optimizer], kwargs: Dict[str, Any]) -> Optimizer:
    """Which fused kernel implements ``optimizer_class(**kwargs)``; raises if none does."""
    kind = _SUPPORTED.get(optimizer_class)
    if kind is None:
        names = ", ".join(c.__name__ for c in _SUPPORTED)
        raise ValueError(f"robe_torchrec: no fused kernel for {optimizer_class.__name__}; "
                         f"supported: {names}")
    for key, value in kwargs.items():
        if key in _IGNORED or key in _TUNABLE[kind]:
            continue
        if key in _FIXED_DEFAULTS[kind]:
            if value != _FIXED_DEFAULTS[kind][key]:
                raise ValueError(f"robe_torchrec: fused {optimizer_class.__name__} supports "
                                 f"{key}={_FIXED_DEFAULTS[kind][key]!r} only, got {value!r}")
            continue
        raise ValueError(f"robe_torchrec: unknown {optimizer_class.__name__} argument {key!r}")
    return kind


class RobeFusedOptimizer(FusedOptimizer):
    """The optimizer applied to a ROBE array inside backward (SGD, Adagrad or Adam).

    ``step()`` and ``zero_grad()`` do nothing: the update already happened in backward.
    State keys follow ``torch.optim``: Adagrad ``sum``; Adam ``exp_avg``, ``exp_avg_sq``;
    both keep ``step``.
    """

    def __init__(
        self,
        param_key: str,
        param: torch.Tensor,
        optimizer_class: Type[torch.optim.Optimizer],
        optimizer_kwargs: Dict[str, Any],
    ) -> None:
        self.kind = resolve_optimizer(optimizer_class, optimizer_kwargs)
        self.optimizer_class = optimizer_class
        defaults = optimizer_class([torch.zeros(1)], **optimizer_kwargs).defaults
        group: Dict[str, Any] = {"params": [param]}
        group.update({k: v for k, v in defaults.items() if k in _TUNABLE[self.kind]})
        state: Dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if self.kind == Optimizer.ADAGRAD:
                state["sum"] = torch.full_like(param, float(group.get("initial_accumulator_value", 0.0)))
            elif self.kind == Optimizer.ADAM:
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            if self.kind != Optimizer.SGD:
                state["step"] = torch.tensor(0.0)
        super().__init__({param_key: param}, {param: state}, [group])
        self._param = param
        self._empty = param.new_empty(0)

    def step(self, closure: Any = None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    @property
    def param(self) -> torch.Tensor:
        """The ROBE array this optimizer updates."""
        return self._param

    @property
    def param_state(self) -> Dict[str, torch.Tensor]:
        """The array's state, keyed as ``torch.optim`` keys it (``sum``; ``exp_avg``,
        ``exp_avg_sq``; ``step``); empty for SGD."""
        return self.state[self._param]

    def _group(self) -> Dict[str, Any]:
        return next(iter(self.param_groups))

    def hparams(self) -> List[float]:
        """``[lr, eps, beta1, beta2, weight_decay]`` as the op takes them, read at each call."""
        group = self._group()
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        return [float(group["lr"]), float(group.get("eps", 1e-10)), float(beta1), float(beta2),
                float(group.get("weight_decay", 0.0))]

    def state_tensors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(state1, state2)`` as the fused op takes them (unused ones empty)."""
        state = self.param_state
        if self.kind == Optimizer.ADAGRAD:
            return state["sum"], self._empty
        if self.kind == Optimizer.ADAM:
            return state["exp_avg"], state["exp_avg_sq"]
        return self._empty, self._empty

    def advance_step(self) -> int:
        """Count one more update and return its 1-based number (Adam's bias correction)."""
        state = self.param_state
        if "step" not in state:
            return 1
        state["step"] += 1
        return int(state["step"].item())
