"""The C++ CPU kernels (robe_torchrec.ops.cpu) against the pure-PyTorch reference."""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

import robe_torchrec.ops  # noqa: F401  (registers torch.ops.robe.*)
from robe_torchrec.hashing import HashMode, block_starts, reference_key_limit
from robe_torchrec.ops import cpu, cpu_backend, reference
from robe_torchrec.ops.meta import (BoundsCheck, Optimizer, Pooling,
                                   rowwise_state_size)
from robe_torchrec.testing.op_cases import (ROWWISE_CASES, OpCase, case_matrix, fused_steps, random_case,
                             rowwise_adagrad_brute_force)

if cpu._find_compiler() is None:  # pragma: no cover - machines without g++
    pytest.skip("no C++ compiler: the C++ kernels cannot be built", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _built_extension():
    cpu.extension()  # build (or load) once, outside the timing of any single test


@contextlib.contextmanager
def num_threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: 1e-5 relative to the magnitude of the result (sums run in another order)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not torch.isnan(actual).any(), "kernel output holds NaN"
    if expected.dtype == torch.float64:
        rtol, atol = 1e-12, 1e-12
    elif expected.dtype in (torch.float16, torch.bfloat16):
        rtol, atol = 2e-2, 2e-2
    else:
        rtol, atol = 1e-5, 1e-5
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale)


