"""A fused optimizer's param group whose learning rate the ops read from a tensor.

LR schedulers and TorchRec's ``WarmupOptimizer`` write a new rate into
``optimizer.param_groups[i]["lr"]`` as a Python float, often every step. A fused step that
passed that float to its op would make ``torch.compile`` guard on it (one recompile per
rate, then the eager fallback at Dynamo's recompile limit), and a CUDA graph would replay
the rate it captured. :class:`RateGroup` keeps the rate in a one-element tensor as well,
written in place whenever ``"lr"`` is set, and the fused ops read that tensor: a compiled
backward takes it as an input (no guard on its value), a captured one reads it at every
replay. The write is a tensor op on the current stream, which the backward that reads it is
ordered after, as autograd orders a backward after the ops before it.

A group whose ``lr`` is itself a tensor (``torch.optim``'s recipe for compiled steps:
``{"lr": torch.tensor(0.01)}``; schedulers then ``fill_`` it in place) is copied into the
rate tensor at each read instead: from another device by a copy queued on the stream, from
the CPU by a fill with the value read on the host (a copy from pageable memory would make
the host wait for the device). A CUDA graph cannot follow a CPU tensor (its replays would
repeat the captured value), so a capture refuses one.

Example::

    >>> group = RateGroup({"lr": 0.1, "eps": 1e-8}, device="cpu")
    >>> group["lr"] = 0.05        # as a scheduler writes it
    >>> group.rate("cpu")
    tensor(0.0500, dtype=torch.float64)
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch


class RateGroup(dict):
    """A param group (a ``dict``, as ``torch.optim`` and TorchRec expect) that mirrors its
    ``"lr"`` into a float64 tensor on ``device``, read with :meth:`rate`."""

    def __init__(self, group: Mapping[str, Any], device: torch.device | str) -> None:
        self._value = 0.0  # the last float written: a rate made anew from it on a move
        self._rate = torch.zeros((), dtype=torch.float64, device=device)
        self._source: Optional[torch.Tensor] = None
        super().__init__()
        for key, value in group.items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        # pickle restores the items before the attributes: the rate comes with them
        if key == "lr" and "_rate" in self.__dict__:
            self._mirror(value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other: Mapping[str, Any]) -> "RateGroup":  # type: ignore[override]
        self.update(other)
        return self

    def __copy__(self) -> "RateGroup":
        return RateGroup(self, self._rate.device)  # a rate tensor of its own

    def _mirror(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or not value.is_floating_point():
                raise ValueError(f"robe_torchrec: a learning-rate tensor holds one float, got "
                                 f"{value.dtype} of shape {tuple(value.shape)}")
            self._source = value
        else:
            self._source, self._value = None, float(value)
            self._rate.fill_(self._value)

    def rate(self, device: torch.device | str) -> torch.Tensor:
        """The learning rate as a float64 tensor on ``device``, the one the fused ops read
        (made there once if the array moved: from the meta device too, which holds no
        value)."""
        if "lr" not in self:  # deleted: as the float's reader would, not the last rate
            raise KeyError("lr")
        if self._rate.device != torch.device(device):
            self._rate = torch.full((), self._value, dtype=torch.float64, device=device)
        source = self._source
        if source is None:
            return self._rate
        capturing = self._rate.is_cuda and torch.cuda.is_current_stream_capturing()
        if read_on_host(source.device, self._rate.device, capturing):
            self._rate.fill_(float(source))
        else:
            self._rate.copy_(source.reshape(()))
        return self._rate


def read_on_host(source: torch.device, rate: torch.device, capturing: bool) -> bool:
    """Whether a tensor learning rate on ``source`` goes into the rate tensor on ``rate``
    as a value read on the host (a fill) rather than a copy: from the CPU to another device,
    where the copy would be from pageable memory and wait for the device. Refused inside a
    CUDA graph capture, whose replays would repeat the value read."""
    if source.type != "cpu" or rate.type == "cpu":
        return False
    if capturing:
        raise RuntimeError(
            "robe_torchrec: the learning rate is a CPU tensor, which a CUDA graph's replays "
            "cannot follow (they would repeat the captured rate); give lr as a float or as a "
            "tensor on the array's device")
    return True
