"""The instruction-count benchmark compiles the bag kernels for sm_90 and counts what each
launch variant issues a bag; the compact hash must stay compact under the Triton in use, a
sum-pooled layout must compile without the mean's division, and the checks' counts without
barriers."""

import json

import pytest

from tests.compiled_triton import run_compiled


@pytest.mark.slow
def test_sum_pooling_divides_nothing_and_the_compact_hash_saves_work(tmp_path):
    variants = ["default", "default, 8 bags a program", "compact hash, 8 bags a program"]
    run_compiled(["-m", "benchmarks.kernel_instructions", "--block-sizes", "32", "--variants",
                  *variants, "--out", str(tmp_path)], tmp_path / "cache")
    rows = json.loads((tmp_path / "kernel_instructions.json").read_text())["rows"]
    by = {(r["variant"], r["kernel"]): r for r in rows}
    kernels = {"_forward_short_bags_kernel", "_backward_short_bags_kernel"}
    assert set(by) == {(v, k) for v in [*variants, "default, mix hash"] for k in kernels}
    assert all(r["instructions"] > 100 and r["registers"] > 0 for r in rows)
    # sum pooling everywhere: the kernels are compiled without the mean's division
    assert all(r["float_divisions"] == 0 for r in rows)
    for kernel in kernels:
        default, eight, compact = (by[(v, kernel)] for v in variants)
        assert [r["bags_a_program"] for r in (default, eight, compact)] == [1, 8, 8]
        # the checks' counts take one relaxed atomic: no barrier, no fence a program
        assert default["barriers"] == eight["barriers"] == 0, kernel
        # the same bags a program, hashed in the gather's layout (as a Triton that
        # rematerialised the hash there would): a third more
        assert compact["warp_instructions_a_bag"] < 0.8 * eight["warp_instructions_a_bag"]
    report = (tmp_path / "kernel_instructions.md").read_text()
    assert "| 32 | compact hash, 8 bags a program | 8 |" in report
    # the counts depend on the compiler: the report names it
    import triton

    compiler = json.loads((tmp_path / "kernel_instructions.json").read_text())["compiler"]
    assert compiler.startswith(f"Triton {triton.__version__}, ptxas V")
    assert f"- compiler: {compiler}" in report
