"""What the app prints: one line for its own refusals (the traceback with
HYDRA_FULL_ERROR=1), and a summary table (markdown and CSV) at the end of a ``-m`` sweep."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from robe_torchrec.train.sweep import write_summary
from tests.train.helpers import TINY, run

APP = [sys.executable, "-m", "robe_torchrec.train"]


@pytest.mark.slow
def test_own_errors_print_one_line(tmp_path):
    out = run([*APP, "embedding.compression=0.5", *TINY], tmp_path, timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert out.returncode == 1
    assert len(lines) == 1, out.stdout
    assert "ConfigError: embedding.compression must be >= 1" in lines[0]
    assert "HYDRA_FULL_ERROR=1" in lines[0] and "Traceback" not in out.stdout
    full = run([*APP, "embedding.compression=0.5", *TINY], tmp_path, timeout=120,
               env_extra={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 1 and "Traceback" in full.stdout, full.stdout


@pytest.mark.slow
def test_sweep_ends_with_a_summary_table(tmp_path):
    out = run([*APP, "-m", "embedding.compression=10,20", "run.steps=2", *TINY,
               f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert [r["embedding.compression"] for r in rows] == ["10", "20"]
    assert all(0 <= float(r["test_auc"]) <= 1 and r["status"] == "completed" for r in rows)
    markdown = (tmp_path / "sweep" / "summary.md").read_text()
    assert markdown.splitlines()[0].startswith("| job | embedding.compression | val_auc |")
    assert "sweep summary" in out.stdout and markdown.splitlines()[2] in out.stdout
    results = json.loads((tmp_path / "sweep" / "1" / "results.json").read_text())
    assert results["results"]["test_auc"] == pytest.approx(float(rows[1]["test_auc"]))


def test_summary_of_completed_and_failed_jobs(tmp_path):
    for job, (overrides, status, results, error) in enumerate([
            (["a=1", "b=x"], "completed", {"test_auc": 0.75, "extra": 3}, None),
            (["a=2", "b=x"], "failed", {}, "ConfigError: bad | value")]):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "results.json").write_text(json.dumps(dict(
            job=job, overrides=overrides, status=status, results=results, error=error)))
    markdown = write_summary(tmp_path)
    assert markdown.splitlines() == [
        "| job | a | test_auc | extra | status |", "|---|---|---|---|---|",
        "| 0 | 1 | 0.75 | 3 | completed |",
        "| 1 | 2 |  |  | ConfigError: bad \\| value |"]
    rows = list(csv.reader(open(tmp_path / "summary.csv")))
    assert rows[0] == ["job", "a", "b", "test_auc", "extra", "status"]
    assert write_summary(tmp_path / "0") is None
