"""The CPU op benchmark's floors and the targets it states against them (tiny sizes)."""

import dataclasses
import re

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


def test_quick_report_states_the_floor_targets():
    report = cpu_ops.main(["--quick", "--rows", "floor", "ours", "--optimizers", "sgd",
                           "--threads", "1", "2", "--iters", "1", "--warmup", "0",
                           "--forward-iters", "1"])
    assert "## Forward against its floor" in report
    assert "## Backward against one read of its gradient" in report
    assert "Targets against the other rows" not in report  # no full-table or pytorch rows
    sizes = cpu_ops.QUICK_SIZES
    verdicts = re.findall(r"^\| (forward / forward floor \(CPU time\)|"
                          r"step / step floor, sum\(outputs\) \(CPU time\)) \|"
                          r".*\| (PASS|MISS) \| [0-9.]+ \|$", report, flags=re.M)
    forward = [v for v in verdicts if v[0].startswith("forward")]
    step = [v for v in verdicts if v[0].startswith("step")]
    assert len(forward) == len(cpu_ops.forward_cases(sizes))  # both hashes, both Z, both arrays
    assert len(step) == 2 * (len(sizes.robe_sizes) + 1)  # ours dense and fused of each array
    # the profile: every case split into hash / gather / store, its floors, its backward
    for section in ("## Where the forward's time goes", "### What stands between the kernel",
                    "## Backward profile"):
        assert section in report
    profile = report.split("## Where the forward's time goes")[1].split("## Backward profile")[0]
    names = [case.name for case in cpu_ops.forward_cases(sizes)]
    assert all(profile.count(f"| {name} |") == 2 for name in names)  # split and floors tables
    backward = report.split("## Backward profile")[1].split("## Step rows")[0]
    assert all(f"| {name} |" in backward for name in names)
    # the step's own work beyond its floor: one row per 1-thread sum(outputs) step, each with
    # serial >= overlapped >= the step floor
    step_section = report.split("### What stands between the step and its floor")[1]
    step_rows = re.findall(r"^\| ours \w+ M=[0-9,]+ Z=\d+ \| sgd \| 1 \| ([0-9.]+) \| ([0-9.]+) \| "
                           r"([0-9.]+) \| ([0-9.]+) \|", step_section, flags=re.M)
    assert len(step_rows) == len(step)
    for _, floor, serial, overlapped in step_rows:
        assert float(serial) >= float(overlapped) >= float(floor)
    # and at 2 threads, from the parts timed on 2 threads
    assert len(re.findall(r"^\| ours \w+ M=[0-9,]+ Z=\d+ \| sgd \| 2 \|", step_section, flags=re.M)) == len(step)
    assert "target lies below the serial floor in" in step_section
    # the floor rows report 1.00x against themselves, for both losses
    floor_rows = [line for line in report.splitlines() if line.startswith("| floor |")]
    assert len(floor_rows) == 2 * 2 * len(sizes.robe_sizes)  # two losses, two thread counts
    assert all(re.search(r"\| 1\.00x \| 1\.00x \| [0-9.]+ \| 1\.00x \|", line)
               for line in floor_rows)


def test_interleaved_rows_report_a_failing_row_and_keep_the_others():
    sizes = cpu_ops.QUICK_SIZES
    batches = cpu_ops.make_batches(sizes, count=2)

    def broken() -> cpu_ops.Runner:
        raise cpu_ops.Unavailable("not here")

    floor = cpu_ops.RowSpec("floor-1", "floor", "sgd", "dense", 4096, None,
                            lambda: cpu_ops.Floor(sizes, "sgd", 4096), loss="sum")
    bad = cpu_ops.RowSpec("bad", "bad", "sgd", "dense", 4096, None, broken)
    results = cpu_ops.run_specs([floor, bad], [1], batches, sizes, warmup=0, iters=2)
    assert [r.spec.key for r in results] == ["floor-1", "bad"]
    assert results[0].unavailable is None and results[0].phases["total"] > 0
    assert "read" in results[0].phases  # the floor's one read of a gradient, timed apart
    assert results[1].unavailable == "not here" and not results[1].phases


