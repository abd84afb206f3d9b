"""The host-overhead benchmark: every row runs and is in its JSON results, and the launch
stub it runs under is gone after it."""

import json

import pytest
import torch

from benchmarks import host_overhead
from robe_torchrec.hashing import HashMode, hash_params
from robe_torchrec.ops import reference, triton_kernels
from robe_torchrec.ops.meta import build_table_meta
from tests.compiled_triton import run_compiled


def _lookup():
    """A tiny forward's arguments (2 features of dim 8, Z = 4)."""
    meta = build_table_meta([8, 8], [0, 0], [64, 64], [0, 10], [10, 10], [0, 0])
    values, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 3, 4, 5])
    weights = torch.randn(64, generator=torch.Generator().manual_seed(0))
    return (weights, values, offsets, None, meta, 16, 4, int(HashMode.REFERENCE),
            hash_params(HashMode.REFERENCE, 1024), 0)


def test_every_row_is_timed(tmp_path, monkeypatch):
    if triton_kernels.interpreted():  # every row must run with its launches stubbed
        from triton.runtime.interpreter import InterpretedFunction

        def refuse(fn, *args, **kwargs):
            raise AssertionError(f"a row launched {fn.__name__}")

        monkeypatch.setattr(InterpretedFunction, "run", refuse)
    host_overhead.main(["--reps", "2", "--calls", "1", "--batch", "8", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "host_overhead.json").read_text())
    rows = host_overhead.calls(torch.device("cpu"), 8)
    assert set(result["medians"]) == set(rows) and "wrapper, summary kernel" in rows
    # every row but the host's speed and the primitives runs on the op's path
    off_path = {"op of the same schema returning its input", "torch.add of 4-element tensors",
                "pure Python: 1000 additions", *(n for n in rows if n.startswith("primitive"))}
    assert set(rows) - set(host_overhead.ON_PATH) == off_path
    assert all(v > 0 for v in result["medians"].values())
    assert all(len(v) == 2 for v in result["samples_us"].values())
    assert result["device"] == "cpu" and result["machine"]["torch"] == torch.__version__
    primitives = [n for n in rows if n.startswith("primitive: ")]
    assert len(primitives) == 2  # the output's allocation and the counts' (CUDA adds two)
    assert result["primitives_us"] == pytest.approx(sum(result["medians"][n] for n in primitives))
    report = (tmp_path / "host_overhead.md").read_text()
    assert "torch calls on the device besides its launch" in report
    if triton_kernels.interpreted():  # no launched rows, so no floor
        assert result["floor_us"] is None


@pytest.mark.slow
def test_launched_rows_compare_cached_with_jit_launches(tmp_path):
    """In a process whose Triton compiles, the benchmark also times four rows with their
    launches made by a stand-in driver, cached and through ``JITFunction.run``."""
    out = tmp_path / "out"
    run_compiled(["-m", "benchmarks.host_overhead", "--reps", "2", "--calls", "1", "--batch",
                  "8", "--out", str(out)], tmp_path / "cache")
    result = json.loads((out / "host_overhead.json").read_text())
    medians = result["medians"]
    for row in host_overhead.LAUNCHED:
        assert medians[f"{row}, launched"] > 0
        assert medians[f"{row}, launched via JITFunction.run"] > 0
    assert set(result["keyed_over_bound"]) == set(host_overhead.BOUND)
    # the floor any forward op pays here: the dispatcher, the primitives, the launch path
    floor = result["floor_us"]
    assert floor == host_overhead.op_floor(medians) and len(floor) == 3
    assert "A floor for a forward op on this host" in (out / "host_overhead.md").read_text()


@pytest.mark.skipif(not triton_kernels.interpreted(), reason="needs Triton's interpreter")
def test_stubbed_launches_skip_the_kernels_inside_the_block_only():
    args = _lookup()
    want = reference.forward(*args)
    with triton_kernels.stubbed_launches():
        stubbed = triton_kernels.forward(*args)
    assert stubbed.shape == want.shape and not torch.equal(stubbed, want)
    assert torch.allclose(triton_kernels.forward(*args), want)


def test_varied_batches_change_what_they_say_they_change():
    """The multi-hot batches keep the batch size and change the number of ids; the others
    keep one id a bag and change the batch size (the premises of the rows' ratios)."""
    cpu = torch.device("cpu")
    multi_hot = host_overhead.varied_batches(cpu, 64, num_rows=100, multi_hot=True, count=8)
    sized = host_overhead.varied_batches(cpu, 64, num_rows=100, multi_hot=False, count=8)
    assert {offsets.numel() for _, offsets in multi_hot} == {host_overhead.FEATURES * 64 + 1}
    assert len({values.numel() for values, _ in multi_hot}) == 8
    assert len({offsets.numel() for _, offsets in sized}) > 4
    for values, offsets in sized:
        assert torch.equal(offsets, torch.arange(values.numel() + 1))
        assert (offsets.numel() - 1) % host_overhead.FEATURES == 0


def test_a_row_whose_first_calls_raise_is_left_out_and_named(tmp_path, monkeypatch):
    """One row that cannot run (an op a GPU machine's fbgemm lacks, say) costs the run only
    that row: the others are timed and the report names it."""
    every_row = host_overhead.calls

    def with_a_broken_row(device, batch):
        rows = every_row(device, batch)
        rows["a row that raises"] = lambda: 1 / 0
        return rows

    monkeypatch.setattr(host_overhead, "calls", with_a_broken_row)
    result = host_overhead.main(["--reps", "2", "--calls", "1", "--batch", "8", "--out",
                                 str(tmp_path)])
    assert result["left_out"] == {"a row that raises": "ZeroDivisionError: division by zero"}
    assert "a row that raises" not in result["medians"] and "op, no grad" in result["medians"]
    assert "Rows left out" in (tmp_path / "host_overhead.md").read_text()


def test_a_run_stopped_early_leaves_the_samples_of_its_last_round(tmp_path, monkeypatch):
    """The GPU session stops a benchmark at its time limit: the report is written after
    every round of samples, marked partial, so the rounds measured are kept."""
    rounds = []
    interleaved = host_overhead.interleaved

    def stopped_in_the_second_round(*args, **kwargs):
        rounds.append(1)
        if len(rounds) == 2:
            raise KeyboardInterrupt  # as a time limit's signal would stop it
        return interleaved(*args, **kwargs)

    monkeypatch.setattr(host_overhead, "interleaved", stopped_in_the_second_round)
    monkeypatch.setattr(host_overhead, "ROUND_REPS", 2)
    with pytest.raises(KeyboardInterrupt):
        host_overhead.main(["--reps", "4", "--calls", "1", "--batch", "8", "--out",
                            str(tmp_path)])
    result = json.loads((tmp_path / "host_overhead.json").read_text())
    assert result["partial"] and all(len(v) == 2 for v in result["samples_us"].values())
    assert "**Partial**: 2 of 4 samples" in (tmp_path / "host_overhead.md").read_text()
