"""The Triton kernels, run on CPU tensors by Triton's interpreter, against the reference ops.

The interpreter executes every program of a launch in Python (numpy), so cases stay small.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this module

import importlib.util
import math
import re
import sys

import pytest
import torch

pytest.importorskip("triton")

from robe_torchrec import hashing  # noqa: E402
from robe_torchrec.hashing import HashMode, hash_params  # noqa: E402
from robe_torchrec.ops import cpu_backend, defer_checks, reference  # noqa: E402
from robe_torchrec.ops import triton_kernels as tk  # noqa: E402
from robe_torchrec.ops.tiles import Tiles  # noqa: E402
from robe_torchrec.ops.tuning import tuned  # noqa: E402
from robe_torchrec.ops.meta import (  # noqa: E402
    BoundsCheck, Optimizer, build_table_meta, rowwise_state_size)
from robe_torchrec.ops.validation import check_inputs, check_layout  # noqa: E402

from tests.compiled_triton import run_compiled  # noqa: E402
from robe_torchrec.testing.op_cases import ROWWISE_CASES, case_matrix, fused_steps, random_case  # noqa: E402
from robe_torchrec.testing.op_checks import (  # noqa: E402
    assert_close, check_backward_dense, check_forward, check_per_sample_weights_grad)

if not (tk._is_interpreted(tk)
        and type(sys.modules["triton.language"].standard.sum).__name__ == "InterpretedFunction"):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (by an earlier test "
                "module?); run this file in its own process", allow_module_level=True)

CASES = case_matrix()
CASE_IDS = [f"case{i}" for i in range(len(CASES))]


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Buffers the wrappers allocate with torch.empty start as NaN (-1 for ints)."""
    monkeypatch.setattr(tk, "POISON_EMPTY", True)


# ---------------------------------------------------------------------------------------
# forward / backward_dense / per_sample_weights_grad against the reference
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_forward(kw):
    check_forward(random_case(**kw))


@pytest.mark.parametrize("kernel", ["per_bag", "short_bags"])
@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_each_kernel(kw, kernel, monkeypatch):
    """Both forward kernels and both backward kernels on every case, whatever its bag
    lengths (the short-bags ones with a group size that leaves a partial last group)."""
    if kernel == "short_bags" and kw.get("max_bag", 0) > 100:
        # it walks one id position a step: in the interpreter, bags of thousands take
        # half a minute; 40 still gives every group bags of very different lengths
        kw = dict(kw, max_bag=40)
    mean = float("inf") if kernel == "short_bags" else -1.0
    with tuned(short_bag_mean=mean, bags_per_program=4):
        check_forward(random_case(**kw))
        check_backward_dense(random_case(**kw))


def test_short_bags_kernel_is_bitwise_the_per_bag_kernel_on_one_and_two_id_bags(monkeypatch):
    """Pooling one or two ids is exact in either order, so the two kernels agree bitwise;
    sum and mean pooling, per-sample weights, a feature narrower than the column tiles."""
    for seed, max_bag in [(7, 1), (8, 2)]:
        case = random_case(seed=seed, dims=[12, 40, 7], batch=13, max_bag=max_bag,
                           block_size=4, weighted=True)
        outputs = []
        for mean in (-1.0, float("inf")):
            with tuned(short_bag_mean=mean):
                outputs.append(tk.forward(*case.forward_args()))
        assert torch.equal(*outputs)


@pytest.mark.parametrize("kernel", ["per_bag", "short_bags"])
@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_compact_hash_is_bitwise_the_default(kw, kernel):
    """Each (id, block) pair hashed once in a tile of its own (``compact_hash``) finds the
    same elements: the forward, the weight gradient and a fused Adagrad step are bitwise
    those of the default launch, in both bag kernels."""
    if kernel == "short_bags" and kw.get("max_bag", 0) > 100:
        kw = dict(kw, max_bag=40)  # as in test_each_kernel
    case = random_case(**kw)
    grad = case.grad()
    mean = float("inf") if kernel == "short_bags" else -1.0
    results = []
    for compact in (False, True):
        with tuned(short_bag_mean=mean, two_pass_mean_bag=float("inf"), bags_per_program=4,
                   compact_hash=compact):
            weights, state = case.weights.clone(), torch.zeros_like(case.weights)
            tk.backward_fused_(grad, weights, state, state.new_empty(0), case.values,
                               case.offsets, case.per_sample_weights, case.table_meta,
                               case.block_size, case.hash_mode, case.hash_params,
                               int(Optimizer.ADAGRAD), [0.1, 1e-8, 0.9, 0.999, 0.0], 1)
            results.append((tk.forward(*case.forward_args()),
                            tk.backward_dense(*case.backward_args(grad)), weights, state))
    for default, compact in zip(*results):
        assert torch.equal(default, compact)


