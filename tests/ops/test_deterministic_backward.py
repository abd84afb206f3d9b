"""The Triton weight gradient summed in a fixed order (``TritonTuning.deterministic_backward``,
and on CUDA ``torch.use_deterministic_algorithms(True)``), run on CPU tensors by Triton's
interpreter: against the reference, and bit for bit against the sum it promises (every
(id, block) pair's contribution added in the order of the first element its block writes,
ties in pair order), which is what makes two GPU runs agree. Its guard against deferred bad input is tested with
the atomic kernels' in ``test_deferred_checks.py``."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this module

import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from robe_torchrec import hashing  # noqa: E402
from robe_torchrec.hashing import HashMode  # noqa: E402
from robe_torchrec.ops import reference  # noqa: E402
from robe_torchrec.ops import meta as m  # noqa: E402
from robe_torchrec.ops import triton_kernels as tk  # noqa: E402
from robe_torchrec.ops.tuning import tuned  # noqa: E402
from robe_torchrec.testing.op_cases import case_matrix, fused_steps, random_case  # noqa: E402
from robe_torchrec.testing.op_checks import (  # noqa: E402
    assert_close, check_backward_dense, fused_states)

if not (tk._is_interpreted(tk)
        and type(sys.modules["triton.language"].standard.sum).__name__ == "InterpretedFunction"):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (by an earlier test "
                "module?); run this file in its own process", allow_module_level=True)

CASES = case_matrix()


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Buffers the wrappers allocate with torch.empty start as NaN (-1 for ints)."""
    monkeypatch.setattr(tk, "POISON_EMPTY", True)


def ordered_sum(case, grad_output: torch.Tensor) -> torch.Tensor:
    """The gradient the deterministic kernel promises, summed one pair at a time in numpy
    (IEEE, in the accumulation dtype): pairs sorted by their block's first element, ties in
    pair order ``i * num_blocks + blk``; each adds ``g / divisor * psw`` to its lanes."""
    meta = case.table_meta
    offsets = case.offsets.to(torch.int64)
    batch = case.batch
    dims = meta[m.DIM]
    z = case.block_size
    num_blocks = -(-int(dims.max()) // z)
    acc = np.float64 if case.weights.dtype == torch.float64 else np.float32
    pairs = []
    for bag in range(offsets.numel() - 1):
        t, b = divmod(bag, batch)
        lo, hi = int(offsets[bag]), int(offsets[bag + 1])
        mean = int(meta[m.POOLING][t]) == int(m.Pooling.MEAN)
        divisor = acc(max(hi - lo, 1) if mean else 1)
        keys = case.values[lo:hi].to(torch.int64) + meta[m.ROW_OFFSET][t]
        starts = hashing.block_starts(keys, num_blocks, int(meta[m.W_SIZE][t]), z,
                                      HashMode(case.hash_mode), case.hash_params)
        for k, i in enumerate(range(lo, hi)):
            for blk in range(num_blocks):
                lanes = min(z, int(dims[t]) - blk * z)
                if lanes > 0:
                    first = int(meta[m.W_OFFSET][t] + starts[k, blk])
                    pairs.append((first, i * num_blocks + blk, i, b, t, blk, lanes, divisor))
    g = grad_output.numpy().astype(acc)
    psw = None if case.per_sample_weights is None else case.per_sample_weights.numpy()
    out = np.zeros(case.weights.numel(), dtype=acc)
    for first, _, i, b, t, blk, lanes, divisor in sorted(pairs):
        col = int(meta[m.OUT_OFFSET][t]) + blk * z
        contrib = g[b, col:col + lanes] / divisor
        if psw is not None:
            contrib = contrib * acc(psw[i])
        out[first:first + lanes] += contrib
    return torch.from_numpy(out)


def colliding_case(seed: int, **kw):
    """Few floats for many blocks: most elements sum several pairs, so the order shows."""
    return random_case(seed, memory_size=23, batch=5, max_bag=5, empty_fraction=0.1, **kw)


@pytest.mark.parametrize("kw", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_against_reference(kw):
    with tuned(deterministic_backward=True):
        check_backward_dense(random_case(**kw))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("hash_mode", [HashMode.REFERENCE, HashMode.MIX])
def test_bitwise_the_ordered_sum(weighted, hash_mode):
    case = colliding_case(3, weighted=weighted, hash_mode=int(hash_mode))
    g = case.grad()
    with tuned(deterministic_backward=True):
        got = tk.backward_dense(*case.backward_args(g))
    assert torch.equal(got, ordered_sum(case, g))


def test_bitwise_the_ordered_sum_float64_and_block_sizes():
    for block_size in (1, 3, 8):
        case = colliding_case(4, weighted=True, dtype=torch.float64, block_size=block_size)
        g = case.grad()
        with tuned(deterministic_backward=True):
            got = tk.backward_dense(*case.backward_args(g))
        assert torch.equal(got, ordered_sum(case, g)), block_size


@pytest.mark.parametrize("optimizer", [m.Optimizer.SGD, m.Optimizer.ADAGRAD, m.Optimizer.ADAM,
                                       m.Optimizer.ROWWISE_ADAGRAD])
def test_fused_steps_against_reference(optimizer):
    case = colliding_case(5, weighted=True)
    hparams = [0.05, 1e-8, 0.9, 0.999, 0.01]
    expected = fused_steps(reference, case, optimizer, hparams, fused_states(case, optimizer))
    with tuned(deterministic_backward=True):
        got = fused_steps(tk, case, optimizer, hparams, fused_states(case, optimizer))
    assert_close(got, expected, 1e-5)


def test_cuda_follows_torch_deterministic_mode():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not tk._deterministic_scatter(cuda)
    with tuned(deterministic_backward=True):
        assert tk._deterministic_scatter(cpu)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert tk._deterministic_scatter(cuda)
        assert not tk._deterministic_scatter(cpu)  # the interpreter's atomics run in order
    finally:
        torch.use_deterministic_algorithms(previous)
