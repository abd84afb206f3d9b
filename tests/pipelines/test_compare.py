"""The comparison runner: its statistics, where it writes (a fresh directory by default;
never over an existing report unless told), and one tiny end-to-end run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from robe_torchrec.pipelines.compare import _parity, kept, nearest_rank, report_stem

ROOT = Path(__file__).resolve().parents[2]


def test_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 6.0, 9.0, 7.0, 8.0]
    assert nearest_rank(values, 50) == 5.0   # ceil(0.5 * 10) = 5th smallest
    assert nearest_rank(values, 90) == 9.0   # 9th smallest, no interpolation
    assert nearest_rank(values, 100) == 10.0
    assert nearest_rank([3.0], 90) == 3.0
    assert nearest_rank([1.0, 2.0, 3.0], 50) == 2.0


def test_first_and_last_steps_dropped():
    assert kept([100.0, 1.0, 2.0, 50.0]) == [1.0, 2.0]


def test_report_stem_refuses_an_existing_report_unless_overwrite(tmp_path):
    assert report_stem(tmp_path, "t") == tmp_path / "compare_t"
    (tmp_path / "compare_t.png").write_bytes(b"")
    with pytest.raises(FileExistsError, match="overwrite=true"):
        report_stem(tmp_path, "t")
    assert report_stem(tmp_path, "t", overwrite=True) == tmp_path / "compare_t"
    assert report_stem(tmp_path, "other") == tmp_path / "compare_other"


def _compare(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "robe_torchrec.pipelines.compare", "steps=4", "rounds=1",
           "batch_size=16", "cardinality_scale=0.001", "num_sparse=4", "model.robe.compression=100", "tag=t",
           "~pipelines.plain", "~pipelines.fused_sparse_dist_after_opt", "~pipelines.semi_sync",
           *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_runner_end_to_end(tmp_path):
    proc = _compare(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the default: a fresh outputs/compare/<date>/<time>-<pid>, with the run's log
    (report_path,) = (tmp_path / "outputs" / "compare").glob("*/*/compare_t.json")
    run_dir = report_path.parent
    assert re.fullmatch(r"\d\d-\d\d-\d\d-\d+", run_dir.name), run_dir
    assert (run_dir / "compare.log").exists()
    report = json.loads(report_path.read_text())
    rows = {r["pipeline"]: r for r in report["rows"]}
    assert set(rows) == {"sparse_dist", "fused_sparse_dist"}
    assert rows["fused_sparse_dist"]["parity"] == "bit-identical"
    assert rows["sparse_dist"]["kept_steps"] == 2 and rows["sparse_dist"]["p90_vs_ref"] == 1.0
    # FusedSparseDist times its optimizer + next-lookup segment; SparseDist has none
    assert rows["fused_sparse_dist"]["opt_and_lookup_p50_ms"] > 0
    assert rows["sparse_dist"]["opt_and_lookup_p50_ms"] is None
    assert (run_dir / "compare_t.png").stat().st_size > 0
    assert "| fused_sparse_dist |" in (run_dir / "compare_t.md").read_text()

    # an existing report is kept: the second run refuses before training anything
    before = report_path.read_bytes()
    proc = _compare(tmp_path, f"out_dir={run_dir}")
    assert proc.returncode != 0 and "overwrite=true" in proc.stderr, proc.stderr[-3000:]
    assert "round 0" not in proc.stdout and report_path.read_bytes() == before


def test_parity_states_identical_or_how_far():
    import numpy as np

    init = {"w": np.zeros(4, np.float32), "step": np.array([3])}
    ref = {"w": np.full(4, 2.0, np.float32), "step": np.array([3])}
    assert _parity({k: v.copy() for k, v in ref.items()}, ref, init) == "bit-identical"
    drifted = {"w": np.array([2.0, 2.0, 2.0, 3.0], np.float32), "step": np.array([3])}
    # off by 1 in one of four entries that each travelled 2: 1 / 4 of the travel
    assert _parity(drifted, ref, init) == "differs: 0.25 of travel, max abs 1"