@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_backward_dense(kw):
    check_backward_dense(random_case(**kw))


@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_per_sample_weights_grad(kw):
    check_per_sample_weights_grad(random_case(**kw))  # every (poisoned) entry was written


@pytest.mark.parametrize("kw", [CASES[1], CASES[2]], ids=["reference", "mix"])
def test_float64(kw):
    case = random_case(**kw, dtype=torch.float64)
    assert tk.forward(*case.forward_args()).dtype == torch.float64
    check_forward(case)  # to 1e-12
    check_backward_dense(case)
    check_per_sample_weights_grad(case)


def test_int32_and_int64_ids_agree():
    kw = dict(CASES[2], index_dtype=torch.int64, batch=4)
    a, b = random_case(**kw), random_case(**dict(kw, index_dtype=torch.int32))
    assert b.values.dtype == torch.int32
    g = a.grad()
    assert torch.equal(tk.forward(*a.forward_args()), tk.forward(*b.forward_args()))
    assert torch.equal(tk.per_sample_weights_grad(*a.psw_grad_args(g)),
                       tk.per_sample_weights_grad(*b.psw_grad_args(g)))


def test_colliding_updates_accumulate():
    """memory_size == block_size: every block of every row starts at 0, so all atomics of a
    launch (and ids repeated inside a bag) hit the same Z floats."""
    case = random_case(7, dims=[8, 3], batch=4, max_bag=5, block_size=4, memory_size=4,
                       weighted=True, empty_fraction=0.0)
    case.values[1:4] = case.values[0]
    g = case.grad()
    assert_close(tk.forward(*case.forward_args()), reference.forward(*case.forward_args()), 1e-5)
    assert_close(tk.backward_dense(*case.backward_args(g)),
                 reference.backward_dense(*case.backward_args(g)), 1e-5)


def test_empty_batch():
    meta = build_table_meta([4, 3], [0, 0], [50, 50], [0, 10], [10, 10], [0, 1])
    values = torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(1, dtype=torch.int64)
    w = torch.randn(50)
    out = tk.forward(w, values, offsets, None, meta, 7, 2, 0, hash_params(0, 1), 0)
    assert out.shape == (0, 7)
    grad = tk.backward_dense(torch.zeros(0, 7), w, values, offsets, None, meta, 2, 0,
                             hash_params(0, 1))
    assert torch.equal(grad, torch.zeros(50))


def test_output_gap_columns_are_zero():
    """output_dim larger than the features' columns: the rest of the output is 0."""
    case = random_case(3, dims=[5, 3])
    args = list(case.forward_args())
    args[5] = case.output_dim + 4
    out = tk.forward(*args)
    assert torch.equal(out[:, case.output_dim:], torch.zeros(case.batch, 4))
    assert_close(out, reference.forward(*args), 1e-5)


# ---------------------------------------------------------------------------------------
# hashes: bit-exact block starts
# ---------------------------------------------------------------------------------------

VECTOR_KEYS = [0, 1, 12345, 39999999, 4000000000]
VECTOR_STARTS = [[730, 839], [567, 676], [832, 941], [972, 84], [716, 825]]


def test_reference_hash_vectors_through_forward():
    """W[i] = i makes the pooled row of a one-id bag spell out its element indices."""
    params = hash_params(HashMode.REFERENCE, seed=1024)
    meta = build_table_meta([8], [0], [1000], [0], [2**40], [0])
    weights = torch.arange(1000, dtype=torch.float64)
    values = torch.tensor(VECTOR_KEYS, dtype=torch.int64)
    offsets = torch.arange(len(VECTOR_KEYS) + 1, dtype=torch.int64)
    out = tk.forward(weights, values, offsets, None, meta, 8, 4, int(HashMode.REFERENCE),
                     params, int(BoundsCheck.ERROR))
    starts = torch.tensor(VECTOR_STARTS, dtype=torch.float64)
    expected = starts.repeat_interleave(4, dim=1) + torch.arange(8, dtype=torch.float64) % 4
    assert torch.equal(out, expected)


def test_reference_hash_vectors_block_starts_kernel():
    params = hash_params(HashMode.REFERENCE, seed=1024)
    starts = tk.block_starts(torch.tensor(VECTOR_KEYS), 2, 1000, 4, int(HashMode.REFERENCE), params)
    assert starts.tolist() == VECTOR_STARTS