def poison_allocator(nbytes: int) -> None:
    """Leave NaN-filled freed blocks of about ``nbytes`` in the allocator, so an op that
    forgets to write part of a fresh ``empty`` output is likely to return NaNs."""
    for size in (nbytes, nbytes + 64):
        blob = torch.full((max(size // 4, 1),), float("nan"), dtype=torch.float32)
        del blob


EXTRA = [
    dict(seed=300 + i, hash_mode=int(mode), index_dtype=idt, weighted=w, block_size=bs, shared=sh)
    for i, (mode, idt, w, bs, sh) in enumerate([
        (HashMode.REFERENCE, torch.int64, True, 2, False),
        (HashMode.MIX, torch.int32, True, 7, True),
        (HashMode.REFERENCE, torch.int32, False, 16, True),
        (HashMode.MIX, torch.int64, False, 3, False),
    ])
]
CASES = case_matrix() + EXTRA
CASE_IDS = [f"seed{c['seed']}" for c in CASES]


#: the fewest threads at which the backward scatters through the bucketed plan
PLAN_THREADS = 3


@pytest.fixture(params=["direct", "plan"])
def backward_path(request):
    """The backward's two ways to scatter: straight into the gradient (1 thread and an array of
    at most 12 MiB, or 2 threads and at most 4 MiB, as in these tests) and through the bucketed
    plan (more threads, larger arrays)."""
    with num_threads(1 if request.param == "direct" else PLAN_THREADS):
        # the tests' arrays are at most 40,000 float64s: the kernel must take the path named
        assert cpu.extension().use_direct_scatter(40_000, 8) == (request.param == "direct")
        yield request.param


def test_direct_scatter_limits():
    ext = cpu.extension()
    with num_threads(1):
        assert ext.use_direct_scatter(3 << 20, 4) and not ext.use_direct_scatter((3 << 20) + 1, 4)
        assert ext.use_direct_scatter(3 << 19, 8) and not ext.use_direct_scatter((3 << 19) + 1, 8)
    with num_threads(2):
        assert ext.use_direct_scatter(1 << 20, 4) and not ext.use_direct_scatter((1 << 20) + 1, 4)
    with num_threads(PLAN_THREADS):
        assert not ext.use_direct_scatter(1_000, 4)
    # beyond 512 KiB, or with grad_output rows longer than a page (4 KiB), it prefetches a
    # window of blocks ahead
    assert not ext.direct_scatter_windowed(131_072, 4, 4096)
    assert ext.direct_scatter_windowed(131_073, 4, 4096)
    assert ext.direct_scatter_windowed(1_000, 4, 4100)


def _l2_cache_bytes():
    """This CPU's L2 cache as Linux reports it (None where it does not)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text[:-1]) << 10 if text.endswith("K") else None


def test_forward_prefetches_beyond_this_cpus_l2():
    # the gathers from an array that fits L2 hit the caches anyway: no prefetches there
    ext = cpu.extension()
    l2 = _l2_cache_bytes() or 512 << 10
    assert not ext.forward_prefetches(l2) and ext.forward_prefetches(l2 + 1)


# Arrays on either side of the direct scatter's window: 400 KB and 1.2 MB of float32
_DIRECT_SCATTER_SIZES = [pytest.param(100_000, id="direct"), pytest.param(300_000, id="windowed")]


def grad_output_for(case: OpCase, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(case.batch, case.output_dim, generator=g, dtype=case.weights.dtype)


# ---------------------------------------------------------------------------------------
# forward / backward against the reference
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_forward_matches_reference(kw):
    case = random_case(**kw)
    expected = reference.forward(*case.forward_args())
    poison_allocator(expected.numel() * expected.element_size())
    actual = cpu.forward(*case.forward_args())
    assert_close(actual, expected)


@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_backward_dense_matches_reference(kw, backward_path):
    case = random_case(**kw)
    grad_output = grad_output_for(case)
    expected = reference.backward_dense(*case.backward_args(grad_output))
    poison_allocator(expected.numel() * expected.element_size())
    actual = cpu.backward_dense(*case.backward_args(grad_output))
    assert_close(actual, expected)


@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
def test_per_sample_weights_grad_matches_reference(kw):
    case = random_case(**kw)
    grad_output = grad_output_for(case)
    expected = reference.per_sample_weights_grad(*case.psw_grad_args(grad_output))
    poison_allocator(expected.numel() * expected.element_size())
    actual = cpu.per_sample_weights_grad(*case.psw_grad_args(grad_output))
    assert_close(actual, expected)


@pytest.mark.parametrize("mode", [HashMode.REFERENCE, HashMode.MIX])
def test_float64_matches_reference(mode):
    case = random_case(7, dtype=torch.float64, weighted=True, hash_mode=int(mode), batch=30)
    grad_output = grad_output_for(case)
    assert_close(cpu.forward(*case.forward_args()), reference.forward(*case.forward_args()))
    assert_close(cpu.backward_dense(*case.backward_args(grad_output)),
                 reference.backward_dense(*case.backward_args(grad_output)))
    assert_close(cpu.per_sample_weights_grad(*case.psw_grad_args(grad_output)),
                 reference.per_sample_weights_grad(*case.psw_grad_args(grad_output)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_weights(dtype):
    case = random_case(8, weighted=True, batch=20)
    case.weights = case.weights.to(dtype)
    assert_close(cpu.forward(*case.forward_args()), reference.forward(*case.forward_args()))
    grad_output = grad_output_for(case)
    expected = reference.backward_dense(*case.backward_args(grad_output.float())).to(dtype)
    assert_close(cpu.backward_dense(*case.backward_args(grad_output)), expected)


def _layout_case(out_offsets, dims, output_dim, seed=11, mode=HashMode.REFERENCE):
    """A case whose features leave gaps in, or overlap on, the output columns."""
    base = random_case(seed, dims=list(dims), batch=9, hash_mode=int(mode), weighted=True)
    meta = base.table_meta.clone()
    meta[0] = torch.tensor(out_offsets)
    base.table_meta = meta
    base.output_dim = output_dim
    return base


@pytest.mark.parametrize("out_offsets,dims,output_dim", [
    ([3, 20, 40], [8, 5, 16], 70),     # gaps before, between and after features
    ([0, 4, 6], [8, 5, 16], 22),       # overlapping features: their rows add up
    ([0, 8, 13], [8, 5, 16], 29),      # exact tiling (no zero fill)
])
def test_forward_output_layout(out_offsets, dims, output_dim):
    case = _layout_case(out_offsets, dims, output_dim)
    expected = reference.forward(*case.forward_args())
    poison_allocator(expected.numel() * 4)
    assert_close(cpu.forward(*case.forward_args()), expected)
    grad_output = grad_output_for(case)
    assert_close(cpu.backward_dense(*case.backward_args(grad_output)),
                 reference.backward_dense(*case.backward_args(grad_output)))
    assert_close(cpu.per_sample_weights_grad(*case.psw_grad_args(grad_output)),
                 reference.per_sample_weights_grad(*case.psw_grad_args(grad_output)))


def test_noncontiguous_inputs():
    case = random_case(12, weighted=True)
    expected = reference.forward(*case.forward_args())
    strided = OpCase(**{**case.__dict__})
    strided.weights = torch.stack([case.weights, case.weights], 1)[:, 0]
    strided.values = torch.stack([case.values, case.values], 1)[:, 1]
    strided.per_sample_weights = torch.stack([case.per_sample_weights] * 2, 1)[:, 0]
    assert not strided.weights.is_contiguous()
    assert_close(cpu.forward(*strided.forward_args()), expected)


# ---------------------------------------------------------------------------------------
# autograd through torch.ops.robe.forward
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [HashMode.REFERENCE, HashMode.MIX])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gradcheck(mode, index_dtype):
    case = random_case(21, dims=[4, 3, 6], batch=3, max_bag=4, block_size=2, hash_mode=int(mode),
                       weighted=True, index_dtype=index_dtype, dtype=torch.float64, memory_size=37,
                       empty_fraction=0.3)
    weights = case.weights.clone().requires_grad_(True)
    psw = case.per_sample_weights.clone().requires_grad_(True)

    def fn(w, p):
        return torch.ops.robe.forward(w, case.values, case.offsets, p, case.table_meta,
                                      case.output_dim, case.block_size, case.hash_mode,
                                      case.hash_params, case.bounds_check)

    with cpu_backend("cpp"):
        assert torch.autograd.gradcheck(fn, (weights, psw))


# ---------------------------------------------------------------------------------------
# fused optimizers against torch.optim on the reference gradient
# ---------------------------------------------------------------------------------------

OPTIMIZERS = [
    ("sgd", 0.0), ("sgd", 0.1), ("adagrad", 0.0), ("adagrad", 0.1), ("adam", 0.0), ("adam", 0.1),
]


@pytest.mark.parametrize("name,weight_decay", OPTIMIZERS)
@pytest.mark.parametrize("mode", [HashMode.REFERENCE, HashMode.MIX])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_optimizer_matches_torch_optim(name, weight_decay, mode, dtype, backward_path):
    case = random_case(31, batch=40, hash_mode=int(mode), weighted=True, dtype=dtype,
                       memory_size=40000)
    lr, eps, beta1, beta2 = 0.05, 1e-8, 0.9, 0.999
    param = torch.nn.Parameter(case.weights.clone())
    if name == "sgd":
        opt, code = torch.optim.SGD([param], lr=lr, weight_decay=weight_decay), Optimizer.SGD
    elif name == "adagrad":
        opt = torch.optim.Adagrad([param], lr=lr, eps=eps, weight_decay=weight_decay)
        code = Optimizer.ADAGRAD
    else:
        opt = torch.optim.Adam([param], lr=lr, eps=eps, betas=(beta1, beta2),
                               weight_decay=weight_decay)
        code = Optimizer.ADAM
    weights = case.weights.clone()
    state1, state2 = torch.zeros_like(weights), torch.zeros_like(weights)
    for step in range(1, 4):
        grad_output = grad_output_for(case, seed=step)
        param.grad = reference.backward_dense(*case.backward_args(grad_output))
        opt.step()
        cpu.backward_fused_(grad_output, weights, state1, state2, case.values, case.offsets,
                            case.per_sample_weights, case.table_meta, case.block_size,
                            case.hash_mode, case.hash_params, int(code),
                            [lr, eps, beta1, beta2, weight_decay], step)
        assert_close(weights, param.detach())
        st = opt.state[param]
        if name == "adagrad":
            assert_close(state1, st["sum"])
        if name == "adam":
            assert_close(state1, st["exp_avg"])
            assert_close(state2, st["exp_avg_sq"])


def test_fused_through_registered_op():
    case = random_case(32, weighted=True)
    grad_output = grad_output_for(case)
    w_ref, w_cpp = case.weights.clone(), case.weights.clone()
    s_ref, s_cpp = torch.zeros_like(w_ref), torch.zeros_like(w_cpp)
    empty = torch.empty(0)
    hp = [0.1, 1e-10, 0.9, 0.999, 0.0]
    for backend, w, s in (("reference", w_ref, s_ref), ("cpp", w_cpp, s_cpp)):
        with cpu_backend(backend):
            torch.ops.robe.backward_fused_(grad_output, w, s, empty, case.values, case.offsets,
                                           case.per_sample_weights, case.table_meta,
                                           case.block_size, case.hash_mode, case.hash_params,
                                           int(Optimizer.ADAGRAD), hp, 1)
    assert_close(w_cpp, w_ref)
    assert_close(s_cpp, s_ref)


# ---------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------

def test_built_with_openmp():
    assert cpu.extension().openmp_enabled()


def test_build_directory(monkeypatch):
    monkeypatch.delenv("ROBE_TORCHREC_BUILD_DIR", raising=False)
    default = cpu.build_directory()
    assert torch.__version__ in default and "robe_torchrec" in default
    monkeypatch.setenv("ROBE_TORCHREC_BUILD_DIR", "/tmp/somewhere")
    assert cpu.build_directory() == "/tmp/somewhere"


def test_build_directory_follows_the_source(monkeypatch, tmp_path):
    """Two checkouts of different kernel versions sharing one venv must not rebuild each
    other's kernel on every load: each source gets a directory of its own."""
    monkeypatch.delenv("ROBE_TORCHREC_BUILD_DIR", raising=False)
    default = cpu.build_directory()
    other = tmp_path / "forward.cpp"
    with open(cpu._SOURCES[0]) as f:
        other.write_text(f.read() + "\n// another version\n")
    monkeypatch.setattr(cpu, "_SOURCES", [str(other)] + cpu._SOURCES[1:])
    assert cpu.build_directory() != default


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="install g\\+\\+.*ROBE_CPU_BACKEND=reference"):
        cpu.extension()


@pytest.mark.parametrize("memory_size", _DIRECT_SCATTER_SIZES)
@pytest.mark.parametrize("mode", [HashMode.REFERENCE, HashMode.MIX])
def test_same_result_at_any_thread_count(mode, memory_size):
    # One and two threads scatter the backward straight into the gradient (with or without its
    # window of prefetched blocks; at two, the fused step split across threads),
    # three go through the bucketed plan: the sums must still be bitwise the same. Dim 12 gives
    # partial blocks, and blocks straddle the plan's ranges.
    case = random_case(41, dims=[32, 16, 12], batch=3000, max_bag=5, block_size=8,
                       hash_mode=int(mode), weighted=True, memory_size=memory_size)
    windowed = cpu.extension().direct_scatter_windowed(memory_size, 4, case.output_dim * 4)
    assert windowed == (memory_size > 131_072)
    grad_output = grad_output_for(case)
    results = []
    for n in (1, 2, PLAN_THREADS):
        with num_threads(n):
            w, s1, s2 = case.weights.clone(), torch.zeros_like(case.weights), torch.zeros_like(case.weights)
            cpu.backward_fused_(grad_output, w, s1, s2, case.values, case.offsets,
                                case.per_sample_weights, case.table_meta, case.block_size,
                                case.hash_mode, case.hash_params, int(Optimizer.ADAM),
                                [0.01, 1e-8, 0.9, 0.999, 0.01], 1)
            results.append([
                cpu.forward(*case.forward_args()),
                cpu.backward_dense(*case.backward_args(grad_output)),
                cpu.per_sample_weights_grad(*case.psw_grad_args(grad_output)),
                w, s1, s2,
            ])
    for one, *others in zip(*results):
        for other in others:
            assert torch.equal(one, other)  # the kernels are deterministic
    assert_close(results[0][0], reference.forward(*case.forward_args()))
    assert_close(results[0][1], reference.backward_dense(*case.backward_args(grad_output)))


@pytest.mark.parametrize("memory_size", _DIRECT_SCATTER_SIZES)
@pytest.mark.parametrize("block_size", [4, 8, 16, 32])
def test_whole_blocks_of_each_fixed_length(block_size, memory_size, backward_path):
    """Every feature's dim a multiple of Z = 4, 8, 16 or 32 (float32): the forward pools and
    the direct scatter adds each block with a loop of fixed length Z, with and without the
    forward's prefetch (arrays beyond L2) and the scatter's window."""
    case = random_case(500 + block_size, dims=[block_size, 2 * block_size, 4 * block_size],
                       batch=64, max_bag=4, block_size=block_size, weighted=True,
                       memory_size=memory_size)
    grad_output = grad_output_for(case)
    assert_close(cpu.forward(*case.forward_args()), reference.forward(*case.forward_args()))
    assert_close(cpu.backward_dense(*case.backward_args(grad_output)),
                 reference.backward_dense(*case.backward_args(grad_output)))


def test_fastmod_from_32_bit_halves_is_exact():
    """The reference hash's vectorised block loop (RefHash::starts) takes the high half of
    (magic * h mod 2**64) * d from the low product's 32-bit halves, where blocks() takes it
    from a 128-bit product: both must be h mod d for every h < P and d <= P, also for the
    spans near P that the tests' arrays are far too small to reach. This checks that
    arithmetic, written as the kernel writes it; the forward tests check the kernel itself
    against the reference at the spans they reach."""
    prime, mask = 2038074743, (1 << 64) - 1
    rng = random.Random(5)
    ds = [1, 2, 3, prime - 2, prime - 1, prime] + [rng.randrange(1, prime + 1) for _ in range(200)]
    for d in ds:
        magic = (mask // d + 1) & mask
        for h in [0, 1, d - 1, d, prime - 1] + [rng.randrange(prime) for _ in range(50)]:
            h %= prime
            low = (magic * h) & mask
            wide = (low * d) >> 64
            halves = (((low >> 32) * d) + (((low & 0xFFFFFFFF) * d) >> 32)) >> 32
            assert halves == wide == h % d
            assert ((low >> 32) * d + (((low & 0xFFFFFFFF) * d) >> 32)) < 1 << 64  # no overflow


@pytest.mark.parametrize("mode", [HashMode.REFERENCE, HashMode.MIX])
@pytest.mark.parametrize("dims", [[24, 40, 17], [24, 8, 17], [24, 260, 17]],
                         ids=["all_beyond_two", "one_of_two", "one_beyond_64"])
@pytest.mark.parametrize("memory_size", _DIRECT_SCATTER_SIZES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_forward_hashes_many_blocks_in_one_loop(mode, dims, memory_size, index_dtype):
    """The forward writes each value's block starts in one loop when every feature spans more
    than two blocks (Z = 4: 6, 10 and 5 blocks; the reference hash also needs at most 64, so
    a feature of 65 sends it block by block, the mix hash not), and block by block when one
    spans two: per-sample weights, SUM and MEAN, separate arrays, against the reference, with
    and without prefetches (arrays beyond L2)."""
    for shared in (True, False):
        case = random_case(700 + len(dims) + dims[1], dims=dims, batch=40, max_bag=4, block_size=4,
                           hash_mode=int(mode), weighted=True, shared=shared,
                           index_dtype=index_dtype, memory_size=memory_size)
        assert_close(cpu.forward(*case.forward_args()), reference.forward(*case.forward_args()))


@pytest.mark.parametrize("block_size", [8, 5])
def test_wide_rows_take_the_window(block_size, backward_path):
    """grad_output rows longer than a page send the direct scatter through its window even
    for an array that fits in L2: whole and partial blocks, against the reference."""
    case = random_case(600 + block_size, dims=[520, 512, 40], batch=24, max_bag=3,
                       block_size=block_size, weighted=True, memory_size=5_000)
    assert cpu.extension().direct_scatter_windowed(5_000, 4, case.output_dim * 4)
    assert not cpu.extension().direct_scatter_windowed(5_000, 4, 4096)
    grad_output = grad_output_for(case)
    assert_close(cpu.backward_dense(*case.backward_args(grad_output)),
                 reference.backward_dense(*case.backward_args(grad_output)))
    w = case.weights.clone()
    cpu.backward_fused_(grad_output, w, torch.zeros(0), torch.zeros(0), case.values,
                        case.offsets, case.per_sample_weights, case.table_meta, case.block_size,
                        case.hash_mode, case.hash_params, int(Optimizer.SGD),
                        [0.5, 0.0, 0.0, 0.0, 0.0], 1)
    expected = case.weights - 0.5 * reference.backward_dense(*case.backward_args(grad_output))
    assert_close(w, expected)


@pytest.mark.parametrize("layout", ["broadcast scalar", "broadcast row", "column slice",
                                    "transposed"])
def test_backward_reads_gradient_rows_of_any_stride(layout, backward_path):
    """The backward ops read the gradient where it lies: sum(output)'s gradient is a scalar
    broadcast to [B, D] (strides 0, 0), and copying it out would cost more than the scatter.
    Every layout gives bitwise the result of the same gradient made contiguous."""
    case = random_case(45, dims=[8, 12], batch=40, block_size=4, weighted=True, memory_size=300)
    rows, cols = case.batch, case.output_dim
    g = torch.Generator().manual_seed(1)
    grad = {
        "broadcast scalar": lambda: torch.tensor(0.75).expand(rows, cols),
        "broadcast row": lambda: torch.randn(cols, generator=g).expand(rows, cols),
        "column slice": lambda: torch.randn(rows, cols + 5, generator=g)[:, 2:2 + cols],
        "transposed": lambda: torch.randn(cols, rows, generator=g).t(),
    }[layout]()
    assert not grad.is_contiguous()
    dense = grad.contiguous()
    for op, args in ((cpu.backward_dense, case.backward_args),
                     (cpu.per_sample_weights_grad, case.psw_grad_args)):
        assert torch.equal(op(*args(grad)), op(*args(dense)))
    updated = []
    for gradient in (grad, dense):
        w, s1, s2 = case.weights.clone(), torch.zeros_like(case.weights), torch.zeros_like(case.weights)
        cpu.backward_fused_(gradient, w, s1, s2, case.values, case.offsets, case.per_sample_weights,
                            case.table_meta, case.block_size, case.hash_mode, case.hash_params,
                            int(Optimizer.ADAGRAD), [0.1, 1e-8, 0.9, 0.999, 0.0], 1)
        updated.append((w, s1))
    assert all(torch.equal(a, b) for a, b in zip(*updated))
    assert_close(cpu.backward_dense(*case.backward_args(grad)),
                 reference.backward_dense(*case.backward_args(dense)))


def test_backward_of_an_empty_broadcast_gradient():
    case = random_case(46, dims=[8], batch=0, block_size=4, memory_size=300)
    grad = torch.tensor(1.0).expand(0, case.output_dim)
    assert torch.equal(cpu.backward_dense(*case.backward_args(grad)), torch.zeros(300))


# ---------------------------------------------------------------------------------------
# the profiling aids of the CPU benchmark (forward_hash_only, forward_gather_only)
# ---------------------------------------------------------------------------------------

def _sum_of_block_starts(case: OpCase) -> int:
    """What forward_hash_only returns: the sum of every (value, block) start in the flat
    weights (its feature's weight offset plus its hashed start), from hashing.py."""
    meta, z = case.table_meta, case.block_size
    total = 0
    for t in range(meta.shape[1]):
        dim, w_offset, w_size, row_offset = (int(meta[f, t]) for f in (1, 2, 3, 4))
        ids = case.values[case.offsets[t * case.batch]:case.offsets[(t + 1) * case.batch]]
        starts = block_starts(ids.long() + row_offset, math.ceil(dim / z), w_size, z,
                              HashMode(case.hash_mode), case.hash_params)
        total += int(starts.sum()) + w_offset * starts.numel()
    return total


# many chunks at 2 threads: each adds its rows' sum into the result
_MANY_CHUNKS = dict(seed=41, dims=[32, 16, 12], batch=3000, max_bag=5, block_size=8, weighted=True,
                    memory_size=100_000)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kw", CASES[:6] + [_MANY_CHUNKS], ids=CASE_IDS[:6] + ["many_chunks"])
def test_profiling_aids_do_the_forwards_work(kw, threads):
    # The benchmark reads hash-only and gather-only times as parts of the forward: they must
    # hash the same blocks and gather the same rows (not skip work the compiler could drop).
    case = random_case(**kw)
    with num_threads(threads):
        assert cpu.forward_hash_only(*case.forward_args()) == _sum_of_block_starts(case)
        pooled = cpu.forward_gather_only(*case.forward_args())
    assert pooled.shape == (case.output_dim,)
    assert_close(pooled, reference.forward(*case.forward_args()).sum(0))


def test_profiling_aids_take_float32_only():
    case = random_case(3, dtype=torch.float64)
    for aid in (cpu.forward_hash_only, cpu.forward_gather_only):
        with pytest.raises(ValueError, match=f"{aid.__name__} takes float32 weights"):
            aid(*case.forward_args())


# ---------------------------------------------------------------------------------------
# bad inputs: ValueError with the reference's message
# ---------------------------------------------------------------------------------------

def _same_error(case: OpCase, match: str) -> None:
    with pytest.raises(ValueError) as ref_err:
        reference.forward(*case.forward_args())
    with pytest.raises(ValueError, match=match) as cpp_err:
        cpu.forward(*case.forward_args())
    assert str(cpp_err.value) == str(ref_err.value)


def _ids_case(index_dtype=torch.int64, **kw) -> OpCase:
    case = random_case(51, batch=6, max_bag=4, empty_fraction=0.0, index_dtype=index_dtype, **kw)
    lengths = (case.offsets[1:] - case.offsets[:-1]).reshape(4, case.batch).sum(1)
    assert bool((lengths >= 3).all()) and case.values.numel() >= 8
    return case


def _feature_of(case: OpCase, pos: int) -> int:
    ends = case.offsets[case.batch::case.batch].tolist()
    return next(t for t, end in enumerate(ends) if pos < end)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_out_of_range_id(index_dtype):
    case = _ids_case(index_dtype)
    pos = case.values.numel() - 3
    case.values[pos] = 10**6
    case.values[-1] = 10**6 + 1  # a later bad id: the first one is reported
    _same_error(case, f"id 1000000 at position {pos} of feature {_feature_of(case, pos)} is out of range")


def test_negative_id():
    case = _ids_case()
    case.values[5] = -4
    _same_error(case, f"id -4 at position 5 of feature {_feature_of(case, 5)} is out of range")


def test_decreasing_offsets():
    case = _ids_case()
    case.offsets[8] = case.offsets[10] + 1  # bag 8 (feature 1, sample 2) grows past bag 9
    _same_error(case, "offsets decrease at bag 8")


def test_offsets_middle_out_of_bounds():
    case = _ids_case()
    case.offsets[3] = case.values.numel() + 100  # must not read past values
    _same_error(case, "offsets decrease at bag 3")


def test_offsets_last_mismatch():
    case = _ids_case()
    case.offsets[-1] -= 1
    _same_error(case, r"offsets\[-1\] = .* but values has")


def test_offsets_first_nonzero():
    case = _ids_case()
    case.offsets[0] = 1
    _same_error(case, r"offsets\[0\] must be 0, got 1")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_per_sample_weight(bad):
    case = _ids_case(weighted=True)
    case.per_sample_weights[7] = bad
    _same_error(case, r"per_sample_weights\[7\] is .*; weights must be finite")


def test_meta_errors():
    case = _ids_case()
    case.output_dim -= 1
    _same_error(case, "output_dim .* is smaller than the features' dims")
    case = _ids_case()
    case.weights = case.weights[:500]
    _same_error(case, "every ROBE array must hold at least block_size")


def test_backward_rejects_bad_offsets():
    case = _ids_case()
    grad_output = grad_output_for(case)
    case.offsets[4] = case.values.numel() + 5
    for fn, args in ((cpu.backward_dense, case.backward_args(grad_output)),
                     (cpu.per_sample_weights_grad, case.psw_grad_args(grad_output))):
        with pytest.raises(ValueError, match="offsets decrease at bag 4"):
            fn(*args)


def test_reference_hash_key_limit_unbounded():
    case = _ids_case(hash_mode=int(HashMode.REFERENCE))
    case.bounds_check = int(BoundsCheck.UNBOUNDED)
    max_blocks = max(math.ceil(int(d) / case.block_size) for d in case.table_meta[1])
    limit = reference_key_limit(max_blocks, case.hash_params)
    row_offset = int(case.table_meta[4, 2])
    # ids past num_rows are fine in UNBOUNDED mode as long as the key is below the limit
    start = int(case.offsets[2 * case.batch])
    case.values[start] = limit - 1 - row_offset
    case.values[start + 1] = 10**7
    assert_close(cpu.forward(*case.forward_args()), reference.forward(*case.forward_args()))
    case.values[start + 1] = limit - row_offset  # key == limit: over
    _same_error(case, f"id {limit - row_offset} at position {start + 1} of feature 2 cannot be "
                      r"hashed by the reference hash \(keys must lie in \[0, " f"{limit}\\)")
    case.values[start + 1] = -1
    _same_error(case, "id -1 at position .* cannot be hashed by the reference hash")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_unbounded_mix_hash_accepts_any_id(index_dtype):
    case = _ids_case(index_dtype, hash_mode=int(HashMode.MIX), weighted=True)
    case.bounds_check = int(BoundsCheck.UNBOUNDED)
    info = torch.iinfo(index_dtype)
    specials = torch.tensor([info.min, info.max, -1, -123456, info.max - 7, 0], dtype=index_dtype)
    case.values[: specials.numel()] = specials
    g = torch.Generator().manual_seed(5)
    rest = case.values.numel() - specials.numel()
    case.values[specials.numel():] = torch.randint(info.min, info.max, (rest,), generator=g,
                                                   dtype=torch.int64).to(index_dtype)
    assert_close(cpu.forward(*case.forward_args()), reference.forward(*case.forward_args()))
    grad_output = grad_output_for(case)
    assert_close(cpu.backward_dense(*case.backward_args(grad_output)),
                 reference.backward_dense(*case.backward_args(grad_output)))
    assert_close(cpu.per_sample_weights_grad(*case.psw_grad_args(grad_output)),
                 reference.per_sample_weights_grad(*case.psw_grad_args(grad_output)))
    case.bounds_check = int(BoundsCheck.ERROR)
    _same_error(case, f"id {info.min} at position 0 of feature {_feature_of(case, 0)} is out of range")


def test_errors_through_registered_op():
    case = _ids_case()
    case.values[2] = -1
    with cpu_backend("cpp"), pytest.raises(ValueError, match="id -1 at position 2"):
        torch.ops.robe.forward(*case.forward_args())


def test_mean_pooling_of_empty_bags_is_zero():
    case = random_case(61, pooling=[int(Pooling.MEAN)] * 4, empty_fraction=0.5, weighted=True)
    out = cpu.forward(*case.forward_args())
    lengths = (case.offsets[1:] - case.offsets[:-1]).reshape(4, case.batch)
    dims = case.table_meta[1].tolist()
    col = 0
    for t, d in enumerate(dims):
        empty = lengths[t] == 0
        assert empty.any()
        assert torch.equal(out[empty, col:col + d], torch.zeros(int(empty.sum()), d))
        col += d
    assert_close(out, reference.forward(*case.forward_args()))


def test_large_memory_and_block_spanning_ranges():
    """A memory large enough for many destination ranges, a block size that is no divisor."""
    case = random_case(71, dims=[40, 24], batch=200, block_size=12, memory_size=300_000,
                       weighted=True, shared=False)
    grad_output = grad_output_for(case)
    assert_close(cpu.forward(*case.forward_args()), reference.forward(*case.forward_args()))
    assert_close(cpu.backward_dense(*case.backward_args(grad_output)),
                 reference.backward_dense(*case.backward_args(grad_output)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_output_takes_the_streaming_store(dtype):
    """Outputs of 2 MiB and more are written with non-temporal stores (AVX builds): an odd row
    width makes rows start unaligned and end in a tail, both of which take the scalar path."""
    batch = 4096
    case = random_case(83, dims=[67, 64], batch=batch, block_size=8, dtype=dtype, max_bag=2)
    assert case.output_dim % 2 == 1 and batch * case.output_dim * dtype.itemsize >= 2 << 20
    assert_close(cpu.forward(*case.forward_args()), reference.forward(*case.forward_args()))


@pytest.mark.parametrize("weighted", [False, True])
def test_forward_tile_buffers_grow_with_long_bags(weighted):
    """The forward's per-tile buffers grow with the bags: bags of up to 600 ids among short
    and empty ones make them grow inside one tile (and on 2 threads, in each thread's own
    buffers)."""
    case = random_case(91, dims=[16, 5], batch=40, max_bag=600, block_size=4, weighted=weighted)
    expected = reference.forward(*case.forward_args())
    for threads in (1, 2):
        with num_threads(threads):
            assert_close(cpu.forward(*case.forward_args()), expected)


# ---------------------------------------------------------------------------------------
# row-wise Adagrad
# ---------------------------------------------------------------------------------------

def _rowwise_case(block_size, shared, weighted, dtype=torch.float32, seed=61, **kw):
    return random_case(seed, batch=30, block_size=block_size, shared=shared, weighted=weighted,
                       dtype=dtype, memory_size=1001, **kw)


@pytest.mark.parametrize("block_size,shared,weighted,weight_decay", ROWWISE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rowwise_adagrad_matches_reference(block_size, shared, weighted, weight_decay, dtype,
                                           backward_path):
    case = _rowwise_case(block_size, shared, weighted, dtype)
    rows = rowwise_state_size(case.weights.numel(), block_size)
    hparams = [0.05, 1e-8, 0.9, 0.999, weight_decay]
    states = {impl: [torch.full((rows,), 0.1, dtype=dtype), torch.empty(0, dtype=dtype)]
              for impl in ("cpp", "ref")}
    w_cpp = fused_steps(cpu, case, Optimizer.ROWWISE_ADAGRAD, hparams, states["cpp"])
    w_ref = fused_steps(reference, case, Optimizer.ROWWISE_ADAGRAD, hparams, states["ref"])
    assert not torch.equal(w_cpp, case.weights)
    assert_close(w_cpp, w_ref)
    assert_close(states["cpp"][0], states["ref"][0])


def test_rowwise_adagrad_brute_force():
    # 11 floats in rows of 3: rows 0-2 full, row 3 holds 2; gradient from autograd of the
    # reference forward, so neither backward is trusted
    case = random_case(62, dims=[5, 4], batch=3, block_size=3, memory_size=11,
                       weighted=True, dtype=torch.float64, empty_fraction=0.0)
    lr, eps, wd = 0.3, 1e-6, 0.05
    w = case.weights.clone().requires_grad_(True)
    g_out = torch.randn(case.batch, case.output_dim, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(1))
    (reference.forward(w, *case.forward_args()[1:]) * g_out).sum().backward()
    state0 = torch.rand(4, dtype=torch.float64)
    expected_w, expected_s = rowwise_adagrad_brute_force(case.weights, w.grad, state0, 3, lr,
                                                         eps, wd)
    for impl in (reference, cpu):
        weights, state = case.weights.clone(), state0.clone()
        impl.backward_fused_(g_out, weights, state, torch.empty(0, dtype=torch.float64),
                             case.values, case.offsets, case.per_sample_weights, case.table_meta,
                             3, case.hash_mode, case.hash_params, int(Optimizer.ROWWISE_ADAGRAD),
                             [lr, eps, 0.9, 0.999, wd], 1)
        assert_close(weights, expected_w)
        assert_close(state, expected_s)


@pytest.mark.parametrize("memory_size", _DIRECT_SCATTER_SIZES)
@pytest.mark.parametrize("mode", [HashMode.REFERENCE, HashMode.MIX])
def test_rowwise_adagrad_same_at_any_thread_count(mode, memory_size):
    # Z = 12 does not divide the plan's 16384-float ranges: rows straddle them
    case = random_case(43, dims=[32, 12], batch=3000, block_size=12, hash_mode=int(mode),
                       weighted=True, memory_size=memory_size + 3)
    rows = rowwise_state_size(case.weights.numel(), 12)
    results = []
    for n in (1, 2, PLAN_THREADS):
        with num_threads(n):
            state = [torch.zeros(rows), torch.empty(0)]
            results.append((fused_steps(cpu, case, Optimizer.ROWWISE_ADAGRAD,
                                        [0.05, 1e-8, 0.9, 0.999, 0.01], state, steps=2), state[0]))
    for other in results[1:]:
        assert torch.equal(results[0][0], other[0]) and torch.equal(results[0][1], other[1])


def test_rowwise_adagrad_state_is_checked():
    case = _rowwise_case(4, True, False)
    rows = rowwise_state_size(case.weights.numel(), 4)
    for bad in (torch.zeros(rows - 1), torch.zeros(case.weights.numel()),
                torch.zeros(rows, dtype=torch.float64)):
        with pytest.raises(ValueError, match="state1 must be a contiguous Float tensor of 251"):
            fused_steps(cpu, case, Optimizer.ROWWISE_ADAGRAD, [0.1, 1e-8, 0, 0, 0],
                        [bad, torch.empty(0)], steps=1)


# ---------------------------------------------------------------------------------------
# float16 / bfloat16 storage: float32 accumulation, output and optimizer state
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_forward_against_float32(dtype):
    """The error of half storage is the rounding of the array alone: the pooled output is
    computed in float32 from the rounded array, exactly as the float32 kernel would."""
    case = random_case(71, batch=200, max_bag=20, weighted=True, dims=[64, 16, 33],
                       block_size=8, memory_size=20_000)
    low = case.weights.to(dtype)
    args = case.forward_args()[1:]
    out = cpu.forward(low, *args)
    assert out.dtype == torch.float32
    # the float32 kernel on the same (rounded) array: only the summation order may differ
    assert_close(out, cpu.forward(low.float(), *args))
    assert_close(out, reference.forward(low, *args))
    # against the unrounded float32 array: the storage error, bounded by the rounding of
    # every summand (unit roundoff 2**-11 for float16, 2**-8 for bfloat16)
    exact = cpu.forward(case.weights, *args)
    bound = reference.forward(case.weights.abs(), case.values, case.offsets,
                              None if case.per_sample_weights is None else case.per_sample_weights.abs(),
                              *args[3:])
    unit = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    assert bool(((out - exact).abs() <= unit * bound + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("code", [Optimizer.SGD, Optimizer.ADAGRAD, Optimizer.ADAM,
                                  Optimizer.ROWWISE_ADAGRAD])
def test_low_precision_fused_step(dtype, code, backward_path):
    """The update reads the half weights, steps in float32 with float32 state and writes the
    weights back rounded: the float32 step on the rounded array, then rounded."""
    case = random_case(72, batch=30, weighted=True, block_size=5, memory_size=1001)
    low = case.weights.to(dtype)
    size = (rowwise_state_size(low.numel(), 5) if code == Optimizer.ROWWISE_ADAGRAD
            else low.numel())
    hparams = [0.05, 1e-8, 0.9, 0.999, 0.01]
    states_low = [torch.zeros(size), torch.zeros(size)]
    states_32 = [torch.zeros(size), torch.zeros(size)]
    g = grad_output_for(case, seed=3)
    rest = (case.values, case.offsets, case.per_sample_weights, case.table_meta, 5,
            case.hash_mode, case.hash_params, int(code), hparams, 1)
    w_low, w_32 = low.clone(), low.float()
    cpu.backward_fused_(g, w_low, *states_low, *rest)
    cpu.backward_fused_(g, w_32, *states_32, *rest)
    assert w_low.dtype == dtype and not torch.equal(w_low, low)
    # (not bitwise: the compiler may contract multiply-adds differently per weight type)
    assert_close(w_low, w_32.to(dtype))
    for mine, theirs in zip(states_low, states_32):
        assert_close(mine, theirs)
    w_ref, states_ref = low.clone(), [torch.zeros(size), torch.zeros(size)]
    reference.backward_fused_(g, w_ref, *states_ref, *rest)
    assert_close(w_low, w_ref)
    if code == Optimizer.SGD:
        return
    with pytest.raises(ValueError, match="state1 must be a contiguous Float tensor"):
        cpu.backward_fused_(g, low.clone(), torch.zeros(size, dtype=dtype),
                            torch.zeros(size, dtype=dtype), *rest)


@pytest.mark.parametrize("op", ["backward_dense", "per_sample_weights_grad", "backward_fused_"])
def test_backward_kernels_refuse_integer_weights(op):
    """The C++ backward ops check their weights' dtype themselves, one check for all three
    (the Python wrapper checks it first; this is the extension called directly)."""
    case = random_case(seed=3)
    layout = (int(case.block_size), int(case.hash_mode), [int(p) for p in case.hash_params])
    weights = case.weights.to(torch.int32)
    with pytest.raises(ValueError, match="weights must be a floating point tensor, got Int"):
        if op == "backward_fused_":
            state = torch.zeros(0)
            cpu.extension().backward_fused_(case.grad(), weights, state, state, case.values,
                                            case.offsets, case.per_sample_weights,
                                            case.table_meta, *layout, int(Optimizer.SGD),
                                            [0.1, 0.0, 0.9, 0.999, 0.0], 1)
        else:
            psw = (case.per_sample_weights,) if op == "backward_dense" else ()
            getattr(cpu.extension(), op)(case.grad(), weights, case.values, case.offsets,
                                         *psw, case.table_meta, *layout)