def test_touched_lines_are_the_lines_of_each_block():
    sizes = cpu_ops.QUICK_SIZES
    batch = cpu_ops.make_batches(sizes, count=1)[0]
    for z in (8, 32):
        runner = cpu_ops.Robe(sizes, "sgd", sizes.robe_sizes[0], z, "dense", HashMode.REFERENCE, "")
        starts = block_starts(batch.values, sizes.dim // z, runner.memory, z, HashMode.REFERENCE,
                              runner.params).reshape(-1).tolist()
        lines = [line for s in starts for line in range(s // 16, (s + z - 1) // 16 + 1)]
        assert runner.touched_lines(batch).tolist() == lines
        assert abs(len(lines) / len(starts) - cpu_ops.expected_lines(z)) < 0.05 * cpu_ops.expected_lines(z)


def test_step_floors_add_the_work_the_step_floor_leaves_out():
    sizes = cpu_ops.QUICK_SIZES
    memory = sizes.robe_sizes[0]
    case = cpu_ops.ForwardCase(HashMode.REFERENCE, memory, 32)
    # 1 thread: store floor 2, hash 1, line reads 3 (ms); one read of the gradient 1.5
    one_thread = cpu_ops.ForwardProfile(case, floor=2.0, hash=1.0, gather=4.0, forward=6.0,
                                        lines=3.0, hashes=10, line_count=20.0)
    # 2 threads, timed on 2 threads: the hashing scales, the line reads barely do
    two_threads = dataclasses.replace(one_thread, floor=1.5, hash=0.5, lines=2.5)

    def row(model: str, key: str, threads: int, total: float) -> cpu_ops.Result:
        spec = cpu_ops.RowSpec(key, model, "sgd", "dense", memory, 32, lambda: None, loss="sum")
        # 1 thread: CPU time counts; 2 threads: wall time (the CPU total is a decoy)
        phases = {"cpu total": total} if threads == 1 else {"total": total, "cpu total": 99.0}
        return cpu_ops.Result(spec, threads, phases=phases)

    results = [row("floor", "floor", 2, 6.0), row("ours", "ours", 2, 12.0),
               row("floor", "floor", 1, 10.0), row("ours", "ours", 1, 25.0)]
    # the 1-thread read is CPU time, the 2-thread one wall time (decoys on the other clock)
    fwd = {(1, "cpu read"): 1.5, (1, "read"): 99.0, (2, "read"): 1.25, (2, "cpu read"): 99.0}
    one, two = cpu_ops.step_floors({1: [one_thread], 2: [two_threads]}, fwd, results, sizes,
                                   HashMode.REFERENCE)
    assert (one.threads, two.threads) == (1, 2)
    assert one.floor == 10.0 and one.step == 25.0
    assert one.serial == 10.0 + 1.0 + 2 * 3.0
    # forward: max(2, 1, 3) - 2 = 1 more than its floor; scatter: max(1.5, 3) - 1.5 = 1.5 more
    assert one.overlapped == 10.0 + 1.0 + 1.5
    # 2 threads: the work as timed on 2 threads, on the 2-thread floor's wall time
    assert (two.floor, two.step) == (6.0, 12.0)
    assert two.serial == 6.0 + 0.5 + 2 * 2.5
    # forward: max(1.5, 0.5, 2.5) - 1.5 = 1; scatter: max(1.25, 2.5) - 1.25 = 1.25
    assert two.overlapped == 6.0 + 1.0 + 1.25
    section = cpu_ops.step_floors_section([one, two])
    assert "| sgd | 1 | 25.00 | 10.00 | 17.00 | 12.50 | 1.70x | 1.25x | 1.47x | only with overlap |" in section
    assert "| sgd | 2 | 12.00 | 6.00 | 11.50 | 8.25 | 1.92x | 1.38x | 1.04x | only with overlap |" in section
    assert ("at 1 thread, the target lies below the serial floor in 1 of 1 rows (below the "
            "overlapped floor in 0)") in section
    assert "at 2 threads, the target lies below the serial floor in 1 of 1 rows" in section
    # a thread count without its own profile gets no floor (never the 1-thread one scaled)
    assert cpu_ops.step_floors({1: [one_thread]}, fwd, results, sizes, HashMode.REFERENCE) == [one]


def test_forward_profiles_read_cpu_time_at_one_thread_and_wall_time_at_more():
    sizes = cpu_ops.QUICK_SIZES
    fwd = {}
    for k in (1, 2):
        for clock, scale in (("cpu ", 1.0), ("", 10.0)):
            fwd[(k, f"{clock}floor")] = k * scale
            for case in cpu_ops.forward_cases(sizes):
                for part in ("", "hash ", "gather ", "lines "):
                    fwd[(k, f"{clock}{part}{case.name}")] = k * scale + 1
    one, two = (cpu_ops.forward_profiles(fwd, sizes, k) for k in (1, 2))
    assert len(one) == len(two) == len(cpu_ops.forward_cases(sizes))
    assert all(p.floor == 1.0 and p.lines == 2.0 for p in one)  # CPU time, 1 thread
    assert all(p.floor == 20.0 and p.lines == 21.0 for p in two)  # wall time, 2 threads
    assert cpu_ops.forward_profiles(fwd, sizes) == one


def test_step_floors_say_when_the_floor_bounds_nothing():
    row = cpu_ops.StepFloors("ours fused M=4,096 Z=32", "adagrad", threads=1, step=5.0,
                             floor=10.0, serial=17.0, overlapped=12.5)
    section = cpu_ops.step_floors_section([row])
    assert "1 rows (adagrad) take less than their overlapped floor" in section
    assert "no lower bound" not in cpu_ops.step_floors_section([dataclasses.replace(row, step=13.0)])


def test_two_thread_forwards_are_set_beside_the_machines_own_scaling():
    sizes = cpu_ops.QUICK_SIZES
    cases = cpu_ops.forward_cases(sizes)
    fwd = {(1, cpu_ops.COMPUTE_REFERENCE): 4.0, (2, cpu_ops.COMPUTE_REFERENCE): 2.6}
    for i, case in enumerate(cases):  # 2t / 1t = 0.55, 0.65, 0.55, ...
        fwd[(1, case.name)] = 10.0
        fwd[(2, case.name)] = 5.5 if i % 2 == 0 else 6.5
    text = cpu_ops.machine_scaling_summary(fwd, [1, 2], sizes)
    assert "takes 0.65x its 1-thread time, where 2 free cores give 0.50x" in text
    assert "our forwards take 0.55x to 0.65x" in text
    assert f"{len(cases)} of {len(cases)} at or below the reference's ratio" in text
    assert "asks more of this machine than it gave" in text
    fwd[(2, cpu_ops.COMPUTE_REFERENCE)] = 2.2  # the machine scales 0.55x: the target stands
    text = cpu_ops.machine_scaling_summary(fwd, [1, 2], sizes)
    assert f"{(len(cases) + 1) // 2} of {len(cases)} at or below" in text
    assert "at or below the 0.6x target in this run" in text
    assert "output's writes" not in text  # no floor timed
    assert cpu_ops.machine_scaling_summary(fwd, [1], sizes) == ""
    # the floor scales 0.8x: a forward of 10 ms whose 4 ms of stores scale so reaches
    # (3.2 + 6 / 2) / 10 = 0.62x at best; the cases at 0.65x missed the target beyond that
    fwd[(1, "floor")], fwd[(2, "floor")] = 4.0, 3.2
    text = cpu_ops.machine_scaling_summary(fwd, [1, 2], sizes)
    assert "the forward floor takes 0.80x its 1-thread time" in text
    assert "would take 0.62x to 0.62x its 1-thread time" in text
    missed = len(cases) // 2
    assert (f"lies below that in {len(cases)} of {len(cases)} cases; of the {missed} cases "
            f"that missed the target, {missed} lie there") in text
    fwd[(2, "floor")] = 2.0  # stores that scale perfectly leave the target reachable
    text = cpu_ops.machine_scaling_summary(fwd, [1, 2], sizes)
    assert (f"lies below that in 0 of {len(cases)} cases; of the {missed} cases that missed "
            "the target, 0 lie there.") in text
