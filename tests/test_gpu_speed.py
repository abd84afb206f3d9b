"""The CUDA-graph row of ``benchmarks.gpu_speed`` on CPU, with torch's CUDA-graph calls
stood in for (capture runs the call, replay runs nothing), so that its plumbing (warm-up,
capture, the graph's output handed to the comparison) is exercised where CI runs: a GPU
session is too rare to find a typo. What a real capture does is ``gpu_checks``'s to check."""

from __future__ import annotations

import contextlib

import torch

from benchmarks import gpu_speed


class _Stream:
    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_graph_row_hands_its_output_to_the_comparison(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    lk = gpu_speed.Lookup(gpu_speed.Scenario("tiny", 4, 8, [50, 30], 3, [4], 4.0),
                          torch.device("cpu"))
    with gpu_speed.triton_path(lk.device):
        default = gpu_speed.robe_rows(lk, 4, {"": {}})[0]
        graphed = gpu_speed.graph_row(lk, 4)
        mix = gpu_speed.mix_hash_row(lk, 4)
        graphed.train()
        gpu_speed.compare_variants([default, graphed, mix])
    assert graphed.name == "ROBE-Z Z=4, replayed CUDA graphs (+ fused SGD)"
    assert graphed.note == "max rel. diff to default 0.0e+00"
    assert mix.note.startswith("another hash")


def test_every_launch_variant_of_the_gpu_check_pools_as_the_default():
    """The GPU check's launch variants name real tuning fields and, run on CPU tensors in
    the interpreter, pool what the default launch pools: a GPU session finds no typo."""
    from benchmarks import gpu_check

    for per_bag, variants in ((1, gpu_check.ONE_ID_VARIANTS), (3, gpu_check.VARIANTS)):
        lk = gpu_speed.Lookup(gpu_speed.Scenario("tiny", 4, 8, [50, 30], per_bag, [4], 4.0),
                              torch.device("cpu"))
        with gpu_speed.triton_path(lk.device):
            rows = gpu_speed.robe_rows(lk, 4, {**variants, **gpu_check.ALWAYS})
            gpu_speed.compare_variants(rows)
        varied = [r for r in rows if "," in r.name]
        assert len(varied) == len(variants) + len(gpu_check.ALWAYS) - 1
        for row in varied:
            assert float(row.note.rsplit(" ", 1)[1]) < 1e-6, (row.name, row.note)


def _timed(name: str, forward: float, train: float) -> gpu_speed.Row:
    return gpu_speed.Row(name, lambda: None, forward_ms=[forward], train_ms=[train])


def test_the_fastest_launch_variant_is_named_with_its_tuning():
    """The summary names the variant to make the default, and only one that beats the
    default by more than the host's noise."""
    rows = [_timed("full table, one lookup (+ in-place SGD rows)", 1.0, 1.0),
            _timed("ROBE-Z Z=32 (+ fused SGD)", 1.0, 2.0),
            _timed("ROBE-Z Z=32, a (+ fused SGD)", 0.7, 1.99),
            _timed("ROBE-Z Z=32, b (+ fused SGD)", 0.6, 2.2),
            _timed("ROBE-Z Z=32, replayed CUDA graphs (+ fused SGD)", 0.1, 0.1)]
    found = gpu_speed.fastest_variants(rows, 32, {"": {}, "a": {"num_warps": 2},
                                                  "b": {"compact_hash": True}})
    forward, train = found
    assert (forward["variant"], forward["tuning"]) == ("b", {"compact_hash": True})
    assert abs(forward["ratio"] - 0.6) < 1e-9
    assert train["variant"] == ""  # 'a' is faster by 0.5% only
    lines = gpu_speed.fastest_lines(found)
    assert lines[0] == ("- Fastest launch at Z=32, forward: `b`, 0.60x the default's time "
                        "(`tuned(compact_hash=True)`).")
    assert lines[1].endswith("the default (no variant 5% faster).")


def test_a_row_that_fails_costs_the_section_no_other_row():
    """A launch variant that does not compile on the GPU at hand is reported in the
    section's notes; every other row is still timed and compared."""
    lk = gpu_speed.Lookup(gpu_speed.Scenario("tiny", 4, 8, [50, 30], 1, [4], 4.0),
                          torch.device("cpu"))

    def broken():
        raise RuntimeError("out of resource: shared memory\nmore detail")

    with gpu_speed.triton_path(lk.device):
        default, variant = gpu_speed.robe_rows(lk, 4, {"": {}, "v": {"num_warps": 2}})[::2]
        failing = gpu_speed.Row("ROBE-Z Z=4, broken (+ fused SGD)", broken, broken)
        rows = [default, failing, variant]
        gpu_speed.time_rows(rows, gpu_speed.DeviceTimer(lk.device), reps=2, inner=1, warmup=0)
        gpu_speed.compare_variants(rows)
    assert failing.error == "RuntimeError: out of resource: shared memory"
    assert failing.forward_ms == [] and failing.note == "did not run (see the notes)"
    assert len(default.forward_ms) == len(variant.train_ms) == 2
    assert variant.note.startswith("max rel. diff to default")
