"""The GPU proof command (``python -m benchmarks.gpu_torchrec.run``) in its CPU mode, so the
script that only a lent GPU runs in full cannot rot; and its trace analysis on a made-up
trace whose overlap is known."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_torchrec.overlap import intersection, lookup_optimizer_overlap, union

ROOT = Path(__file__).resolve().parents[1]


def _range(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _launch(corr: int, ts: float, cat: str = "cuda_runtime") -> dict:
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "args": {"correlation": corr}}


def _kernel(corr: int, ts: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream}}


def test_intervals() -> None:
    assert union([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert intersection([(0, 3), (5, 6)], [(2, 5.5)]) == 1.5


def test_overlap_of_a_known_trace() -> None:
    """Step 1's optimizer kernels run 100-140 and 150-170 us on stream 7; step 2's lookup
    kernels (launched in its range, one through the driver API as Triton's are) 130-160 on
    stream 20: 10 + 10 us of its 30 overlap. A kernel launched outside both ranges counts for
    neither."""
    events = [
        _range("## optimizer 1 ##", 10, 20), _range("## start_embedding_lookup 2 ##", 35, 10),
        _range("## start_embedding_lookup 1 ##", 0, 5),
        _launch(1, 12), _launch(2, 14), _launch(3, 36), _launch(4, 38, "cuda_driver"),
        _launch(5, 60),
        _kernel(1, 100, 40, 7), _kernel(2, 150, 20, 7), _kernel(3, 130, 15, 20),
        _kernel(4, 145, 15, 20), _kernel(5, 100, 100, 7),
    ]
    r = lookup_optimizer_overlap({"traceEvents": events})
    assert r["steps"] == 1
    assert r["next_lookup_busy_us"] == 30 and r["optimizer_busy_us"] == 60
    assert r["overlap_us"] == 20
    assert r["overlap_of_lookup"] == pytest.approx(2 / 3)
    assert r["lookup_streams"] == ["20"] and r["optimizer_streams"] == ["7"]


def test_no_gpu_activity_means_no_fraction() -> None:
    r = lookup_optimizer_overlap({"traceEvents": [_range("## optimizer 1 ##", 0, 5)]})
    assert r["steps"] == 0 and r["overlap_of_lookup"] is None


@pytest.mark.slow
def test_cpu_mode_runs_every_part(tmp_path: Path) -> None:
    """All six parts on CPU with gloo (about 90 s on 2 cores): the shim in this process and
    in a spawned rank, the pipelines against plain, the profiler trace, the sequence lookup's
    benchmark, robe_torchrec.pipelines.compare and the app with a checkpoint and a resume."""
    out = tmp_path / "gpu_pipelines_cpu.md"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_torchrec.run", "--cpu",
                           "--out", str(out), "--commit", "test"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.with_suffix(".json").read_text())
    parts = result["parts"]
    assert set(parts) == {"shim", "pipelines", "overlap", "sequence", "compare", "app"}
    assert all(p["ok"] for p in parts.values())
    assert parts["shim"]["status_in_spawned_rank"] == parts["shim"]["status_here"] != {}
    # every fbgemm op the pipelines and the app reached has a kernel in the shim
    assert parts["pipelines"]["fbgemm_ops_not_in_shim"] == []
    assert set(parts["app"]["fbgemm_ops_called"]) <= set(parts["shim"]["status_here"])
    bitwise = [r for r in parts["pipelines"]["rows"] if r["pipeline"] != "semi_sync"]
    assert all(r["verdict"] == "bit-identical losses and weights" for r in bitwise)
    assert {r["pipeline"] for r in parts["compare"]["rows"]} >= {
        "sparse_dist", "fused_sparse_dist", "semi_sync"}
    assert parts["app"]["resumed"] and parts["app"]["trained_to_end"]
    assert (tmp_path / parts["sequence"]["report"]).exists()
    assert len(parts["sequence"]["ms"]) == 16
    assert result["environment"]["commit"] == "test" and result["failed"] == []
    sparse_dist = [r for r in parts["compare"]["rows"] if r["pipeline"] == "sparse_dist"][0]
    assert sparse_dist["p90_vs_sparse_dist"] == 0.0 and sparse_dist["torchrec_p90_vs_sparse_dist"] == 0.0
