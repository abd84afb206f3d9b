"""Fused (in-backward) optimizers for ROBE arrays, exposed as TorchRec ``FusedOptimizer``.

The update itself runs inside ``robe::backward_fused_`` (or, for data-parallel arrays,
:func:`robe_torchrec.ops.dense_update.apply_dense_update_`); this class only holds what it
needs (hyper-parameters in ``param_groups``, so LR schedulers work, and the state tensors,
named as ``torch.optim`` names them) and translates a ``torch.optim`` class plus kwargs,
as ``apply_optimizer_in_backward`` records them, into the op's arguments.

Supported: ``torch.optim.SGD`` (no momentum), ``torch.optim.Adagrad``, ``torch.optim.Adam``
and row-wise Adagrad (``torchrec.optim.RowWiseAdagrad``, FBGEMM's EXACT_ROWWISE_ADAGRAD: one
accumulator per aligned chunk of ``block_size`` floats of the array, see
:class:`~robe_torchrec.ops.meta.Optimizer`). ``apply_optimizer_in_backward`` builds the
optimizer on the parameter: torchrec's class accepts a ROBE array once :mod:`robe_torchrec`
is imported (:mod:`robe_torchrec.rowwise_install`); the subclass :class:`RowWiseAdagrad`
here does the same and is kept for code that passes it (everything takes either class).

The state follows the array: its tensors are kept in the array's accumulation dtype (float32
for float32/float16/bfloat16 arrays, float64 for float64) on its device, and converted when
``module.to(...)`` moved or cast the array since the last step. ``step`` lives with the array
too, except Adam's without ``capturable=True``, which stays on the CPU as ``torch.optim``
keeps it (see :class:`RobeFusedOptimizer`).

Example::

    >>> from torchrec.optim import apply_optimizer_in_backward
    >>> apply_optimizer_in_backward(torch.optim.Adagrad, robe_ebc.parameters(), {"lr": 0.05})
    >>> robe_ebc(kjt).values().sum().backward()     # the array is updated here
    >>> robe_ebc.fused_optimizer.param_groups[0]["lr"] = 0.01   # takes effect next backward

The fused ops read the rate from a tensor that the param group keeps in step with ``"lr"``
(:class:`~robe_torchrec.rate_group.RateGroup`): a scheduler's new rate costs a compiled
backward no recompile, and a CUDA graph's replays step with it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Type, Union

import torch
import torchrec.optim
from torchrec.optim.fused import FusedOptimizer

from robe_torchrec.ops.deferred_checks import raise_ready
from robe_torchrec.ops.dense_update import apply_dense_update_
from robe_torchrec.ops.meta import Optimizer, accumulation_dtype, rowwise_state_size
from robe_torchrec.rate_group import RateGroup
from robe_torchrec.rowwise_install import init_without_arrays, refuse_array_grads, torchrec_init


class RowWiseAdagrad(torchrec.optim.RowWiseAdagrad):
    """torchrec's ``RowWiseAdagrad`` that treats every 1-D parameter as a ROBE array.

    Since importing :mod:`robe_torchrec` lets torchrec's own class take ROBE arrays
    (:mod:`robe_torchrec.rowwise_install`), this subclass is no longer needed; it stays for
    code that passes it, and behaves alike: no state for an array (the module's
    ``fused_optimizer`` holds the row-wise state, the array has rows of ``block_size`` floats
    that only the layout knows), ``step`` refuses to update one, and 2-D parameters get
    torchrec's state and update."""

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        init_without_arrays(self, params, args, kwargs, lambda p: p.dim() < 2,
                            torchrec_init())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        refuse_array_grads(self, "robe_torchrec.optim.RowWiseAdagrad")
        return super().step(closure)


_SUPPORTED: Dict[Type[torch.optim.Optimizer], Optimizer] = {
    torch.optim.SGD: Optimizer.SGD,
    torch.optim.Adagrad: Optimizer.ADAGRAD,
    torch.optim.Adam: Optimizer.ADAM,
    RowWiseAdagrad: Optimizer.ROWWISE_ADAGRAD,
    torchrec.optim.RowWiseAdagrad: Optimizer.ROWWISE_ADAGRAD,
}
SUPPORTED_NAMES = ("torch.optim.SGD (momentum=0), torch.optim.Adagrad (lr_decay=0), "
                   "torch.optim.Adam (amsgrad=False), torchrec.optim.RowWiseAdagrad (lr_decay=0)")

