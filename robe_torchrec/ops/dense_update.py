"""The optimizer step applied to a whole ROBE array from its dense gradient (production path).

Data-parallel arrays need it: every rank computes the array's dense gradient
(``robe::backward_dense``), the gradients are averaged over the process group, and then this
step runs (see :mod:`robe_torchrec.fused_lookup`). It takes the op's encoding of the optimizer
(:class:`~robe_torchrec.ops.meta.Optimizer`, ``hparams`` in
:data:`~robe_torchrec.ops.meta.HPARAM_NAMES` order, 1-based ``step``) and runs
``torch.optim``'s own functional single-tensor implementations, so its numbers are
``torch.optim``'s; the fused kernels agree with them to float32 rounding (checked in
``tests/ops``). :mod:`robe_torchrec.ops.reference` keeps an independent copy of the formulas as
the test oracle.

Example::

    >>> grad = torch.ops.robe.backward_dense(grad_output, weights, values, offsets, None, meta,
    ...                                      4, 0, params)
    >>> apply_dense_update_(weights, grad, state1, state2, int(Optimizer.ADAGRAD),
    ...                     [0.05, 1e-10, 0.9, 0.999, 0.0], step=1)
"""

from __future__ import annotations

from typing import List

import torch
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from robe_torchrec.ops.meta import Optimizer


def apply_dense_update_(
    weights: torch.Tensor,
    grad: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    optimizer: int,
    hparams: List[float],
    step: int,
) -> None:
    """One step of SGD / Adagrad / Adam on ``weights`` in place, with the state tensors the
    fused kernel takes (Adagrad: ``state1`` = ``sum``; Adam: ``exp_avg``, ``exp_avg_sq``;
    unused ones may be empty). ``step`` is the 1-based number of this update."""
    lr, eps, beta1, beta2, weight_decay = hparams
    # torch.optim counts the step itself: hand it the count before this update, in a
    # scratch tensor, since the caller's optimizer already advanced its own counter
    steps = [torch.tensor(float(step - 1))]
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
                 maximize=False)
        else:
            raise ValueError(f"robe: unknown fused optimizer {optimizer}")