def test_block_terms_are_copied_once_and_never_inside_a_capture(monkeypatch):
    """Every plan of the same tables shares one copy of their block terms on the device, so a
    plan for a new batch size can be made inside a CUDA graph capture (which refuses the
    copy); a first call inside a capture raises, naming the warm-up."""
    from robe_torchrec.ops import deferred_checks

    params = hash_params(HashMode.REFERENCE, seed=5)
    device = torch.device("cpu")
    p0, terms = tk._kernel_hash_args(params, 8, device)
    assert p0 == params[0] and terms.dtype == torch.int32
    assert terms.tolist() == hashing.reference_block_terms(params, 8)
    monkeypatch.setattr(deferred_checks, "is_capturing", lambda: True)
    assert tk._kernel_hash_args(params, 8, device)[1] is terms
    with pytest.raises(RuntimeError, match="outside the capture first"):
        tk._kernel_hash_args(params, 16, device)


MIX_PARAMS = [hash_params(HashMode.MIX, seed=0), hash_params(HashMode.MIX, seed=1),  # salt < 0
              hash_params(HashMode.MIX, seed=1024), [2**31 + 5, 0, 0], [2**64 - 3, 0, 0]]


@pytest.mark.parametrize("params", MIX_PARAMS, ids=["seed0", "seed1", "seed1024", "salt2e31",
                                                    "unsigned_salt"])
@pytest.mark.parametrize("memory_size", [1000, 2**31 + 10, 2**32 + 2])  # span up to 2**32 - 1
def test_mix_hash_bit_exact(params, memory_size):
    g = torch.Generator().manual_seed(memory_size)
    keys = torch.cat([
        torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 4000000000]),
        torch.randint(-(2**63), 2**63 - 1, (40,), generator=g, dtype=torch.int64),
    ])
    actual = tk.block_starts(keys, 5, memory_size, 4, int(HashMode.MIX), params)
    expected = [[hashing.block_start_int(int(k), b, memory_size, 4, HashMode.MIX, params)
                 for b in range(5)] for k in keys.tolist()]
    assert actual.tolist() == expected


def test_reference_hash_matches_hashing_module():
    params = hash_params(HashMode.REFERENCE, seed=77)
    limit = hashing.reference_key_limit(6, params)
    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.tensor([0, limit - 1]),
                      torch.randint(0, limit, (50,), generator=g, dtype=torch.int64)])
    for memory_size in (1000, 3_000_000_000):
        actual = tk.block_starts(keys, 6, memory_size, 8, int(HashMode.REFERENCE), params)
        expected = hashing.block_starts(keys, 6, memory_size, 8, HashMode.REFERENCE, params)
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("mode,salt", [(HashMode.REFERENCE, None), (HashMode.MIX, None),
                                       (HashMode.MIX, 2**31 + 99)])
def test_forward_element_indices_exact(mode, salt):
    """Raw ids (UNBOUNDED; negative and huge for mix) through the forward kernel: W[i] = i
    gives the sum of the element indices, which must equal the reference's exactly."""
    case = random_case(11, dims=[8, 5, 3], hash_mode=int(mode), block_size=3, shared=False,
                       memory_size=3000, dtype=torch.float64)
    if salt is not None:
        case.hash_params = [salt, 0, 0]
    case.weights = torch.arange(case.weights.numel(), dtype=torch.float64)
    case.bounds_check = int(BoundsCheck.UNBOUNDED)
    g = torch.Generator().manual_seed(1)
    if mode == HashMode.MIX:
        case.values = torch.randint(-(2**63), 2**63 - 1, case.values.shape, generator=g)
    else:
        limit = hashing.reference_key_limit(3, case.hash_params)
        case.values = torch.randint(0, limit, case.values.shape, generator=g)
    table_pool = case.table_meta.clone()
    table_pool[6] = 0  # SUM everywhere: sums of integers < 2**53 are exact
    case.table_meta = table_pool
    assert torch.equal(tk.forward(*case.forward_args()), reference.forward(*case.forward_args()))


# ---------------------------------------------------------------------------------------
# fused optimizers against torch.optim on the reference dense gradient
# ---------------------------------------------------------------------------------------