# kwargs we accept only at their torch.optim default value (anything else is refused
# rather than silently ignored)
_FIXED_DEFAULTS: Dict[Optimizer, Dict[str, Any]] = {
    Optimizer.SGD: {"momentum": 0, "dampening": 0, "nesterov": False, "maximize": False},
    Optimizer.ADAGRAD: {"lr_decay": 0, "maximize": False},
    Optimizer.ADAM: {"amsgrad": False, "maximize": False},
    Optimizer.ROWWISE_ADAGRAD: {"lr_decay": 0, "maximize": False},
}
_TUNABLE = {
    Optimizer.SGD: {"lr", "weight_decay"},
    Optimizer.ADAGRAD: {"lr", "eps", "weight_decay", "initial_accumulator_value"},
    Optimizer.ADAM: {"lr", "eps", "betas", "weight_decay"},
    Optimizer.ROWWISE_ADAGRAD: {"lr", "eps", "weight_decay", "initial_accumulator_value"},
}
_IGNORED = {"foreach", "fused", "differentiable"}
# kwargs honoured for every optimizer that takes them (see RobeFusedOptimizer)
_FLAGS = {"capturable"}


def in_backward_kwargs(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of the kwargs ``apply_optimizer_in_backward`` recorded on a parameter, in
    ``torch.optim``'s spelling.

    ``apply_optimizer_in_backward(cls, model.parameters(), kwargs)`` records the *same* dict
    on every parameter, and TorchRec's sharders edit it in place when they shard a stock
    table: they add ``optimizer`` (an ``EmbOptimType``) and rename ``lr`` to
    ``learning_rate``. A ROBE array sharing the dict with a stock table sharded before it
    then sees those keys: they are read back here (``learning_rate`` as ``lr``, ``optimizer``
    dropped) instead of being refused as unknown arguments.

    Example::

        >>> in_backward_kwargs({"learning_rate": 0.1, "optimizer": EmbOptimType.EXACT_ADAGRAD})
        {'lr': 0.1}
    """
    out = {k: v for k, v in kwargs.items() if k not in ("optimizer", "learning_rate")}
    if "learning_rate" in kwargs and "lr" not in out:
        out["lr"] = kwargs["learning_rate"]
    return out


def resolve_optimizer(optimizer_class: Type[torch.optim.Optimizer], kwargs: Dict[str, Any]) -> Optimizer:
    """Which fused kernel implements ``optimizer_class(**kwargs)``; raises if none does."""
    kind = _SUPPORTED.get(optimizer_class)
    name = getattr(optimizer_class, "__qualname__", repr(optimizer_class))
    if kind is None:
        module = getattr(optimizer_class, "__module__", "")
        raise ValueError(f"robe_torchrec: no fused kernel for {module}.{name}; "
                         f"supported: {SUPPORTED_NAMES}")
    for key, value in kwargs.items():
        if key in _IGNORED or key in _FLAGS or key in _TUNABLE[kind]:
            continue
        if key in _FIXED_DEFAULTS[kind]:
            if value != _FIXED_DEFAULTS[kind][key]:
                raise ValueError(f"robe_torchrec: fused {name} supports "
                                 f"{key}={_FIXED_DEFAULTS[kind][key]!r} only, got {value!r} "
                                 f"(supported: {SUPPORTED_NAMES})")
            continue
        raise ValueError(f"robe_torchrec: unknown {name} argument {key!r}")
    return kind


def _hparams_but_rate(group: Dict[str, Any]) -> List[float]:
    """``[eps, beta1, beta2, weight_decay]`` of a param group, the defaults where absent."""
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    return [float(group.get("eps", 1e-10)), float(beta1), float(beta2),
            float(group.get("weight_decay", 0.0))]


class RobeFusedOptimizer(FusedOptimizer):
    """The optimizer applied to a ROBE array inside backward (SGD, Adagrad, Adam or row-wise
    Adagrad).

    ``step()`` and ``zero_grad()`` change nothing: the update already happened in backward.
    ``step()``, which TorchRec's train loops call every iteration, reads the GPU's input
    checks that have finished (no wait), so that bad input replayed in a CUDA graph raises
    there (:func:`robe_torchrec.ops.deferred_checks.raise_ready`).
    State keys follow ``torch.optim`` / torchrec: Adagrad ``sum``; Adam ``exp_avg``,
    ``exp_avg_sq``; row-wise Adagrad ``sum`` of ``ceil(M / block_size)`` rows; all keep
    ``step``. ``block_size`` (the layout's) is needed by row-wise Adagrad only.

    ``step`` is a float32 scalar tensor. Where it lives decides whether a CUDA graph replay
    counts it:

    * Adagrad and row-wise Adagrad (whose update never reads it: ``lr_decay`` is 0) keep it
      on the array's device, as FBGEMM's fused tables keep their counters. On CUDA it is
      advanced there by ``robe::counted_backward_fused_`` and never read by the host, so a
      captured backward (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``)
      advances it at every replay, and a compiled backward has no CPU input.
    * Adam keeps it on the CPU, as ``torch.optim`` does, unless the kwargs say
      ``capturable=True`` (as ``torch.optim.Adam(..., capturable=True)``): then it lives on
      the array's device (and follows it), counted there and read by the kernel, never by
      the host. That is what lets a CUDA graph capture fused Adam (each replay takes the next
      step; with a CPU step Adam refuses to be captured), and what spares a data-parallel
      array's update a host read of the count. Row-wise Adagrad takes the flag too (a no-op);
      ``torch.optim.SGD`` and ``Adagrad`` do not (their constructors refuse it, as they would
      without ROBE).

    On the CPU every kind of step gives the same numbers.
    """

    def __init__(
        self,
        param_key: str,
        param: torch.Tensor,
        optimizer_class: Type[torch.optim.Optimizer],
        optimizer_kwargs: Dict[str, Any],
        block_size: Optional[int] = None,
    ) -> None:
        optimizer_kwargs = in_backward_kwargs(optimizer_kwargs)
        self.kind = resolve_optimizer(optimizer_class, optimizer_kwargs)
        if self.kind == Optimizer.ROWWISE_ADAGRAD and not block_size:
            raise ValueError("robe_torchrec: row-wise Adagrad needs the array's block_size "
                             "(RobeFusedOptimizer(..., block_size=layout.block_size))")
        self.optimizer_class = optimizer_class
        self.block_size = block_size
        self.capturable = bool(optimizer_kwargs.get("capturable", False))
        # a 2-D stand-in: torchrec's RowWiseAdagrad cannot be built on a 1-D tensor
        defaults = optimizer_class([torch.zeros(1, 1)], **optimizer_kwargs).defaults
        group = RateGroup({"params": [param], **{k: v for k, v in defaults.items()
                                                 if k in _TUNABLE[self.kind]}}, param.device)
        state: Dict[str, torch.Tensor] = {}
        acc = dict(dtype=accumulation_dtype(param.dtype), device=param.device)
        init = float(group.get("initial_accumulator_value", 0.0))
        if self.kind == Optimizer.ADAGRAD:
            state["sum"] = torch.full(param.shape, init, **acc)
        elif self.kind == Optimizer.ROWWISE_ADAGRAD:
            state["sum"] = torch.full((rowwise_state_size(param.numel(), block_size),), init, **acc)
        elif self.kind == Optimizer.ADAM:
            state["exp_avg"] = torch.zeros(param.shape, **acc)
            state["exp_avg_sq"] = torch.zeros(param.shape, **acc)
        self._param, self._hyper, self._param_state = param, group, state
        if self.kind != Optimizer.SGD:
            # (not torch.tensor(0.0, device=...): a copy from pageable memory, which waits)
            state["step"] = torch.zeros((), device=self._step_device())
        super().__init__({param_key: param}, {param: state}, [group])

    def step(self, closure: Any = None) -> None:
        raise_ready(send_idle=True)
        grad = self._param.grad
        if grad is not None:
            # a gradient that reached the array outside the fused lookup (a penalty on the
            # array, say), accumulated where PyTorch's in-backward hook then calls this step:
            # applied with the same state, as a stock table's in-backward optimizer applies
            # whatever gradient its weight accumulates
            state1, state2 = self.state_tensors()
            apply_dense_update_(self._param, grad, state1, state2, int(self.kind),
                                self.hparams(), self.advance_step(),
                                block_size=self.block_size or 0)

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    @property
    def param(self) -> torch.Tensor:
        """The ROBE array this optimizer updates."""
        return self._param

    @property
    def param_state(self) -> Dict[str, torch.Tensor]:
        """The array's state, keyed as ``torch.optim`` keys it (``sum``; ``exp_avg``,
        ``exp_avg_sq``; ``step``); empty for SGD. Kept rather than looked up in ``state``,
        which others add to (TorchRec's ``WarmupOptimizer`` keeps its count there): a
        compiled graph that read ``state`` would guard on its size and recompile."""
        return self._param_state

    def _group(self) -> RateGroup:
        """The param group the hyper-parameters are read from: the one built here, which
        schedulers and ``load_state_dict`` write into. Kept rather than looked up in
        ``param_groups``: Dynamo's handling of optimizers fails on a compiled read of
        ``param_groups`` that holds a dict subclass (docs/drop_in.md)."""
        return self._hyper

    def hparams(self) -> List[float]:
        """``[lr, eps, beta1, beta2, weight_decay]`` as the op takes them, read at each call."""
        group = self._group()
        return [float(group["lr"])] + _hparams_but_rate(group)

    def rate_and_hparams(self) -> Tuple[torch.Tensor, List[float]]:
        """What a fused op takes: the rate as a tensor on the array's device, which follows
        ``param_groups[0]["lr"]`` (:class:`~robe_torchrec.rate_group.RateGroup`), and the
        hparams with 0.0 in the rate's place, which the op does not read. A compiled
        backward then reads no rate on the host, so a scheduler changes it without a
        recompile, and a CUDA graph replays the current rate."""
        group = self._group()
        return group.rate(self._param.device), [0.0] + _hparams_but_rate(group)

    def state_tensors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(state1, state2)`` as the fused op takes them (unused ones empty), in the array's
        accumulation dtype and on its device."""
        self._follow_param()
        state = self.param_state
        empty = self._param.new_empty(0)
        if self.kind in (Optimizer.ADAGRAD, Optimizer.ROWWISE_ADAGRAD):
            return state["sum"], empty
        if self.kind == Optimizer.ADAM:
            return state["exp_avg"], state["exp_avg_sq"]
        return empty, empty

    def _step_device(self) -> torch.device:
        """Where ``step`` lives: the array's device, except for Adam without ``capturable``
        (the CPU)."""
        if self.capturable or self.kind != Optimizer.ADAM:
            return self._param.device
        return torch.device("cpu")

    def _follow_param(self) -> None:
        """Convert the state after ``module.to(dtype/device)`` changed the array (the op needs
        them alike), and put ``step`` where it lives (:meth:`_step_device`; a loaded or
        carried step may come from elsewhere)."""
        state = self.param_state
        dtype, device = accumulation_dtype(self._param.dtype), self._param.device
        for key, value in state.items():
            if key != "step" and (value.dtype != dtype or value.device != device):
                state[key] = value.to(dtype=dtype, device=device)
        step = state.get("step")
        if step is not None and step.device != self._step_device():
            state["step"] = step.to(self._step_device())

    def advance_step(self) -> Union[int, torch.Tensor]:
        """Count one more update and return its 1-based number (Adam's bias correction): an
        int, or the count tensor itself when it lives off the CPU (capturable), which
        reading would make the host wait for the device."""
        state = self.param_state
        if "step" not in state:
            return 1
        step = state["step"]
        step += 1
        if step.device.type != "cpu":
            return step
        return int(step.item())
