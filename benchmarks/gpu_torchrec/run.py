"""The GPU proof of issue 30 in one command: TorchRec's DLRM with ROBE-Z tables under DMP and
the train pipelines on one GPU (NCCL, world size 1), the FusedSparseDist overlap, the
pipeline comparison, and the training app with a checkpoint and a resume.

Meant for a machine with a CUDA torch and Triton but no CUDA FBGEMM: the carried wheels
(``wheels.sh``) give torchrec and fbgemm-gpu-cpu, and :mod:`fbgemm_cuda_shim` gives the few
FBGEMM sparse ops TorchRec calls a CUDA kernel. Parts (each guarded: one failing does not stop
the others; the exit status is 1 if any failed, 2 without a GPU unless ``--cpu``):

1. ``shim``: the shim's status here and in a spawned rank; a KJT and a KeyedTensor on the
   device (offsets, permute, split, regroup and its backward) equal to the same on CPU.
2. ``pipelines``: DMP with a data-parallel plan and with a table-wise plan; plain (twice),
   SparseDist, FusedSparseDist and SemiSync train the same batches. The losses of SparseDist
   and FusedSparseDist must equal plain's bit for bit when two plain runs do (else within
   ``LOSS_RTOL``); SemiSync's equal plain's bit for bit before its ``start_batch`` and within
   ``SEMI_SYNC_ATOL`` after (its embeddings are one step stale by design).
3. ``overlap``: a ``torch.profiler`` trace of FusedSparseDist; how much of the lookup of batch
   i+1 overlaps the dense optimizer step of batch i (:mod:`overlap`).
4. ``compare``: ``robe_torchrec.pipelines.compare`` (its Hydra config, composed here; the plot is skipped
   when matplotlib is missing), P50/P90 step time, peak memory and QPS per pipeline, beside
   the P90 changes TorchRec's pull request measured.
5. ``app``: ``python -m robe_torchrec.train run.device=cuda`` at small sizes with checkpoints,
   then the same run directory resumed to more steps.

It writes ``--out`` (markdown) and the same stem ``.json``, naming the card, the versions and
the commit. ``--cpu`` runs it all on CPU with gloo (the ROBE ops use their C++ kernel there):
``tests/test_gpu_torchrec_cpu.py`` runs that mode in CI.

Run on the GPU machine from the repository root (see docs/benchmarks.md)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 -m benchmarks.gpu_torchrec.run --out results/gpu_pipelines_h100.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from robe_torchrec.testing import fbgemm_cuda_shim

# robe_torchrec.pipelines.compare spawns its ranks, and a spawned process re-imports this main module (as
# __mp_main__): installing here gives those ranks the shim too. Errors wait for the report.
try:
    SHIM_STATUS: Dict[str, str] = fbgemm_cuda_shim.install()
    SHIM_ERROR: Optional[str] = None
except Exception as e:  # noqa: BLE001 - reported by the shim part
    SHIM_STATUS, SHIM_ERROR = {}, f"{type(e).__name__}: {e}"

#: relative tolerance on a step's loss when two plain runs already differ (atomics)
LOSS_RTOL = 1e-4
#: absolute tolerance on SemiSync's losses from start_batch on (one step stale embeddings)
SEMI_SYNC_ATOL = 0.05
#: P90 change against SparseDist in TorchRec's FusedSparseDist pull request (seed 002,
#: SparseNN on GPUs): SparseDist 6034 ms, FusedSparseDist 5662 (lookup before the optimizer)
#: and 5606 (after), SemiSync 5447
TORCHREC_P90_VS_SPARSE_DIST = {"fused_sparse_dist": -0.062, "fused_sparse_dist_after_opt": -0.071,
                               "semi_sync": -0.097, "sparse_dist": 0.0}


# ---------------------------------------------------------------- sizes

def sizes(cpu: bool) -> Dict[str, Any]:
    """Small enough for a few minutes on one GPU, and for CI on CPU."""
    if cpu:
        return {"parity_batch": 64, "parity_steps": 8, "num_sparse": 4, "semi_start": 3,
                "overlap_batch": 128, "overlap_steps": 6, "compare_steps": 6,
                "compare_batch": 128, "compare_scale": 0.001, "app_batch": 64,
                "app_steps": (4, 6), "app_scale": 0.001}
    return {"parity_batch": 1024, "parity_steps": 12, "num_sparse": 26, "semi_start": 4,
            "overlap_batch": 8192, "overlap_steps": 10, "compare_steps": 40,
            "compare_batch": 4096, "compare_scale": 0.1, "app_batch": 1024,
            "app_steps": (40, 60), "app_scale": 0.01}


# ---------------------------------------------------------------- helpers

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(device: torch.device) -> None:
    """A 1-rank process group through env://: NCCL on CUDA, gloo on CPU."""
    import torch.distributed as dist

    from robe_torchrec.distributed.process_group import before_init_process_group

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(_free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    before_init_process_group()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def _end_group() -> None:
    import torch.distributed as dist

    from robe_torchrec.distributed.process_group import destroy_process_group

    if dist.is_initialized():
        destroy_process_group()


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as e:  # noqa: BLE001 - reported, not needed
        return f"not importable ({type(e).__name__})"
    version = getattr(mod, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        try:
            version = dist_version(module)
        except PackageNotFoundError:
            version = "?"
    return str(version)


def _commit(given: Optional[str]) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parents[2])
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10,
                                   cwd=Path(__file__).resolve().parents[2]).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("ROBE_COMMIT", "unknown (no .git here; pass --commit)")


