"""The host-overhead benchmark: every row runs, its report says what it compares, and the
launch stub is gone after it."""

import torch

from benchmarks import host_overhead
from robe_torchrec.ops import triton_kernels


def test_report_times_every_row_and_restores_the_launches():
    kernels_for = triton_kernels._kernels_for
    result = host_overhead.main(["--reps", "2", "--calls", "1"])
    assert triton_kernels._kernels_for is kernels_for
    assert set(result["medians"]) == set(host_overhead.ROWS)
    assert all(v > 0 for v in result["medians"].values())
    report = host_overhead.render(result)
    assert "behind `custom_op` (same kernel, same run)" in report
    assert "with the summary kernel's host work" in report
    assert all(f"| {row} |" in report for row in host_overhead.ROWS)


def test_the_stubbed_calls_return_what_the_ops_return():
    # the rows time real calls: the op path reaches the kernel wrapper and returns its output
    calls = host_overhead.calls()
    with host_overhead.stubbed_launches():
        out = calls["op, no grad"]()
        shape = (host_overhead.BATCH, host_overhead.DIM * host_overhead.FEATURES)
        assert isinstance(out, torch.Tensor) and tuple(out.shape) == shape
        assert tuple(calls["custom_op, with grad"]().shape) == shape
