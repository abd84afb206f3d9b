"""The fused optimizers' steps over the scattered gradient: SGD, Adagrad and Adam
elementwise, row-wise Adagrad one row of ``Z`` elements at a time."""

from robe_torchrec.ops.triton.common import _ADAGRAD, _SGD, _div_rn, _sqrt_rn, tl, triton
from robe_torchrec.ops.triton.bags import _inputs_clean


@triton.jit
def _optimizer_kernel(
    w_ptr, grad_ptr, state1_ptr, state2_ptr, numel,
    lr: tl.float64, eps: tl.float64, beta2: tl.float64, weight_decay: tl.float64,
    lerp_weight: tl.float64, step_size: tl.float64, bias2_sqrt: tl.float64, guard_ptr,
    OPTIMIZER: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, COMPUTE: tl.constexpr,
    GUARDED: tl.constexpr, BLOCK: tl.constexpr,
):
    """One dense SGD / Adagrad / Adam step, elementwise, with torch.optim's formulas
    (see ``reference.apply_optimizer_``). Scalars arrive as float64 and are rounded to
    COMPUTE once, as torch rounds its Python-float scalars: ``lerp_weight = 1 - beta1``,
    ``step_size = -lr / (1 - beta1**step)``, ``bias2_sqrt = sqrt(1 - beta2**step)``."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < tl.where(_inputs_clean(guard_ptr, GUARDED), numel, 0)
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
def _rowwise_adagrad_kernel(
    w_ptr, grad_ptr, sum_ptr, numel, num_rows,
    lr: tl.float64, eps: tl.float64, weight_decay: tl.float64, guard_ptr,
    Z: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, COMPUTE: tl.constexpr,
    GUARDED: tl.constexpr, ROWS: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    """Row-wise Adagrad (see ``reference.apply_optimizer_``) on ``ROWS`` rows of ``Z``
    elements: ``sum[r] += mean over the row of g*g``, ``w -= lr * g / (sqrt(sum[r]) + eps)``."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None].to(tl.int64)
    j = tl.arange(0, BLOCK_Z)[None, :]
    i = r * Z + j
    clean = _inputs_clean(guard_ptr, GUARDED)
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