def environment(cpu: bool, commit: Optional[str]) -> Dict[str, Any]:
    """The card, the versions and the commit the results belong to."""
    import platform

    card = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    return {"mode": "cpu (gloo)" if cpu else "cuda (nccl)", "card": card,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "torchrec": _version("torchrec"), "fbgemm_gpu": _version("fbgemm_gpu"),
            "triton": _version("triton"), "python": platform.python_version(),
            "commit": _commit(commit), "host": platform.node(),
            "shim": SHIM_STATUS, "shim_error": SHIM_ERROR}


def _spec(shared: bool):
    from robe_torchrec import RobeConfig
    from robe_torchrec.dlrm import DLRMSpec, OptimizerSpec

    return DLRMSpec(robe=RobeConfig(compression=1000.0, block_size=8, shared=shared),
                    embedding_dim=16, dense_arch=(64, 16), over_arch=(64, 32, 1),
                    embedding_optimizer=OptimizerSpec("adagrad", lr=0.05),
                    dense_optimizer=OptimizerSpec("sgd", lr=0.1))


# ---------------------------------------------------------------- 1. shim

def part_shim(device: torch.device, sz: Dict[str, Any]) -> Dict[str, Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

    from benchmarks.gpu_torchrec.record_ops import FbgemmOpRecorder
    from robe_torchrec.distributed.spawn import run_ranks

    if SHIM_ERROR:
        raise RuntimeError(f"the shim did not install: {SHIM_ERROR}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    in_rank = run_ranks(fbgemm_cuda_shim.installed, 1, backend=backend, timeout=300.0)[0]
    problems: List[str] = []
    if in_rank != SHIM_STATUS:
        problems.append(f"a spawned rank has shim status {in_rank}, this process {SHIM_STATUS}")

    def kjt_work(dev: torch.device) -> List[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(0, 4, (3 * 5,), generator=g)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], values.to(dev),
                                                  lengths.to(dev))
        permuted = kjt.permute([2, 0, 1])
        first, _rest = kjt.split([1, 2])
        x = torch.randn(5, 9, generator=g).to(dev).requires_grad_()
        kts = [KeyedTensor(["x", "y"], [4, 3], x[:, :7]), KeyedTensor(["z"], [2], x[:, 7:])]
        regrouped = KeyedTensor.regroup(kts, [["z", "x"], ["y"]])
        (regrouped[0] * torch.arange(6, device=dev)).sum().backward()
        return [kjt.offsets(), permuted.values(), permuted.lengths(), permuted.offsets(),
                first.offsets(), kjt.to_dict()["b"].values(), *regrouped, x.grad]

    with FbgemmOpRecorder() as rec:
        here = kjt_work(device)
    reference = kjt_work(torch.device("cpu"))
    for i, (a, b) in enumerate(zip(here, reference)):
        if not torch.equal(a.detach().cpu(), b.detach()):
            problems.append(f"KJT/KT result {i} differs from CPU")
    missing = sorted(rec.ops - set(fbgemm_cuda_shim.SHIMMED_OPS))
    if problems:
        raise AssertionError("; ".join(problems))
    return {"status_here": SHIM_STATUS, "status_in_spawned_rank": in_rank,
            "fbgemm_ops_called": sorted(rec.ops), "fbgemm_ops_not_in_shim": missing,
            "summary": f"KJT/KT on {device.type} equal CPU; fbgemm ops called: "
                       f"{', '.join(sorted(rec.ops))}"}


# ---------------------------------------------------------------- 2. pipelines

def _train(device: torch.device, sharding: str, name: str, options: Dict[str, Any],
           sz: Dict[str, Any]):
    from robe_torchrec.pipelines import make_pipeline, run_to_end
    from robe_torchrec.pipelines.model import build_sharded_dlrm, gather_state
    from robe_torchrec.data.synthetic import SyntheticCriteo

    from benchmarks.gpu_torchrec.record_ops import FbgemmOpRecorder

    data = SyntheticCriteo(batch_size=sz["parity_batch"], cardinality_scale=0.01, seed=0,
                           num_sparse=sz["num_sparse"])
    batches = [data.batch(i) for i in range(sz["parity_steps"])]
    losses: List[float] = []
    with FbgemmOpRecorder() as rec:
        dmp, dense = build_sharded_dlrm(_spec(shared=False), data, sharding, device)
        pipeline = make_pipeline(name, dmp, dense, device, **options)
        run_to_end(pipeline, iter(batches), lambda out: losses.append(float(out[0].detach())))
    state = gather_state(dmp)
    return losses, state, rec.ops


def _same_state(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _max_rel(a: List[float], b: List[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def part_pipelines(device: torch.device, sz: Dict[str, Any]) -> Dict[str, Any]:
    runs = [("plain", "plain", {}), ("plain (again)", "plain", {}),
            ("sparse_dist", "sparse_dist", {}), ("fused_sparse_dist", "fused_sparse_dist", {}),
            ("fused_sparse_dist_after_opt", "fused_sparse_dist",
             {"embedding_lookup_after_opt": True}),
            ("semi_sync", "semi_sync", {"start_batch": sz["semi_start"]})]
    rows: List[Dict[str, Any]] = []
    failures: List[str] = []
    ops: set = set()
    _init_group(device)
    try:
        for sharding in ("data_parallel", "table_wise"):
            results: Dict[str, Any] = {}
            for label, name, options in runs:
                try:
                    results[label] = _train(device, sharding, name, options, sz)
                    ops |= results[label][2]
                except Exception as e:  # noqa: BLE001 - one pipeline's failure is a row
                    failures.append(f"{sharding} {label}: {type(e).__name__}: {e}")
                    rows.append({"sharding": sharding, "pipeline": label, "ok": False,
                                 "verdict": f"FAILED: {type(e).__name__}: {str(e)[:300]}",
                                 "traceback": traceback.format_exc()})
            if "plain" not in results:
                continue
            ref_losses, ref_state, _ = results["plain"]
            deterministic = ("plain (again)" in results
                             and results["plain (again)"][0] == ref_losses
                             and _same_state(results["plain (again)"][1], ref_state))
            for label, name, options in runs:
                if label not in results or label == "plain":
                    continue
                losses, state, _ = results[label]
                bitwise = losses == ref_losses
                same_state = _same_state(state, ref_state)
                if name == "semi_sync":
                    k = sz["semi_start"]
                    before = losses[:k] == ref_losses[:k]
                    worst = max((abs(x - y) for x, y in zip(losses[k:], ref_losses[k:])),
                                default=0.0)
                    ok = (before or not deterministic) and worst <= SEMI_SYNC_ATOL
                    verdict = (f"steps < {k}: {'bit-identical' if before else 'differ'}; "
                               f"from {k}: max abs dloss {worst:.2e} (tolerance {SEMI_SYNC_ATOL})")
                elif deterministic:
                    ok = bitwise and same_state
                    verdict = ("bit-identical losses and weights" if ok else
                               f"differs: max rel dloss {_max_rel(losses, ref_losses):.2e}, "
                               f"weights {'same' if same_state else 'differ'}")
                else:
                    rel = _max_rel(losses, ref_losses)
                    ok = rel <= LOSS_RTOL
                    verdict = (f"plain is not bitwise reproducible here; max rel dloss "
                               f"{rel:.2e} (tolerance {LOSS_RTOL})")
                if not ok:
                    failures.append(f"{sharding} {label}: {verdict}")
                rows.append({"sharding": sharding, "pipeline": label, "ok": ok,
                             "verdict": verdict, "steps": len(losses),
                             "first_loss": losses[0] if losses else None,
                             "final_loss": losses[-1] if losses else None,
                             "losses": losses, "plain_losses": ref_losses,
                             "plain_deterministic": deterministic})
    finally:
        _end_group()
    out = {"rows": rows, "fbgemm_ops_called": sorted(ops),
           "fbgemm_ops_not_in_shim": sorted(ops - set(fbgemm_cuda_shim.SHIMMED_OPS)),
           "summary": f"{sum(r['ok'] for r in rows)} of {len(rows)} checks passed"}
    if failures:
        out["error"] = "; ".join(failures)
    return out


# ---------------------------------------------------------------- 3. overlap

def part_overlap(device: torch.device, sz: Dict[str, Any], out_dir: Path, stem: str
                 ) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from robe_torchrec.pipelines import make_pipeline
    from robe_torchrec.pipelines.model import build_sharded_dlrm
    from robe_torchrec.data.synthetic import SyntheticCriteo

    from benchmarks.gpu_torchrec.overlap import lookup_optimizer_overlap

    warmup, steps = 4, sz["overlap_steps"]
    data = SyntheticCriteo(batch_size=sz["overlap_batch"], cardinality_scale=0.1, seed=0,
                           num_sparse=sz["num_sparse"])
    batches = iter([data.batch(i) for i in range(warmup + steps + 2)])
    _init_group(device)
    try:
        dmp, dense = build_sharded_dlrm(_spec(shared=False), data, "table_wise", device)
        pipeline = make_pipeline("fused_sparse_dist", dmp, dense, device)
        for _ in range(warmup):
            pipeline.progress(batches)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if device.type == "cuda" else [])
        if device.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                pipeline.progress(batches)
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        _end_group()
    trace_path = out_dir / f"{stem}_fused_sparse_dist_trace.json"
    prof.export_chrome_trace(str(trace_path))
    with open(trace_path) as f:
        trace = json.load(f)
    result = lookup_optimizer_overlap(trace)
    # compressed: the trace comes back from the GPU machine with the report
    with open(trace_path, "rb") as src, gzip.open(f"{trace_path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace_path.unlink()
    result["trace"] = f"{trace_path.name}.gz"
    result["trace_gz_mib"] = round(Path(f"{trace_path}.gz").stat().st_size / 2**20, 2)
    if device.type == "cuda":
        if result["steps"] == 0:
            raise AssertionError(f"no step with both an optimizer and a next lookup range on "
                                 f"the GPU ({result['ranges_found']} ranges in the trace)")
        frac = result["overlap_of_lookup"]
        result["summary"] = (f"{100 * frac:.1f}% of the next lookup's GPU time overlaps the "
                             f"optimizer step ({result['steps']} steps; lookup streams "
                             f"{result['lookup_streams']}, optimizer streams "
                             f"{result['optimizer_streams']})")
    else:
        result["summary"] = (f"CPU: no GPU activity to overlap; {result['ranges_found']} "
                             "pipeline ranges found in the trace")
    return result


# ---------------------------------------------------------------- 4. compare

def part_compare(device: torch.device, sz: Dict[str, Any], out_dir: Path, stem: str
                 ) -> Dict[str, Any]:
    from hydra import compose, initialize_config_dir

    import robe_torchrec.pipelines.compare as compare
    from robe_torchrec.hydra_configs import config_dir

    try:
        import matplotlib  # noqa: F401
        plotted = True
    except ImportError:  # not in the GPU image: the numbers matter, not the picture
        compare.plot = lambda *args, **kwargs: None
        plotted = False
    tag = f"{stem}_compare"
    overrides = [f"device={device.type}", "world_size=1", "rounds=1",
                 f"steps={sz['compare_steps']}", f"batch_size={sz['compare_batch']}",
                 f"cardinality_scale={sz['compare_scale']}", f"tag={tag}",
                 f"out_dir={out_dir}", "overwrite=true", "threads_per_rank=1"]
    with initialize_config_dir(config_dir=str(config_dir("pipeline_compare")),
                               version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    compare.main(cfg)
    with open(out_dir / f"compare_{tag}.json") as f:
        report = json.load(f)
    rows = []
    for r in report["rows"]:
        rows.append({"pipeline": r["pipeline"], "p50_ms": r["p50_ms"], "p90_ms": r["p90_ms"],
                     "p90_vs_sparse_dist": r["p90_vs_ref"] - 1.0,
                     "torchrec_p90_vs_sparse_dist": TORCHREC_P90_VS_SPARSE_DIST.get(r["pipeline"]),
                     "samples_per_s": r["samples_per_s"],
                     "cuda_alloc_mib": r["cuda_alloc_mib"],
                     "cuda_reserved_mib": r["cuda_reserved_mib"],
                     "peak_rss_mib": r["peak_rss_mib"], "parity": r["parity"]})
    return {"overrides": overrides, "report": f"compare_{tag}.md", "plotted": plotted,
            "rows": rows, "summary": f"{len(rows)} pipelines timed"}


# ---------------------------------------------------------------- 5. app

def _app(overrides: List[str], run_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)  # the app makes its own 1-rank group when launched plainly
    env["ROBE_RECORD_FBGEMM_OPS"] = str(run_dir / "fbgemm_ops.json")
    cmd = [sys.executable, "-m", "benchmarks.gpu_torchrec.app_with_shim", *overrides,
           f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=Path(__file__).resolve().parents[2])


def part_app(device: torch.device, sz: Dict[str, Any], out_dir: Path, stem: str,
             app_device: Optional[str] = None) -> Dict[str, Any]:
    run_dir = (out_dir / f"{stem}_app").resolve()
    first, second = sz["app_steps"]
    every = first // 2
    common = [f"run.device={app_device or device.type}", f"run.batch_size={sz['app_batch']}",
              f"data.cardinality_scale={sz['app_scale']}", f"run.checkpoint_every={every}",
              "run.progress_bar=false", f"run.log_every={every}", "run.eval_batches=2",
              "run.test_batches=2", "run.threads=1", "pipeline=fused_sparse_dist"]
    runs = []
    for steps in (first, second):
        t0 = time.time()
        proc = _app([*common, f"run.steps={steps}"], run_dir, timeout=240.0)
        runs.append({"steps": steps, "rc": proc.returncode, "wall_s": round(time.time() - t0, 1),
                     "stderr_tail": proc.stderr[-3000:], "stdout_tail": proc.stdout[-1500:]})
        if proc.returncode != 0:
            raise RuntimeError(f"the app (run.steps={steps}) exited {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    resumed = f"at step {first}" in log and "resumed from checkpoint" in log
    metrics = (run_dir / "metrics.csv").read_text().splitlines()
    trained_to_end = any(line.startswith("train,") and line.split(",")[1] == str(second)
                         for line in metrics)
    ops_file = run_dir / "fbgemm_ops.json"
    ops = json.loads(ops_file.read_text()) if ops_file.exists() else None
    result = {"runs": runs, "checkpoints": checkpoints, "resumed": resumed,
              "trained_to_end": trained_to_end, "fbgemm_ops_called": ops,
              "run_dir": run_dir.name, "overrides": common}
    if not (resumed and trained_to_end and checkpoints):
        raise AssertionError(f"app: resumed={resumed}, trained to step {second}="
                             f"{trained_to_end}, checkpoints={checkpoints}")
    result["summary"] = (f"trained {first} steps with checkpoints {checkpoints}, resumed at "
                         f"step {first}, trained to {second}")
    return result


# ---------------------------------------------------------------- report

def _guarded(name: str, fn: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    t0 = time.time()
    print(f"== {name}", flush=True)
    try:
        result = fn()
        result.setdefault("ok", "error" not in result)
    except Exception as e:  # noqa: BLE001 - every part reports, none stops the others
        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()}
    result["wall_s"] = round(time.time() - t0, 1)
    status = "ok" if result["ok"] else f"FAILED: {result.get('error', '')[:2000]}"
    print(f"   {name}: {status} ({result['wall_s']} s) {result.get('summary', '')}", flush=True)
    return result


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:+.1f}%"


def markdown(env: Dict[str, Any], parts: Dict[str, Dict[str, Any]], command: str,
             wall_s: float) -> str:
    lines = [f"# Pipelines and DMP on {'a GPU' if env['card'] else 'CPU'}: "
             f"{env['card'] or 'CPU mode'}", "",
             f"Generated by `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}),"
             f" {wall_s:.0f} s; every number is in the `.json` beside this file.", "",
             "| | |", "|---|---|"]
    for key in ("mode", "card", "torch", "cuda", "torchrec", "fbgemm_gpu", "triton", "python",
                "commit", "host"):
        lines.append(f"| {key} | {env[key]} |")
    lines.append(f"| FBGEMM CUDA shim | {env['shim'] or env['shim_error']} |")
    lines += ["", "## Parts", "", "| part | result | time (s) |", "|---|---|---:|"]
    for name, r in parts.items():
        text = r.get("summary", "") if r["ok"] else "FAILED: " + r.get("error", "")[:300]
        lines.append(f"| {name} | {text.replace('|', '/').replace(chr(10), ' ')} | "
                     f"{r['wall_s']} |")
    pipes = parts.get("pipelines", {})
    if pipes.get("rows"):
        lines += ["", "## Pipelines against the unpipelined loop", "",
                  f"Bitwise when two plain runs are; otherwise losses within {LOSS_RTOL} "
                  f"relative. SemiSync: bitwise before `start_batch`, then within "
                  f"{SEMI_SYNC_ATOL} absolute (its embeddings are one step stale).", "",
                  "| sharding | pipeline | ok | verdict |", "|---|---|---|---|"]
        for r in pipes["rows"]:
            lines.append(f"| {r['sharding']} | {r['pipeline']} | {'yes' if r['ok'] else 'NO'} "
                         f"| {r['verdict'].replace('|', '/')} |")
    ov = parts.get("overlap", {})
    if ov.get("per_step"):
        lines += ["", "## FusedSparseDist: next lookup against the optimizer step", "",
                  f"Overlap: {ov['overlap_us']:.0f} us of {ov['next_lookup_busy_us']:.0f} us "
                  f"of next-lookup GPU time ({_pct(ov['overlap_of_lookup'])[1:]}), of "
                  f"{ov['optimizer_busy_us']:.0f} us optimizer GPU time "
                  f"({_pct(ov['overlap_of_optimizer'])[1:]}); trace `{ov['trace']}`.", ""]
    comp = parts.get("compare", {})
    if comp.get("rows"):
        mem = "CUDA alloc / reserved (MiB)" if env["card"] else "peak RSS (MiB)"
        lines += ["", "## robe_torchrec.pipelines.compare", "",
                  f"`{' '.join(comp['overrides'])}`; full report `{comp['report']}`.", "",
                  f"| pipeline | P50 (ms) | P90 (ms) | P90 vs sparse_dist | TorchRec's PR | "
                  f"samples/s | {mem} | parity |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in comp["rows"]:
            m = (f"{r['cuda_alloc_mib']:.0f} / {r['cuda_reserved_mib']:.0f}" if env["card"]
                 else f"{r['peak_rss_mib']:.0f}")
            lines.append(f"| {r['pipeline']} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | "
                         f"{_pct(r['p90_vs_sparse_dist'])} | "
                         f"{_pct(r['torchrec_p90_vs_sparse_dist'])} | "
                         f"{r['samples_per_s']:.0f} | {m} | {r['parity']} |")
    failed = [n for n, r in parts.items() if not r["ok"]]
    lines += ["", "## Verdict", "",
              "All parts passed." if not failed else f"Failed: {', '.join(failed)}.", ""]
    for n in failed:
        lines += [f"### {n}", "", "```", parts[n].get("traceback", parts[n].get("error", ""))
                  [-4000:], "```", ""]
    return "\n".join(lines)


PARTS = ("shim", "pipelines", "overlap", "compare", "app")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the markdown report; .json beside it")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors, gloo (CI)")
    parser.add_argument("--commit", help="the commit, where the tree has no .git")
    parser.add_argument("--only", nargs="*", choices=PARTS, help="run only these parts")
    parser.add_argument("--app-device", help="the app's run.device (default: cuda, or cpu "
                        "with --cpu), e.g. cuda:0")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device (use --cpu for the CPU mode)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.stem
    sz = sizes(args.cpu)
    env = environment(args.cpu, args.commit)
    print(json.dumps({k: v for k, v in env.items()}), flush=True)
    jobs = {"shim": lambda: part_shim(device, sz),
            "pipelines": lambda: part_pipelines(device, sz),
            "overlap": lambda: part_overlap(device, sz, out.parent, stem),
            "compare": lambda: part_compare(device, sz, out.parent, stem),
            "app": lambda: part_app(device, sz, out.parent, stem, args.app_device)}
    start = time.time()
    parts = {name: _guarded(name, job) for name, job in jobs.items()
             if not args.only or name in args.only}
    wall = time.time() - start
    command = "python -m benchmarks.gpu_torchrec.run " + " ".join(argv or sys.argv[1:])
    out.write_text(markdown(env, parts, command, wall))
    with open(out.with_suffix(".json"), "w") as f:
        json.dump({"environment": env, "sizes": sz, "wall_s": wall, "parts": parts}, f,
                  indent=1, default=str)
    failed = [n for n, r in parts.items() if not r["ok"]]
    print(f"written: {out} (+ .json); {'all parts passed' if not failed else 'FAILED: ' + ', '.join(failed)}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
