"""The optimizer step applied to a whole ROBE array from its dense gradient (production path).

Data-parallel arrays need it: every rank computes the array's dense gradient
(``robe::backward_dense``), the gradients are averaged over the process group, and then this
step runs (see :mod:`robe_torchrec.fused_lookup`). It takes the op's encoding of the optimizer
(:class:`~robe_torchrec.ops.meta.Optimizer`, ``hparams`` in
:data:`~robe_torchrec.ops.meta.HPARAM_NAMES` order, 1-based ``step``, and ``block_size`` for
row-wise Adagrad) and runs ``torch.optim``'s (torchrec's for ``RowWiseAdagrad``) own
functional single-tensor implementations, so its numbers are theirs; float16/bfloat16 weights
are stepped in float32 and written back rounded, as the fused kernels do; the fused kernels agree with them to float32 rounding (checked in
``tests/ops``). :mod:`robe_torchrec.ops.reference` keeps an independent copy of the formulas as
the test oracle.

Example::

    >>> grad = torch.ops.robe.backward_dense(grad_output, weights, values, offsets, None, meta,
    ...                                      4, 0, params)
    >>> apply_dense_update_(weights, grad, state1, state2, int(Optimizer.ADAGRAD),
    ...                     [0.05, 1e-10, 0.9, 0.999, 0.0], step=1)
"""

from __future__ import annotations

from typing import List, Tuple, Union

import torch
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.sgd import sgd
from torchrec.optim.rowwise_adagrad import adagrad as rowwise_adagrad

from robe_torchrec.ops.meta import Optimizer, accumulation_dtype


def apply_dense_update_(
    weights: torch.Tensor,
    grad: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    optimizer: int,
    hparams: List[float],
    step: Union[int, torch.Tensor],
    block_size: int = 0,
) -> None:
    """One step of SGD / Adagrad / Adam / row-wise Adagrad on ``weights`` in place, with the
    state tensors the fused kernel takes (Adagrad and row-wise Adagrad: ``state1`` = ``sum``;
    Adam: ``exp_avg``, ``exp_avg_sq``; unused ones may be empty). ``step`` is the 1-based
    number of this update, an int or a scalar tensor holding it; ``block_size`` the length
    of a row-wise Adagrad row.

    A ``step`` tensor off the CPU (a capturable optimizer's count on the GPU) is never read
    on the host: Adam then runs ``torch.optim``'s ``capturable=True`` step, as
    ``torch.optim.Adam(..., capturable=True)`` does, whose bias correction is computed on
    the device in float32 (the int step's is float64, as without ``capturable``)."""
    work = weights.to(accumulation_dtype(weights.dtype))
    _step(work, grad.to(work.dtype), state1, state2, optimizer, hparams, step, block_size)
    if work is not weights:
        with torch.no_grad():
            weights.copy_(work)


def _state_steps(step: Union[int, torch.Tensor],
                 optimizer: int) -> Tuple[List[torch.Tensor], bool]:
    """``torch.optim``'s ``state_steps`` for this update and its ``capturable``.

    torch.optim counts the step itself: it gets the count before this update, in a scratch
    tensor, since the caller's optimizer already advanced its own counter. A count off the
    CPU stays there (reading it would wait for the device): Adam takes it as a capturable
    step; Adagrad's and row-wise Adagrad's count only scales ``lr_decay``, fixed at 0 here,
    so a host stand-in gives their numbers (1: past torchrec's first-step note)."""
    if not isinstance(step, torch.Tensor) or step.device.type == "cpu":
        return [torch.tensor(float(step) - 1.0)], False
    if optimizer == Optimizer.ADAM:
        return [step.detach().to(torch.float32) - 1.0], True
    return [torch.tensor(1.0)], False


def _step(weights, grad, state1, state2, optimizer, hparams, step, block_size) -> None:
    lr, eps, beta1, beta2, weight_decay = hparams
    steps, capturable = _state_steps(step, optimizer)
    with torch.no_grad():
        if optimizer == Optimizer.SGD:
            sgd([weights], [grad], [None], foreach=False, weight_decay=weight_decay, momentum=0.0,
                lr=lr, dampening=0.0, nesterov=False, maximize=False)
        elif optimizer == Optimizer.ADAGRAD:
            adagrad([weights], [grad], [state1], steps, foreach=False, lr=lr,
                    weight_decay=weight_decay, lr_decay=0.0, eps=eps, maximize=False)
        elif optimizer == Optimizer.ADAM:
            adam([weights], [grad], [state1], [state2], [], steps, foreach=False, amsgrad=False,
                 beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                 maximize=False, capturable=capturable)
        elif optimizer == Optimizer.ROWWISE_ADAGRAD:
            _rowwise_adagrad(weights, grad, state1, steps, block_size, lr=lr,
                             weight_decay=weight_decay, lr_decay=0.0, eps=eps, maximize=False)
        else:
            raise ValueError(f"robe: unknown fused optimizer {optimizer}")


def _rowwise_adagrad(weights, grad, state_sum, steps, block_size, **hyper) -> None:
    """torchrec's row-wise step on the array seen as ``[rows, block_size]``; the leftover
    ``M % block_size`` elements form the last, shorter, row (a separate ``[1, rest]`` view)."""
    if block_size < 1:
        raise ValueError(f"robe: row-wise Adagrad needs block_size >= 1, got {block_size}")
    full = weights.numel() // block_size
    cut = full * block_size
    parts = [(slice(0, cut), slice(0, full), block_size)]
    if cut < weights.numel():
        parts.append((slice(cut, None), slice(full, None), weights.numel() - cut))
    for elems, rows, width in parts:
        rowwise_adagrad([weights[elems].view(-1, width)], [grad[elems].view(-1, width)],
                        [state_sum[rows].view(-1, 1)], [steps[0].clone()], **hyper)