def _torch_optimizer(name, param, lr, eps, beta1, beta2, weight_decay):
    if name == "sgd":
        return torch.optim.SGD([param], lr=lr, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad([param], lr=lr, eps=eps, weight_decay=weight_decay)
    return torch.optim.Adam([param], lr=lr, betas=(beta1, beta2), eps=eps,
                            weight_decay=weight_decay)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_fused_optimizer_two_steps(name, weight_decay):
    kw = CASES[1] if weight_decay else CASES[2]  # reference hash + int32 ids / mix + int64
    case = random_case(**kw)
    hparams = [0.05, 1e-8, 0.9, 0.999, weight_decay]
    param = case.weights.clone().requires_grad_(True)
    opt = _torch_optimizer(name, param, *hparams)
    weights = case.weights.clone()
    state1, state2 = torch.zeros_like(weights), torch.zeros_like(weights)
    for step in (1, 2):
        g = case.grad(step)
        param.grad = reference.backward_dense(g, param.detach(), case.values, case.offsets,
                                              case.per_sample_weights, case.table_meta,
                                              case.block_size, case.hash_mode, case.hash_params)
        opt.step()
        tk.backward_fused_(g, weights, state1, state2, case.values, case.offsets,
                           case.per_sample_weights, case.table_meta, case.block_size,
                           case.hash_mode, case.hash_params, int(Optimizer[name.upper()]),
                           hparams, step)
        assert_close(weights, param.detach(), 1e-5)
        state = opt.state[param]
        if name == "adagrad":
            assert_close(state1, state["sum"], 1e-5)
        if name == "adam":
            assert_close(state1, state["exp_avg"], 1e-5)
            assert_close(state2, state["exp_avg_sq"], 1e-5)
    assert not torch.equal(weights, case.weights)


def test_fused_matches_reference_float64():
    case = random_case(**CASES[4], dtype=torch.float64)
    hparams = [0.01, 1e-6, 0.8, 0.99, 0.001]
    tensors = [case.weights.clone() for _ in range(2)]
    states = [[torch.rand_like(case.weights) for _ in range(2)] for _ in range(2)]
    states[1] = [s.clone() for s in states[0]]
    g = case.grad()
    rest = (case.values, case.offsets, case.per_sample_weights, case.table_meta, case.block_size,
            case.hash_mode, case.hash_params, int(Optimizer.ADAM), hparams, 3)
    tk.backward_fused_(g, tensors[0], *states[0], *rest)
    reference.backward_fused_(g, tensors[1], *states[1], *rest)
    assert_close(tensors[0], tensors[1], 1e-12)
    assert_close(states[0][0], states[1][0], 1e-12)
    assert_close(states[0][1], states[1][1], 1e-12)


# ---------------------------------------------------------------------------------------
# bad inputs: the same ValueError as the reference (check_inputs before any launch)
# ---------------------------------------------------------------------------------------

def _bad(name):
    case = random_case(5, hash_mode=int(HashMode.REFERENCE), weighted=True, max_bag=4,
                       empty_fraction=0.0)
    if name == "offsets_dtype":
        case.offsets = case.offsets.to(torch.int32)
    elif name == "first_offset":
        case.offsets = case.offsets.clone()
        case.offsets[0] = 1
    elif name == "last_offset":
        case.offsets = case.offsets.clone()
        case.offsets[-1] -= 1
    elif name == "decreasing_offsets":
        case.offsets = case.offsets.clone()
        case.offsets[3] = case.offsets[4] + 1
    elif name == "id_too_large":
        case.values = case.values.clone()
        case.values[5] = int(case.table_meta[5, 0]) + 100000
    elif name == "negative_id":
        case.values = case.values.clone()
        case.values[-1] = -3
    elif name == "nan_weight":
        case.per_sample_weights = case.per_sample_weights.clone()
        case.per_sample_weights[2] = float("nan")
    elif name == "reference_key_overflow":
        case.bounds_check = int(BoundsCheck.UNBOUNDED)
        case.values = case.values.clone()
        case.values[0] = 2**62
    elif name == "output_dim":
        case.output_dim -= 1
    elif name == "memory_too_small":
        case.table_meta = case.table_meta.clone()
        case.table_meta[3] = 2
    elif name == "block_size":
        case.block_size = 0
    return case


BAD = ["offsets_dtype", "first_offset", "last_offset", "decreasing_offsets", "id_too_large",
       "negative_id", "nan_weight", "reference_key_overflow", "output_dim", "memory_too_small",
       "block_size"]


@pytest.mark.parametrize("name", BAD)
def test_bad_inputs_raise_like_reference(name):
    case = _bad(name)
    with pytest.raises(ValueError) as expected:
        reference.forward(*case.forward_args())
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        tk.forward(*case.forward_args())


@pytest.mark.parametrize("name", ["negative_id", "reference_key_overflow", "decreasing_offsets"])
def test_backward_rejects_unhashable_inputs(name):
    case = _bad(name)
    g = torch.zeros(case.batch, case.output_dim)
    with pytest.raises(ValueError, match="^robe: "):
        tk.backward_dense(*case.backward_args(g))
    with pytest.raises(ValueError, match="^robe: "):
        tk.per_sample_weights_grad(*case.psw_grad_args(g))


def test_bad_grad_output_and_optimizer_args():
    case = random_case(6)
    with pytest.raises(ValueError, match="grad_output"):
        tk.backward_dense(*case.backward_args(torch.zeros(case.batch + 1, case.output_dim)))
    w, s = case.weights.clone(), torch.zeros_like(case.weights)
    g = case.grad()
    rest = (case.values, case.offsets, None, case.table_meta, case.block_size, case.hash_mode,
            case.hash_params)
    with pytest.raises(ValueError, match="unknown fused optimizer"):
        tk.backward_fused_(g, w, s, s, *rest, 7, [0.1, 0, 0, 0, 0], 1)
    with pytest.raises(ValueError, match="step counts from 1"):
        tk.backward_fused_(g, w, s, s.clone(), *rest, int(Optimizer.ADAM),
                           [0.1, 1e-8, 0.9, 0.99, 0], 0)
    with pytest.raises(ValueError, match="state1"):
        tk.backward_fused_(g, w, s[:-1], s, *rest, int(Optimizer.ADAGRAD), [0.1, 1e-8, 0, 0, 0], 1)
    assert torch.equal(w, case.weights)  # nothing was applied


# ---------------------------------------------------------------------------------------
# the registered ops routed to Triton on CPU, autograd included
# ---------------------------------------------------------------------------------------

def _op_forward_and_grads(case, backend):
    w = case.weights.clone().requires_grad_(True)
    psw = case.per_sample_weights.clone().requires_grad_(True)
    args = list(case.forward_args())
    args[0], args[3] = w, psw
    with cpu_backend(backend):
        out = torch.ops.robe.forward(*args)
        (out * case.grad()).sum().backward()
    return out.detach(), w.grad, psw.grad


def test_registered_op_routes_to_triton_with_autograd(monkeypatch):
    case = random_case(**CASES[1])  # reference hash, int32 ids, per-sample weights, MEAN+SUM
    calls = []
    for fn in ("forward", "backward_dense", "per_sample_weights_grad"):
        original = getattr(tk, fn)
        monkeypatch.setattr(tk, fn, lambda *a, _f=original, _n=fn: calls.append(_n) or _f(*a))
    actual = _op_forward_and_grads(case, "triton")
    assert calls == ["forward", "backward_dense", "per_sample_weights_grad"]
    expected = _op_forward_and_grads(case, "reference")
    for a, e in zip(actual, expected):
        assert_close(a, e, 1e-5)


def test_gradcheck_through_registered_op():
    """float64 finite differences of the Triton forward against its analytic backward
    (weights and per-sample weights); a tiny case, as every evaluation is interpreted."""
    case = random_case(21, dims=[3, 2], batch=2, max_bag=3, block_size=2, memory_size=9,
                       weighted=True, empty_fraction=0.0, dtype=torch.float64)
    w = case.weights.clone().requires_grad_(True)
    psw = case.per_sample_weights.clone().requires_grad_(True)
    rest = case.forward_args()[4:]

    def fn(weights, per_sample_weights):
        return torch.ops.robe.forward(weights, case.values, case.offsets, per_sample_weights,
                                      *rest)

    with cpu_backend("triton"):
        assert torch.autograd.gradcheck(fn, (w, psw), eps=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------
# module loading: without triton, and imported without TRITON_INTERPRET
# ---------------------------------------------------------------------------------------

def _load_copy(name, monkeypatch):
    # the kernels' package too: its modules decorate the kernels (or stand in for triton)
    # when first imported, and the copy must import them afresh
    import robe_torchrec.ops as ops_package

    for loaded in [k for k in sys.modules if k.startswith("robe_torchrec.ops.triton.")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.delitem(sys.modules, "robe_torchrec.ops.triton")
    monkeypatch.delattr(ops_package, "triton")  # the fresh package's import sets it anew
    spec = importlib.util.spec_from_file_location(name, tk.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_import_without_triton_fails_at_call_time(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    module = _load_copy("robe_triton_without_triton", monkeypatch)
    case = random_case(1)
    with pytest.raises(RuntimeError, match="need the `triton` package"):
        module.forward(*case.forward_args())


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """Kernels decorated without TRITON_INTERPRET are compiled ones: CPU tensors get a clear
    error instead of Triton's pointer error."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    module = _load_copy("robe_triton_compiled_mode", monkeypatch)
    assert not module._is_interpreted(module)
    case = random_case(1)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        module.forward(*case.forward_args())


def test_tile_sizes():
    tiles = Tiles(max_dim=13, block_size=3, num_values=100, num_bags=30)
    assert (tiles.block_z, tiles.block_b, tiles.col_tiles, tiles.block_n) == (4, 8, 1, 4)
    assert not tiles.two_pass  # 3.3 ids a bag: below the two-pass threshold
    wide = Tiles(max_dim=1024, block_size=32, num_values=10**6, num_bags=10)
    assert wide.block_b * wide.block_z == 256 and wide.col_tiles == 4
    assert wide.two_pass and wide.block_n * wide.block_b * wide.block_z == 8192
    with tuned(two_pass_mean_bag=float("inf")):
        one_pass = Tiles(max_dim=1024, block_size=32, num_values=10**6, num_bags=10)
    assert not one_pass.two_pass and one_pass.block_n * 256 == 2048
    assert math.prod([tiles.block_z, tiles.block_b]) >= 13


# ---------------------------------------------------------------------------------------
# the compiled (CUDA) path: no GPU needed to compile to cubin for sm_90
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_every_launch_compiles_for_sm90(tmp_path):
    """The interpreter specialises nothing and accepts code the compiler rejects (float64
    ``tl.div_rn``, an argument specialised to the constant 1), so compile every kernel
    variant the host wrappers launch on shapes that hit Triton's specialisations (one
    feature, batch 1, width 1, span 1, multiples of 16; every dtype, hash and optimizer)
    for an H100 target: the launcher's own binder, Triton front end, LLVM and ptxas, no
    GPU (``tests/ops/sm90_launches.py``)."""
    result = run_compiled(["-m", "tests.ops.sm90_launches"], tmp_path)
    compiled = result.stdout.splitlines()
    # a one-feature, batch-1 launch really was specialised (the crash this guards against)
    assert any("'num_features': 1" in line for line in compiled)
    for kernel in ("_forward_kernel", "_forward_short_bags_kernel", "_backward_kernel",
                   "_backward_short_bags_kernel", "_psw_grad_kernel", "_optimizer_kernel",
                   "_rowwise_adagrad_kernel", "_block_starts_kernel", "_input_summary_kernel"):
        assert any(line.startswith(f"compiled {kernel} ") for line in compiled), kernel
    # a GPU defers the checks: its backward kernels guard their writes (and take back a
    # step counted on the device), variants the immediate checks on a CPU never launch
    for kernel in ("_backward_kernel", "_backward_short_bags_kernel", "_gather_gradient_kernel",
                   "_psw_grad_kernel", "_optimizer_kernel", "_rowwise_adagrad_kernel"):
        assert any(line.startswith(f"compiled {kernel} ") and "'GUARDED': True" in line
                   for line in compiled), kernel
    for kernel in ("_optimizer_kernel", "_rowwise_adagrad_kernel"):
        assert any(line.startswith(f"compiled {kernel} ") and "'UNDO_STEP': True" in line
                   for line in compiled), kernel
    # Adam with its step on the device (it reads the count the first program takes back)
    assert any(line.startswith("compiled _optimizer_kernel ") and "'OPTIMIZER': 2" in line
               and "'STEP_ON_DEVICE': True" in line and "'UNDO_STEP': True" in line
               for line in compiled)


@pytest.mark.slow
def test_cached_launches_match_jit_launches(tmp_path):
    """Launches that skip ``JITFunction.run`` once a variant is compiled get, for every op
    and on ids at an address Triton specialises differently, the compiled variant and the
    arguments ``JITFunction.run`` gives them, and arguments of one cached-launch key get one
    specialisation from this Triton (``tests/ops/cached_launches.py``: a stand-in driver
    compiles for sm_90 and records the launches)."""
    result = run_compiled(["-m", "tests.ops.cached_launches"], tmp_path)
    agreed = [line for line in result.stdout.splitlines() if line.startswith("scenario")]
    assert len(agreed) == 10 and "one specialisation a key" in agreed[0], result.stdout
    assert "not 16-byte aligned" in agreed[5], result.stdout
    assert agreed[6:8] == ["scenario pre-run hook honoured", "scenario nested recordings"], \
        result.stdout
    assert "paper scale, 20 id(s) a bag" in agreed[-1], result.stdout


# ---------------------------------------------------------------------------------------
# row-wise Adagrad and float16 / bfloat16 storage
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size,shared,weighted,weight_decay", ROWWISE_CASES)
def test_rowwise_adagrad_matches_reference(block_size, shared, weighted, weight_decay):
    case = random_case(61, batch=12, block_size=block_size, shared=shared, weighted=weighted,
                       memory_size=1001)
    rows = rowwise_state_size(case.weights.numel(), block_size)
    hparams = [0.05, 1e-8, 0.9, 0.999, weight_decay]
    states = [[torch.full((rows,), 0.1), torch.empty(0)] for _ in range(2)]
    w_tk = fused_steps(tk, case, Optimizer.ROWWISE_ADAGRAD, hparams, states[0], steps=2)
    w_ref = fused_steps(reference, case, Optimizer.ROWWISE_ADAGRAD, hparams, states[1], steps=2)
    assert not torch.equal(w_tk, case.weights)
    assert_close(w_tk, w_ref, 1e-5)
    assert_close(states[0][0], states[1][0], 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_storage(dtype):
    case = random_case(**CASES[2])  # mix hash, per-sample weights
    low = case.weights.to(dtype)
    args = case.forward_args()[1:]
    out = tk.forward(low, *args)
    assert out.dtype == torch.float32
    assert_close(out, reference.forward(low, *args), 1e-5)
    rows = rowwise_state_size(low.numel(), case.block_size)
    hparams = [0.05, 1e-8, 0.9, 0.999, 0.01]
    for code, size in ((Optimizer.ADAM, low.numel()), (Optimizer.ROWWISE_ADAGRAD, rows)):
        states = [[torch.zeros(size), torch.zeros(size)] for _ in range(2)]
        w_tk = fused_steps(tk, case, code, hparams, states[0], steps=1, weights=low)
        w_ref = fused_steps(reference, case, code, hparams, states[1], steps=1, weights=low)
        assert w_tk.dtype == dtype and not torch.equal(w_tk, low)
        assert_close(w_tk.float(), w_ref.float(), 1e-2)
        assert_close(states[0][0], states[1][0], 1e-5)
    with pytest.raises(ValueError, match="state1 must be a contiguous torch.float32 tensor"):
        fused_steps(tk, case, Optimizer.ADAGRAD, hparams,
                    [torch.zeros(low.numel(), dtype=dtype), torch.empty(0)], steps=1, weights=low)


# ---------------------------------------------------------------------------------------
# the input-check summary kernel against the checks run one by one
# ---------------------------------------------------------------------------------------

def _summary_case(g: torch.Generator, num_features: int, batch: int):
    """Random bags of ids near their bounds; sometimes a decreasing or misplaced offset, a
    non-finite per-sample weight."""
    num_rows = torch.randint(1, 20, (num_features,), generator=g)
    lengths = torch.randint(0, 4, (num_features * batch,), generator=g)
    rows_per_value = num_rows.repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * (rows_per_value + 2)).long() - 1
    values = torch.where(torch.rand(values.shape, generator=g) < 0.9,
                         values.clamp(0) % rows_per_value.clamp(min=1), values)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    kind = int(torch.randint(0, 6, (1,), generator=g))
    if kind == 0 and offsets.numel() > 2:
        offsets[int(torch.randint(1, offsets.numel() - 1, (1,), generator=g))] += 5
    elif kind == 1:
        offsets[-1] += 1
    psw = None
    if kind >= 4 and values.numel():
        psw = torch.rand(values.shape, generator=g)
        if kind == 5:
            psw[int(torch.randint(0, values.numel(), (1,), generator=g))] = float("nan")
    meta = build_table_meta([4] * num_features, [0] * num_features, [64] * num_features,
                            (num_rows.cumsum(0) - num_rows).tolist(), num_rows.tolist(),
                            [0] * num_features)
    return values, offsets, psw, meta


def _summary_trials(bounds: str, trials: int, max_features: int, min_batch: int):
    """``(trial, forward arguments)`` of :func:`_summary_case` inputs: up to
    ``max_features - 1`` features of dim 4, ``min_batch`` to 5 samples."""
    g = torch.Generator().manual_seed(11)
    weights = torch.zeros(64)
    for trial in range(trials):
        num_features = int(torch.randint(1, max_features, (1,), generator=g))
        batch = int(torch.randint(min_batch, 6, (1,), generator=g))
        values, offsets, psw, meta = _summary_case(g, num_features, batch)
        yield trial, (weights, values, offsets, psw, meta, 4 * num_features, 4,
                      int(HashMode.REFERENCE), hash_params(HashMode.REFERENCE, seed=trial),
                      int(BoundsCheck[bounds.upper()]))


@pytest.mark.parametrize("bounds", ["error", "unbounded"])
def test_input_summary_agrees_with_the_checks_one_by_one(bounds):
    """The one-launch summary (what a GPU runs) finds a problem exactly when the checks run
    one by one raise, over random inputs with and without problems, many features (its
    binary search over feature ends) and empty bags."""
    outcomes = set()
    for trial, args in _summary_trials(bounds, trials=40, max_features=40, min_batch=0):
        summaries = []
        try:
            check_inputs(*args, summarize=lambda *a: summaries.append(tk._summarize_inputs(*a)))
            raised = False
        except ValueError:
            raised = True
        assert summaries, "check_inputs never called the summary"
        assert summaries[0] == (not raised), f"trial {trial}: summary {summaries[0]}, raised {raised}"
        outcomes.add(raised)
    assert outcomes == {True, False}, "the trials must include clean and bad inputs"


@pytest.mark.parametrize("bounds", ["error", "unbounded"])
@pytest.mark.parametrize("short_bags", [False, True])
@pytest.mark.parametrize("col_tile", [256, 2])
def test_forward_kernel_counts_the_problems_the_summary_counts(bounds, short_bags, col_tile,
                                                               monkeypatch):
    """The forward kernel counts the input checks' problems as it pools (one launch less
    than the summary kernel): over the summary test's random inputs, both forward kernels
    count each kind of problem as the summary kernel does (with the offsets well formed;
    else both find an offsets problem), also when a feature spans several column tiles
    (only the first counts), and the forward raises exactly then."""
    counted = []
    answer = tk._answer
    monkeypatch.setattr(tk, "_answer", lambda problems, *rest: counted.append(
        problems.tolist()) or answer(problems, *rest))
    kinds = set()
    for trial, args in _summary_trials(bounds, trials=16, max_features=8, min_batch=1):
        if col_tile == 2:  # blocks of 2 of the dim-4 features: two column tiles each
            args = (*args[:6], 2, *args[7:])
        _, values, offsets, psw, meta = args[:5]
        _, id_check = check_layout(*args)
        summary = tk._launch_summary(values, offsets, psw, meta, id_check).tolist()
        counted.clear()
        with defer_checks(False), tuned(short_bag_mean=float("inf") if short_bags else -1.0,
                                        col_tile=col_tile):
            try:
                tk.forward(*args)
                raised = False
            except ValueError:
                raised = True
        assert len(counted) == 1, "the forward kernel did not count the problems"
        found, expected = [c > 0 for c in counted[0]], [c > 0 for c in summary]
        if expected[0] or expected[3]:  # offsets off: ids may lie outside every bag
            assert found[0] or found[3], f"trial {trial}: {counted[0]} against {summary}"
        else:
            assert counted[0] == summary, f"trial {trial}: {counted[0]} against {summary}"
        assert raised == any(expected), f"trial {trial}: raised {raised}, summary {summary}"
        kinds.update(i for i, bad in enumerate(expected) if bad)
    assert kinds >= {0, 2, 3, 1 if bounds == "error" else 0}, kinds


def test_matrix_cases_in_the_interpreter():
    """The GPU matrix's drawing and checking code, on the few of its cases small enough for
    the interpreter (the GPU runs all of them: tests/ops/test_gpu.py)."""
    from robe_torchrec.testing.gpu_checks import check_matrix_case, matrix_case

    small = [seed for seed in range(60)
             if matrix_case(seed)[1].values.numel() * max(
                 matrix_case(seed)[1].table_meta[1].tolist()) < 20_000][:4]
    assert len(small) == 4
    for seed in small:
        check_matrix_case(seed, device="cpu")


@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_two_pass_kernels(kw):
    """Block starts hashed in a pass of their own, then pooled and scattered from it: the
    same results as the reference (and, pooled in the same order, bitwise the one-pass
    per-bag kernel's forward)."""
    if kw.get("max_bag", 6) > 100:
        kw = dict(kw, max_bag=40)
    case = random_case(**kw)
    with tuned(short_bag_mean=-1.0):
        one_pass = tk.forward(*case.forward_args())
        with tuned(two_pass_mean_bag=0.0):
            assert torch.equal(tk.forward(*case.forward_args()), one_pass)
            check_forward(case)
            check_backward_dense(case)
