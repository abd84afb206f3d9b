"""The CPU op benchmark: its floors, its rows and the targets it states against them, read
from its JSON results (tiny sizes)."""

import json

import pytest
import torch

from benchmarks import cpu_ops
from robe_torchrec.hashing import HashMode, block_starts


def test_floor_forward_writes_every_row_from_the_source():
    source = torch.randn(cpu_ops.FLOOR_SOURCE_ROWS, 8)
    for rows in (512, 100):  # a multiple of the source's rows, and one that is not
        out = cpu_ops.floor_forward(source, rows)
        k = torch.gcd(torch.tensor(rows), torch.tensor(source.shape[0])).item()
        assert out.shape == (rows, 8)
        assert torch.equal(out, source[:k].repeat(rows // k, 1))


def test_floor_backward_reads_the_gradient_once():
    weights = torch.zeros(10, requires_grad=True)
    out = cpu_ops._FloorLookup.apply(weights, torch.randn(4, 3), 8)
    grad = torch.randn(8, 3)
    out.backward(grad)
    expected = torch.zeros(10)
    expected[0] = grad.sum()
    assert torch.equal(weights.grad, expected)


def test_quick_run_measures_every_case_and_judges_every_target(tmp_path):
    cpu_ops.main(["--quick", "--rows", "floor", "ours", "--optimizers", "sgd", "--threads", "1",
                  "2", "--iters", "1", "--warmup", "0", "--forward-iters", "1",
                  "--out", str(tmp_path / "cpu.md")])
    result = json.loads((tmp_path / "cpu.json").read_text())
    sizes, cases = cpu_ops.QUICK_SIZES, cpu_ops.forward_cases(cpu_ops.QUICK_SIZES)
    fwd = result["forward"]
    for case in cases:  # the forward and every part of its profile, on both clocks
        for part in ("", "hash ", "gather ", "lines ", "backward "):
            assert fwd[f"1t {part}{case.name}"] > 0 and fwd[f"1t cpu {part}{case.name}"] > 0
        assert f"2t {case.name}" in fwd and f"2t backward {case.name}" not in fwd
    assert fwd[f"2t {cpu_ops.COMPUTE_REFERENCE}"] > 0
    assert [p["case"] for p in result["profile"]] == [c.name for c in cases]
    for p in result["profile"]:
        assert p["serial_floor"] == pytest.approx(p["floor"] + p["hash"] + p["lines"])
    # rows: a floor per array and ours dense + fused per array and Z, both losses, 2 thread counts
    rows = result["rows"]
    assert len([r for r in rows if r["model"] == "floor"]) == 2 * 2 * len(sizes.robe_sizes)
    assert len([r for r in rows if r["model"] == "ours"]) == 2 * 2 * 2 * (len(sizes.robe_sizes) + 1)
    assert all(r["unavailable"] is None and r["phases"]["total"] > 0 for r in rows)
    assert all(r["phases"]["read"] > 0 for r in rows if r["model"] == "floor")
    # targets: every case's forward against the floor (1 thread) and against 1 thread (2),
    # every sum(outputs) step of ours against its floor at both thread counts; no peer rows
    by_target = {}
    for t in result["targets"]:
        by_target.setdefault(t["target"], []).append(t)
        assert t["goal"] == cpu_ops.TARGETS[t["target"]] and t["met"] == (t["value"] <= t["goal"])
    assert len(by_target.pop("forward / forward floor (CPU time)")) == len(cases)
    assert len(by_target.pop("forward / 1-thread forward")) == len(cases)
    assert len(by_target.pop("step / step floor, sum(outputs)")) == 2 * 2 * (len(sizes.robe_sizes) + 1)
    assert by_target == {}


def test_targets_come_from_the_rows_and_their_floors():
    sizes = cpu_ops.QUICK_SIZES
    mem = sizes.robe_sizes[0]

    def result(model: str, key: str, threads: int, loss: str, **phases) -> cpu_ops.Result:
        spec = cpu_ops.RowSpec(key, model, "sgd", "dense", mem, 32, lambda: None, loss=loss)
        return cpu_ops.Result(spec, threads, phases=phases)

    results = [result("floor", "floor", 1, "sum", total=99.0, **{"cpu total": 10.0}),
               result("ours", f"ours-dense-{mem}-z32", 1, "sum", total=1.0, **{"cpu total": 12.0}),
               result("floor", "floor", 2, "sum", total=8.0, **{"cpu total": 99.0}),
               result("ours", f"ours-dense-{mem}-z32", 2, "sum", total=16.0, **{"cpu total": 1.0}),
               result("ours", f"ours-dense-{mem}-z32", 1, "pair", total=4.0)]  # no floor: no target
    case = cpu_ops.forward_cases(sizes)[0].name
    fwd = {"1t cpu floor": 2.0, f"1t cpu {case}": 2.5, f"1t {case}": 4.0, f"2t {case}": 2.0}
    found = {(t["target"], t["threads"]): t for t in cpu_ops.targets(fwd, results, [1, 2], sizes)}
    assert found[("forward / forward floor (CPU time)", 1)]["value"] == 1.25  # CPU time
    assert found[("forward / 1-thread forward", 2)]["value"] == 0.5  # wall time
    step_1t, step_2t = (found[("step / step floor, sum(outputs)", k)] for k in (1, 2))
    assert (step_1t["value"], step_1t["met"]) == (1.2, True)  # CPU time at 1 thread
    assert (step_2t["value"], step_2t["met"]) == (2.0, False)  # wall time at 2
    assert len(found) == 4


def test_interleaved_rows_report_a_failing_row_and_keep_the_others():
    sizes = cpu_ops.QUICK_SIZES
    batches = cpu_ops.make_batches(sizes, count=2)

    def broken() -> cpu_ops.Runner:
        raise cpu_ops.Unavailable("not here")

    floor = cpu_ops.RowSpec("floor-1", "floor", "sgd", "dense", 4096, None,
                            lambda: cpu_ops.Floor(sizes, "sgd", 4096), loss="sum")
    bad = cpu_ops.RowSpec("bad", "bad", "sgd", "dense", 4096, None, broken)
    results = cpu_ops.run_specs([floor, bad], [1], batches, warmup=0, iters=2)
    assert [r.spec.key for r in results] == ["floor-1", "bad"]
    assert results[0].unavailable is None and results[0].phases["total"] > 0
    assert "read" in results[0].phases  # the floor's one read of a gradient, timed apart
    assert results[1].unavailable == "not here" and not results[1].phases


def test_touched_lines_are_the_lines_of_each_block():
    sizes = cpu_ops.QUICK_SIZES
    batch = cpu_ops.make_batches(sizes, count=1)[0]
    for z in (8, 32):
        runner = cpu_ops.Robe(sizes, "sgd", sizes.robe_sizes[0], z, "dense", HashMode.REFERENCE)
        starts = block_starts(batch.values, sizes.dim // z, runner.memory, z, HashMode.REFERENCE,
                              runner.params).reshape(-1).tolist()
        lines = [line for s in starts for line in range(s // 16, (s + z - 1) // 16 + 1)]
        assert runner.touched_lines(batch).tolist() == lines
        assert abs(len(lines) / len(starts) - cpu_ops.expected_lines(z)) < 0.05 * cpu_ops.expected_lines(z)
