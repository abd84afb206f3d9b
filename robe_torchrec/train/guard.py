"""Non-finite guard: notices inf / NaN in the loss (every step) and in the parameters and
optimizer state (when asked: every ``run.check_every`` steps, before every checkpoint and
after every load), so that no checkpoint is ever written from a broken state.

The loss is only looked at on this rank during the steps (the metrics already copy each
step's logits to the host, so this adds no device sync); :meth:`NonFiniteGuard.check`
agrees over all ranks at a segment end, where no batch is in flight.

Example::

    >>> guard = NonFiniteGuard()
    >>> guard.observe_loss(loss, step=7)          # every step, no collective
    >>> problem = guard.check(model, optimizer, tensors=True)   # collective
    >>> problem
    'the loss is not finite since step 7'
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

_NONE = 2**62


def local_tensors(obj: Any, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    """``(dotted name, tensor)`` of every floating tensor in a (nested) state dict that this
    rank holds: a ShardedTensor's local shards, a DTensor's local part."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from local_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from local_tensors(v, f"{prefix}.{i}")
    elif hasattr(obj, "local_shards"):  # torch.distributed._shard ShardedTensor
        for shard in obj.local_shards():
            yield from local_tensors(shard.tensor, prefix)
    elif hasattr(obj, "to_local"):  # DTensor
        yield from local_tensors(obj.to_local(), prefix)
    elif isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.device.type != "meta":
        yield prefix, obj


def nonfinite_names(model: torch.nn.Module, optimizer: Any) -> List[str]:
    """Names (``model.<key>``, ``optim.<key>``) of this rank's tensors holding inf or NaN."""
    bad = []
    for prefix, state in (("model", model.state_dict()), ("optim", optimizer.state_dict())):
        for name, t in local_tensors(state, prefix):
            if t.numel() and not bool(torch.isfinite(t).all()):
                bad.append(name)
    return bad


class NonFiniteGuard:
    """The first step whose loss was not finite, and collective checks (see module doc)."""

    def __init__(self) -> None:
        self.first_bad_step: Optional[int] = None

    def reset(self) -> None:
        self.first_bad_step = None

    def observe_loss(self, loss: torch.Tensor, step: int) -> None:
        if self.first_bad_step is None and not bool(torch.isfinite(loss.detach()).all()):
            self.first_bad_step = step

    def check(self, model: torch.nn.Module, optimizer: Any, tensors: bool) -> Optional[str]:
        """What is not finite on any rank (the same text on every rank), or None.
        ``tensors``: also scan the parameters and optimizer state."""
        names = nonfinite_names(model, optimizer) if tensors else []
        flags = torch.tensor([self.first_bad_step if self.first_bad_step is not None
                              else _NONE, -len(names)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        bad_step, any_tensor = int(flags[0]), int(flags[1]) < 0
        if bad_step == _NONE and not any_tensor:
            return None
        parts = []
        if bad_step != _NONE:
            parts.append(f"the loss is not finite since step {bad_step}")
        if any_tensor:
            gathered: List[Optional[List[str]]] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, names)
            every = sorted({n for g in gathered for n in (g or [])})
            shown = ", ".join(every[:5]) + (f" and {len(every) - 5} more" if len(every) > 5
                                           else "")
            parts.append(f"inf/NaN values in {shown}")
        return "; ".join(parts)
