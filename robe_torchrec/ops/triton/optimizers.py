"""The fused optimizers' steps over the scattered gradient: SGD, Adagrad and Adam
elementwise, row-wise Adagrad one row of ``Z`` elements at a time."""

from robe_torchrec.ops.triton.common import _ADAGRAD, _SGD, _div_rn, _sqrt_rn, tl, triton
from robe_torchrec.ops.triton.bags import _inputs_clean


@triton.jit
def _optimizer_kernel(
    w_ptr, grad_ptr, state1_ptr, state2_ptr, numel,
    lr: tl.float64, eps: tl.float64, beta2: tl.float64, weight_decay: tl.float64,
    lerp_weight: tl.float64, bias1: tl.float64, bias2_sqrt: tl.float64,
    beta1: tl.float64, step_ptr, lr_ptr, guard_ptr,
    OPTIMIZER: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, COMPUTE: tl.constexpr,
    GUARDED: tl.constexpr, STEP_ON_DEVICE: tl.constexpr, RATE_ON_DEVICE: tl.constexpr,
    UNDO_STEP: tl.constexpr, BLOCK: tl.constexpr,
):
    """One dense SGD / Adagrad / Adam step, elementwise, with torch.optim's formulas
    (see ``reference.apply_optimizer_``). Scalars arrive as float64 and are rounded to
    COMPUTE once, as torch rounds its Python-float scalars: ``-lr``, ``lerp_weight =
    1 - beta1``, Adam's ``step_size = -lr / bias1`` (computed here in float64, as Python
    divides) with ``bias1 = 1 - beta1**step``, and ``bias2_sqrt = sqrt(1 - beta2**step)``.

    With ``RATE_ON_DEVICE`` the rate is the number at ``lr_ptr`` (the optimizer's rate
    tensor, which a scheduler writes without a recompile, and a CUDA graph's replays read
    anew), else ``lr``. With ``STEP_ON_DEVICE`` Adam's step is the count at ``step_ptr`` (a
    capturable optimizer's, counted on the device, so that a CUDA graph's replays each take
    the next step): ``bias1`` and ``bias2_sqrt`` are computed here, in float64, from it and
    ``beta1``, ``beta2`` (see :func:`_adam_bias_corrections`); otherwise the host computed
    them and ``beta1`` is unused. ``UNDO_STEP``: see :func:`_undo_step`."""
    lr = _rate(lr, lr_ptr, RATE_ON_DEVICE)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    clean = _inputs_clean(guard_ptr, GUARDED)
    _undo_step(step_ptr, clean, UNDO_STEP)
    mask = i < tl.where(clean, numel, 0)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(grad_ptr + i, mask=mask, other=0.0).to(COMPUTE)
    if HAS_WEIGHT_DECAY:
        g = g + tl.full([], weight_decay, COMPUTE) * w
    if OPTIMIZER == _SGD:
        w = w + tl.full([], -lr, COMPUTE) * g
    elif OPTIMIZER == _ADAGRAD:
        state = tl.load(state1_ptr + i, mask=mask, other=0.0).to(COMPUTE) + g * g
        tl.store(state1_ptr + i, state.to(state1_ptr.dtype.element_ty), mask=mask)
        denom = _sqrt_rn(state) + tl.full([], eps, COMPUTE)
        w = w + tl.full([], -lr, COMPUTE) * _div_rn(g, denom)
    else:
        if STEP_ON_DEVICE:
            bias1, bias2_sqrt = _adam_bias_corrections(step_ptr, beta1, beta2)
        step_size = _div_rn(-lr, tl.full([], bias1, tl.float64))
        # exp_avg.lerp_(grad, 1 - beta1): torch's two-sided lerp formula
        exp_avg = tl.load(state1_ptr + i, mask=mask, other=0.0).to(COMPUTE)
        weight = tl.full([], lerp_weight, COMPUTE)
        if lerp_weight < 0.5:
            exp_avg = exp_avg + weight * (g - exp_avg)
        else:
            exp_avg = g - (g - exp_avg) * (1.0 - weight)
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avg_sq = tl.load(state2_ptr + i, mask=mask, other=0.0).to(COMPUTE)
        exp_avg_sq = (exp_avg_sq * tl.full([], beta2, COMPUTE)
                      + tl.full([], 1.0 - beta2, COMPUTE) * (g * g))
        tl.store(state1_ptr + i, exp_avg.to(state1_ptr.dtype.element_ty), mask=mask)
        tl.store(state2_ptr + i, exp_avg_sq.to(state2_ptr.dtype.element_ty), mask=mask)
        denom = _div_rn(_sqrt_rn(exp_avg_sq), tl.full([], bias2_sqrt, COMPUTE))
        denom = denom + tl.full([], eps, COMPUTE)
        w = w + tl.full([], step_size, COMPUTE) * _div_rn(exp_avg, denom)
    tl.store(w_ptr + i, w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _undo_step(step_ptr, clean, UNDO_STEP: tl.constexpr):
    """With ``UNDO_STEP`` (a step count on the device, advanced by the host's launch just
    before this kernel, and a guard): when the guard stops every write, the first program
    takes the step back, so that input found bad leaves the optimizer's state as it was,
    its count included (exactly while the count is exact in its dtype: below 2**24 for
    float32, where ``torch.optim``'s own float32 count stops too). The other programs may
    read either count: they write nothing."""
    if UNDO_STEP:
        first = tl.program_id(0) == 0
        tl.store(step_ptr, tl.load(step_ptr) - 1, mask=first & (clean == 0))


@triton.jit
def _rate(lr, lr_ptr, RATE_ON_DEVICE: tl.constexpr):
    """The learning rate in float64: the number at ``lr_ptr`` (any float dtype) with
    ``RATE_ON_DEVICE``, else the scalar ``lr`` (the interpreter passes a Python float)."""
    if RATE_ON_DEVICE:
        rate = tl.load(lr_ptr).to(tl.float64)
    else:
        rate = tl.full([], lr, tl.float64)
    return rate


@triton.jit
def _adam_bias_corrections(step_ptr, beta1, beta2):
    """``(1 - beta1**step, sqrt(1 - beta2**step))`` in float64, ``step`` read from
    ``step_ptr`` (any float or integer dtype): what the host computes in Python floats for
    an int step, to a few float64 ulps (see :func:`_pow`). The square root rounds as IEEE's,
    as Python's does."""
    step = tl.load(step_ptr).to(tl.float64)
    bias1 = 1.0 - _pow(tl.full([], beta1, tl.float64), step)
    bias2 = 1.0 - _pow(tl.full([], beta2, tl.float64), step)
    return bias1, _sqrt_rn(bias2)


@triton.jit
def _pow(base, exponent):
    """``base ** exponent`` for a float64 ``0 < base < 1``, as ``exp2(exponent * log2(base))``
    (the interpreter has no libdevice ``pow``). Its relative error is about
    ``|exponent * log2(base)|`` float64 ulps, so its absolute error stays within an ulp of 1
    or so: what ``1 - base**exponent``, the bias correction, sees
    (``tests/ops/test_capturable_adam.py`` compares it with Python's ``**``)."""
    return tl.exp2(exponent * tl.log2(base))


@triton.jit
def _rowwise_adagrad_kernel(
    w_ptr, grad_ptr, sum_ptr, numel, num_rows,
    lr: tl.float64, eps: tl.float64, weight_decay: tl.float64, step_ptr, lr_ptr, guard_ptr,
    Z: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, COMPUTE: tl.constexpr,
    GUARDED: tl.constexpr, RATE_ON_DEVICE: tl.constexpr, UNDO_STEP: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    """Row-wise Adagrad (see ``reference.apply_optimizer_``) on ``ROWS`` rows of ``Z``
    elements: ``sum[r] += mean over the row of g*g``, ``w -= lr * g / (sqrt(sum[r]) + eps)``;
    the rate and ``UNDO_STEP`` as in :func:`_optimizer_kernel`."""
    lr = _rate(lr, lr_ptr, RATE_ON_DEVICE)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None].to(tl.int64)
    j = tl.arange(0, BLOCK_Z)[None, :]
    i = r * Z + j
    clean = _inputs_clean(guard_ptr, GUARDED)
    _undo_step(step_ptr, clean, UNDO_STEP)
    mask = (j < Z) & (i < tl.where(clean, numel, 0))
    row_mask = r < tl.where(clean, num_rows, 0)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(grad_ptr + i, mask=mask, other=0.0).to(COMPUTE)
    if HAS_WEIGHT_DECAY:
        g = g + tl.full([], weight_decay, COMPUTE) * w
    count = tl.maximum(tl.minimum(numel - r * Z, Z), 1).to(COMPUTE)  # the last row is shorter
    state = tl.load(sum_ptr + r, mask=row_mask, other=0.0).to(COMPUTE)
    state = state + _div_rn(tl.sum(g * g, axis=1)[:, None], count)
    tl.store(sum_ptr + r, state.to(sum_ptr.dtype.element_ty), mask=row_mask)
    denom = _sqrt_rn(state) + tl.full([], eps, COMPUTE)
    w = w + tl.full([], -lr, COMPUTE) * _div_rn(g, denom)
    tl.store(w_ptr + i, w.to(w_ptr.dtype.element_ty), mask=mask)
