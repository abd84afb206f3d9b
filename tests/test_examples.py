"""The README's main job and the examples run (small sizes), so they never rot."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_quickstart_dlrm_trains():
    out = run_example("examples/quickstart_dlrm.py", "--steps", "60", "--log-every", "20",
                      "--batch-size", "256")
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines()
              if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "compressed to" in out and "samples/s" in out and "held-out AUC" in out


@pytest.mark.slow
def test_quality_study_runs(tmp_path):
    run_example("-m", "benchmarks.quality_study", "--steps", "4",
                "--dims", "16", "8", "--compressions", "100", "--block-sizes", "8",
                "--hashes", "reference", "--test-batches", "4", "--batch-size", "256",
                "--seeds", "0", "1", "--name", "q", "--out", str(tmp_path))
    result = json.loads((tmp_path / "q.json").read_text())
    rows = result["rows"]
    assert [(r["seed"], r["dim"], r["embedding"]) for r in rows] == [
        (s, d, e) for s in (0, 1) for d in (16, 8) for e in ("full", "robe")]
    for row in rows:
        assert 0.0 < row["test_auc"] <= 1.0
    # each gap is against the full tables of its own seed and dim
    assert rows[1]["auc_gap"] == pytest.approx(rows[1]["test_auc"] - rows[0]["test_auc"])
    assert rows[7]["auc_gap"] == pytest.approx(rows[7]["test_auc"] - rows[6]["test_auc"])
    assert rows[1]["stored_floats"] > rows[3]["stored_floats"]  # same ratio, more floats at dim 16
    # the summary averages the gaps over the seeds
    cell = [s for s in result["summary"] if s["dim"] == 8 and s["embedding"] == "robe"][0]
    assert cell["auc_gap"] == pytest.approx((rows[3]["auc_gap"] + rows[7]["auc_gap"]) / 2)
    assert (cell["seeds"], cell["block_size"], cell["compression"]) == ([0, 1], 8, 100.0)
    for oracle in result["oracle"]:
        assert oracle["hidden model (all features)"] > oracle["hidden model, dense features only"]
    assert (tmp_path / "q.png").stat().st_size > 10_000


@pytest.mark.slow
def test_quality_study_on_real_rows(tmp_path):
    rows = tmp_path / "rows.tsv"  # 300 rows of the Criteo TSV format, labels from one feature
    g = torch.Generator().manual_seed(0)
    cats = torch.randint(0, 20, (300, 26), generator=g)
    rows.write_text("".join(f"{int(c[0] < 8)}\t" + "\t".join(str(int(v)) for v in torch.rand(13, generator=g) * 9)
                            + "\t" + "\t".join(f"{int(v):08x}" for v in c) + "\n" for c in cats))
    run_example("-m", "benchmarks.quality_study", "--data", "real", "--rows", str(rows),
                "--splits", "2", "--epochs", "1", "--batch-size", "64", "--dims", "8",
                "--compressions", "10", "--block-sizes", "4", "--out", str(tmp_path))
    result = json.loads((tmp_path / "real_rows_study.json").read_text())
    assert result["args"]["rows_read"] == 300 and result["replicate"] == "split"
    assert [(r["split"], r["embedding"]) for r in result["rows"]] == [
        (0, "full"), (0, "robe"), (1, "full"), (1, "robe")]
    cell = [s for s in result["summary"] if s["embedding"] == "robe"][0]
    assert cell["splits"] == [0, 1] and cell["hash"] == "reference"
    assert cell["auc_gap"] == pytest.approx(sum(r["test_auc"] - f["test_auc"] for f, r in zip(
        result["rows"][::2], result["rows"][1::2])) / 2)


@pytest.mark.slow
def test_full_vs_robe_auc_example():
    out = run_example("examples/full_vs_robe_auc.py", "--steps", "20", "--batch-size", "256",
                      "--eval-batches", "4", "--compression", "100")
    rows = {line[:16].strip(): line.split() for line in out.splitlines()
            if line.startswith(("full tables", "ROBE-Z"))}
    assert set(rows) == {"full tables", "ROBE-Z 100x"}
    for fields in rows.values():
        assert 0.5 < float(fields[-2]) <= 1.0  # AUC
    full_floats = int(rows["full tables"][2].replace(",", ""))
    robe_floats = int(rows["ROBE-Z 100x"][2].replace(",", ""))
    assert 0.009 < robe_floats / full_floats < 0.011


@pytest.mark.slow
def test_sharded_pipeline_example_on_two_ranks():
    out = run_example("-m", "torch.distributed.run", "--nproc-per-node", "2",
                      "examples/sharded_dlrm_pipeline.py", "--steps", "12", "--batch-size", "64",
                      "--pipeline", "fused_sparse_dist")
    assert "step   12  loss" in out
    assert float(out.split("fused_sparse_dist on 2 rank(s): held-out AUC")[1].split()[0]) > 0.5


@pytest.mark.slow
def test_train_throughput_ranks_mode_runs(tmp_path):
    """2 processes under DMP against 1 process at 1 and 2 threads, the same global batch."""
    run_example("-m", "benchmarks.train_throughput", "--ranks", "--steps", "8", "--batch-size",
                "128", "--log-every", "2", "--cycle", "2", "--rounds", "1",
                "--cardinality-scale", "0.001", "--out", str(tmp_path))
    result = json.loads((tmp_path / "distributed_step.json").read_text())
    assert result["mode"] == "ranks" and result["ratio"] is None
    settings = result["settings"]
    assert {name: nproc for name, (nproc, _) in settings.items()} == {
        "1 process x 1 thread": 1, "DMP, 2 processes x 1 thread": 2, "1 process x 2 threads": 1}
    for name, (nproc, overrides) in settings.items():  # the same global batch
        assert f"run.batch_size={128 // nproc}" in overrides and "sharding=data_parallel" in overrides
        assert len(result["samples_per_s"][name]) == 1 and result["median_samples_per_s"][name] > 0


@pytest.mark.slow
def test_train_throughput_benchmark_runs(tmp_path):
    out_md = tmp_path / "train_throughput.md"
    run_example("-m", "benchmarks.train_throughput", "--steps", "12",
                "--batch-size", "64", "--log-every", "4", "--cardinality-scale", "0.001",
                "--cycle", "2", "--rounds", "1", "--cache-sized-scale", "0.0001", "--out", str(out_md))
    result = json.loads((tmp_path / "train_throughput.json").read_text())
    rates, median = result["samples_per_s"], result["median_samples_per_s"]
    assert set(rates) == {"full", "robe", "cache_sized"} and all(len(v) == 1 for v in rates.values())
    assert all(v > 0 for v in median.values()) and result["machine"]["cpu"]
    assert result["ratio"] == pytest.approx(median["robe"] / median["full"])
    assert result["cache_sized_ratio"] == pytest.approx(median["cache_sized"] / median["full"])
    # the cache-sized run really has smaller tables than the full run (its log says how many)
    stored = {run: int(result["logged"][run].split(" stored")[0].split(", ")[-1].replace(",", ""))
              for run in ("full", "cache_sized")}
    assert stored["cache_sized"] < stored["full"] / 5, stored  # scale 0.0001 against 0.001
    assert "data.cardinality_scale=0.0001" in result["settings"]["cache_sized"][1]


def test_interaction_benchmark_runs(tmp_path):
    run_example("-m", "benchmarks.interaction", "--shapes", "32x3x4", "64x5x8",
                "--rounds", "1", "--iters", "2", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "interaction.json").read_text())["rows"]
    assert [(r["batch"], r["features"], r["dim"]) for r in rows] == [(32, 3, 4), (64, 5, 8)]
    for r in rows:
        assert r["torchrec_ms"] > 0 and r["fast_ms"] > 0
        assert r["speedup"] == pytest.approx(r["torchrec_ms"] / r["fast_ms"])


def test_sequence_two_tower_example_trains():
    out = run_example("examples/sequence_two_tower.py", "--steps", "120", "--log-every", "40",
                      "--batch-size", "128", "--num-items", "2000", "--pooling", "attention")
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines()
              if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    assert "compressed to" in out and float(out.split("held-out AUC")[1]) > 0.8, out


def test_unpooled_ops_benchmark_runs(tmp_path):
    run_example("-m", "benchmarks.unpooled_ops", "--quick", "--out", str(tmp_path))
    result = json.loads((tmp_path / "unpooled_ops.json").read_text())
    ms = result["ms"]
    assert len(ms) == 16 and all(t > 0 for t in ms.values())
    assert result["ratios"]["unpooled / pooled, forward"] == pytest.approx(
        ms["unpooled, 1 feature: forward"] / ms["pooled, one id per bag: forward"])
    assert "unpooled, 4 features (skewed), compiled: forward" in ms  # the compiled rows
