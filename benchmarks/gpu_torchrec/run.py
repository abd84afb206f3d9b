"""Does TorchRec's side work on one GPU? DLRM with ROBE-Z tables under DMP and the train
pipelines (NCCL, world size 1), the FusedSparseDist overlap, the pipeline comparison and the
training app with a checkpoint and a resume, in one command and one report.

For a machine with a CUDA torch and Triton but no CUDA FBGEMM: the carried wheels
(``wheels.sh``) give torchrec and fbgemm-gpu-cpu, ``robe_torchrec.testing.fbgemm_cuda_shim``
gives CUDA kernels to the FBGEMM sparse ops TorchRec calls. Parts, each guarded: ``shim``,
``pipelines`` (each pipeline's losses and weights against plain's), ``overlap``
(:mod:`overlap`), ``compare`` (``robe_torchrec.pipelines.compare``), ``app`` and
``sequence`` (``benchmarks.unpooled_ops`` on the device). Exit
status: 0 when every part passed, 1 when one failed, 2 without a GPU unless ``--cpu`` (gloo,
the C++ kernel: what CI runs). docs/benchmarks.md has the set-up::

    PYTHONPATH=/tmp/site:. python3 -m benchmarks.gpu_torchrec.run --out results/gpu_pipelines.md
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from benchmarks.common import table
from robe_torchrec.machine import version
from robe_torchrec.testing import fbgemm_cuda_shim

# robe_torchrec.pipelines.compare spawns its ranks, which re-import this main module (as
# __mp_main__): installing here gives them the shim too. Errors wait for the report.
try:
    SHIM_STATUS: Dict[str, str] = fbgemm_cuda_shim.install()
    SHIM_ERROR: Optional[str] = None
except Exception as e:  # noqa: BLE001 - reported by the shim part
    SHIM_STATUS, SHIM_ERROR = {}, f"{type(e).__name__}: {e}"

ROOT = Path(__file__).resolve().parents[2]
#: relative tolerance on a step's loss when two plain runs already differ (float atomics)
LOSS_RTOL = 1e-4
#: absolute tolerance on SemiSync's losses from start_batch on (one step stale embeddings)
SEMI_SYNC_ATOL = 0.05
#: P90 change against SparseDist in TorchRec's FusedSparseDist pull request (SparseNN on GPUs)
TORCHREC_P90_VS_SPARSE_DIST = {"fused_sparse_dist": -0.062, "fused_sparse_dist_after_opt": -0.071,
                               "semi_sync": -0.097, "sparse_dist": 0.0}
#: in the order they run: the pipelines' proof first; ``compare`` (the longest, five
#: spawned runs, its report written when the last ends) last, where a time limit that cuts
#: the run short costs the least
PARTS = ("shim", "pipelines", "overlap", "sequence", "app", "compare")


def sizes(cpu: bool) -> Dict[str, Any]:
    """Small enough for a few minutes on one GPU, and for CI on CPU."""
    if cpu:
        return {"parity_batch": 64, "parity_steps": 8, "num_sparse": 4, "semi_start": 3,
                "overlap_batch": 128, "overlap_steps": 6, "compare_steps": 6, "compare_batch": 128,
                "compare_scale": 0.001, "app_batch": 64, "app_steps": (4, 6), "app_scale": 0.001,
                "sequence_args": ["--quick"]}
    return {"parity_batch": 1024, "parity_steps": 12, "num_sparse": 26, "semi_start": 4,
            "overlap_batch": 8192, "overlap_steps": 10, "compare_steps": 20, "compare_batch": 4096,
            "compare_scale": 0.1, "app_batch": 1024, "app_steps": (40, 60), "app_scale": 0.01,
            # the compiled rows traced without Inductor: its kernels would compile for a
            # minute of the session's few
            "sequence_args": ["--iters", "10", "--compile-backend", "aot_eager"]}


@contextlib.contextmanager
def _group(device: torch.device) -> Iterator[None]:
    """A 1-rank process group through env:// for the block: NCCL on CUDA, gloo on CPU."""
    import torch.distributed as dist

    from robe_torchrec.distributed.process_group import (before_init_process_group,
                                                         destroy_process_group)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    before_init_process_group()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        yield
    finally:
        if dist.is_initialized():
            destroy_process_group()


def _commit(given: Optional[str]) -> str:
    """The commit the results belong to: given, or the checkout's (a copy has no .git)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT) if shutil.which("git") else None
    if given or head is None or head.returncode:
        return given or os.environ.get("ROBE_COMMIT", "unknown (no .git here; pass --commit)")
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def environment(cpu: bool, commit: Optional[str]) -> Dict[str, Any]:
    """The card, the versions and the commit the results belong to."""
    return {"mode": "cpu (gloo)" if cpu else "cuda (nccl)",
            "card": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            **{m: version(m) for m in ("torchrec", "fbgemm_gpu", "triton")},
            "python": platform.python_version(), "commit": _commit(commit), "host": platform.node(),
            "shim": SHIM_STATUS, "shim_error": SHIM_ERROR}


def _spec():
    from robe_torchrec import RobeConfig
    from robe_torchrec.dlrm import DLRMSpec, OptimizerSpec

    return DLRMSpec(robe=RobeConfig(compression=1000.0, block_size=8, shared=False),
                    embedding_dim=16, dense_arch=(64, 16), over_arch=(64, 32, 1),
                    embedding_optimizer=OptimizerSpec("adagrad", lr=0.05),
                    dense_optimizer=OptimizerSpec("sgd", lr=0.1))


def part_shim(device: torch.device, sz: Dict[str, Any]) -> Dict[str, Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

    from robe_torchrec.testing.fbgemm_cuda_shim import FbgemmOpRecorder
    from robe_torchrec.distributed.spawn import run_ranks

    if SHIM_ERROR:
        raise RuntimeError(f"the shim did not install: {SHIM_ERROR}")
    in_rank = run_ranks(fbgemm_cuda_shim.installed, 1, backend="nccl" if device.type == "cuda"
                        else "gloo", timeout=300.0)[0]
    problems = [] if in_rank == SHIM_STATUS else [f"a spawned rank has shim status {in_rank}"]

    def kjt_work(dev: torch.device) -> List[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(0, 4, (3 * 5,), generator=g)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], values.to(dev), lengths.to(dev))
        permuted, (first, _) = kjt.permute([2, 0, 1]), kjt.split([1, 2])
        x = torch.randn(5, 9, generator=g).to(dev).requires_grad_()
        regrouped = KeyedTensor.regroup([KeyedTensor(["x", "y"], [4, 3], x[:, :7]),
                                         KeyedTensor(["z"], [2], x[:, 7:])], [["z", "x"], ["y"]])
        (regrouped[0] * torch.arange(6, device=dev)).sum().backward()
        return [kjt.offsets(), permuted.values(), permuted.lengths(), permuted.offsets(),
                first.offsets(), kjt.to_dict()["b"].values(), *regrouped, x.grad]

    with FbgemmOpRecorder() as rec:
        here = kjt_work(device)
    problems += [f"KJT/KT result {i} differs from CPU" for i, (a, b) in
                 enumerate(zip(here, kjt_work(torch.device("cpu"))))
                 if not torch.equal(a.detach().cpu(), b.detach())]
    if problems:
        raise AssertionError("; ".join(problems))
    return {"status_here": SHIM_STATUS, "status_in_spawned_rank": in_rank,
            "fbgemm_ops_called": sorted(rec.ops),
            "fbgemm_ops_not_in_shim": sorted(rec.ops - set(fbgemm_cuda_shim.SHIMMED_OPS)),
            "summary": f"KJT/KT on {device.type} equal CPU; fbgemm ops called: "
                       + ", ".join(sorted(rec.ops))}


def _train(device: torch.device, sharding: str, name: str, options: Dict[str, Any],
           sz: Dict[str, Any]):
    from robe_torchrec.testing.fbgemm_cuda_shim import FbgemmOpRecorder
    from robe_torchrec.data.synthetic import SyntheticCriteo
    from robe_torchrec.pipelines import make_pipeline, run_to_end
    from robe_torchrec.pipelines.model import build_sharded_dlrm, gather_state

    data = SyntheticCriteo(batch_size=sz["parity_batch"], cardinality_scale=0.01, seed=0,
                           num_sparse=sz["num_sparse"])
    losses: List[float] = []
    with FbgemmOpRecorder() as rec:
        dmp, dense = build_sharded_dlrm(_spec(), data, sharding, device)
        run_to_end(make_pipeline(name, dmp, dense, device, **options),
                   iter([data.batch(i) for i in range(sz["parity_steps"])]),
                   lambda out: losses.append(float(out[0].detach())))
    return losses, gather_state(dmp), rec.ops


def _verdict(name: str, losses: List[float], state, plain, deterministic: bool, k: int):
    """(ok, verdict) of one pipeline's run against plain's."""
    ref_losses, ref_state = plain
    same = state.keys() == ref_state.keys() and all(torch.equal(state[n], ref_state[n])
                                                    for n in state)
    rel = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(losses, ref_losses)), default=0.0)
    if name == "semi_sync":
        before = losses[:k] == ref_losses[:k]
        worst = max((abs(x - y) for x, y in zip(losses[k:], ref_losses[k:])), default=0.0)
        return ((before or not deterministic) and worst <= SEMI_SYNC_ATOL,
                f"steps < {k}: {'bit-identical' if before else 'differ'}; from {k}: max abs dloss "
                f"{worst:.2e} (tolerance {SEMI_SYNC_ATOL})")
    if deterministic:
        ok = losses == ref_losses and same
        return ok, ("bit-identical losses and weights" if ok else
                    f"differs: max rel dloss {rel:.2e}, weights {'same' if same else 'differ'}")
    return rel <= LOSS_RTOL, (f"plain is not bitwise reproducible here; max rel dloss {rel:.2e} "
                              f"(tolerance {LOSS_RTOL})")


def part_pipelines(device: torch.device, sz: Dict[str, Any]) -> Dict[str, Any]:
    runs = [("plain", "plain", {}), ("plain (again)", "plain", {}),
            ("sparse_dist", "sparse_dist", {}), ("fused_sparse_dist", "fused_sparse_dist", {}),
            ("fused_sparse_dist_after_opt", "fused_sparse_dist",
             {"embedding_lookup_after_opt": True}),
            ("semi_sync", "semi_sync", {"start_batch": sz["semi_start"]})]
    rows: List[Dict[str, Any]] = []
    ops: set = set()
    with _group(device):
        for sharding in ("data_parallel", "table_wise"):
            results: Dict[str, Any] = {}
            for label, name, options in runs:
                try:
                    results[label] = _train(device, sharding, name, options, sz)
                    ops |= results[label][2]
                except Exception as e:  # noqa: BLE001 - one pipeline's failure is a row
                    rows.append({"sharding": sharding, "pipeline": label, "ok": False,
                                 "verdict": f"FAILED: {type(e).__name__}: {str(e)[:300]}",
                                 "traceback": traceback.format_exc()})
            if "plain" not in results:
                continue
            plain = results["plain"][:2]
            again = results.get("plain (again)")
            deterministic = again is not None and _verdict("", *again[:2], plain, True, 0)[0]
            for label, name, _ in runs[1:]:
                if label in results:
                    losses, state, _ = results[label]
                    ok, verdict = _verdict(name, losses, state, plain, deterministic,
                                           sz["semi_start"])
                    rows.append({"sharding": sharding, "pipeline": label, "ok": ok,
                                 "verdict": verdict, "steps": len(losses), "losses": losses,
                                 "plain_losses": plain[0], "plain_deterministic": deterministic})
    failures = [f"{r['sharding']} {r['pipeline']}: {r['verdict']}" for r in rows if not r["ok"]]
    return {"rows": rows, "fbgemm_ops_called": sorted(ops),
            "fbgemm_ops_not_in_shim": sorted(ops - set(fbgemm_cuda_shim.SHIMMED_OPS)),
            "summary": f"{sum(r['ok'] for r in rows)} of {len(rows)} checks passed",
            **({"error": "; ".join(failures)} if failures else {})}


def part_overlap(device: torch.device, sz: Dict[str, Any], out_dir: Path,
                 stem: str) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_torchrec.overlap import lookup_optimizer_overlap
    from robe_torchrec.data.synthetic import SyntheticCriteo
    from robe_torchrec.pipelines import make_pipeline
    from robe_torchrec.pipelines.model import build_sharded_dlrm

    warmup, steps, cuda = 4, sz["overlap_steps"], device.type == "cuda"
    data = SyntheticCriteo(batch_size=sz["overlap_batch"], cardinality_scale=0.1, seed=0,
                           num_sparse=sz["num_sparse"])
    batches = iter([data.batch(i) for i in range(warmup + steps + 2)])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with _group(device):
        dmp, dense = build_sharded_dlrm(_spec(), data, "table_wise", device)
        pipeline = make_pipeline("fused_sparse_dist", dmp, dense, device)
        for _ in range(warmup):
            pipeline.progress(batches)
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                pipeline.progress(batches)
            sync()
    trace = out_dir / f"{stem}_fused_sparse_dist_trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace) as f:
        result = lookup_optimizer_overlap(json.load(f))
    # compressed: the trace comes back from the GPU machine with the report
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    result["trace"] = f"{trace.name}.gz"
    if not cuda:
        result["summary"] = (f"CPU: no GPU activity to overlap; {result['ranges_found']} "
                             "pipeline ranges in the trace")
    elif result["steps"] == 0:
        raise AssertionError(f"no step with both an optimizer and a next lookup range on the GPU "
                             f"({result['ranges_found']} ranges in the trace)")
    else:
        result["summary"] = (f"{100 * result['overlap_of_lookup']:.1f}% of the next lookup's "
                             f"GPU time overlaps the optimizer step ({result['steps']} steps; "
                             f"lookup streams {result['lookup_streams']}, optimizer streams "
                             f"{result['optimizer_streams']})")
    return result


def part_sequence(device: torch.device, sz: Dict[str, Any], out_dir: Path,
                  stem: str) -> Dict[str, Any]:
    """``RobeEmbeddingCollection`` on the device: ``benchmarks.unpooled_ops``'s rows (skewed
    sequence features as one feature of keys, and padded on an array each), its report
    beside this one."""
    from benchmarks import unpooled_ops

    report = out_dir / f"{stem}_unpooled_ops.md"
    result = unpooled_ops.main([*sz["sequence_args"], "--device", device.type,
                                "--out", str(report)])
    keys_vs_padded = result["ratios"]["4 tables, an array each (padded) / 4 tables on one "
                                      "array, forward"]
    return {"report": report.name, "ms": result["ms"], "ratios": result["ratios"],
            "summary": f"skewed features padded / as keys, forward {keys_vs_padded:.2f}x"}


def part_compare(device: torch.device, sz: Dict[str, Any], out_dir: Path,
                 stem: str) -> Dict[str, Any]:
    from hydra import compose, initialize_config_dir

    import robe_torchrec.pipelines.compare as compare
    from robe_torchrec.hydra_configs import config_dir

    tag = f"{stem}_compare"
    overrides = [f"device={device.type}", "world_size=1", "rounds=1",
                 f"steps={sz['compare_steps']}", f"batch_size={sz['compare_batch']}",
                 f"cardinality_scale={sz['compare_scale']}",
                 f"tag={tag}", f"out_dir={out_dir}", "overwrite=true", "threads_per_rank=1"]
    with initialize_config_dir(config_dir=str(config_dir("pipeline_compare")), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    plotted = _has("matplotlib")
    if not plotted:  # not in the GPU image: the numbers matter, not the picture
        compare.plot = lambda *args, **kwargs: None
    compare.main(cfg)
    with open(out_dir / f"compare_{tag}.json") as f:
        report = json.load(f)
    rows = [{"pipeline": r["pipeline"], "p50_ms": r["p50_ms"], "p90_ms": r["p90_ms"],
             "p90_vs_sparse_dist": r["p90_vs_ref"] - 1.0,
             "torchrec_p90_vs_sparse_dist": TORCHREC_P90_VS_SPARSE_DIST.get(r["pipeline"]),
             **{k: r[k] for k in ("samples_per_s", "cuda_alloc_mib", "cuda_reserved_mib",
                                  "peak_rss_mib", "parity")}} for r in report["rows"]]
    return {"overrides": overrides, "report": f"compare_{tag}.md", "plotted": plotted, "rows": rows,
            "summary": f"{len(rows)} pipelines timed"}


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def part_app(device: torch.device, sz: Dict[str, Any], out_dir: Path, stem: str,
             app_device: Optional[str] = None) -> Dict[str, Any]:
    run_dir = (out_dir / f"{stem}_app").resolve()
    first, second = sz["app_steps"]
    common = [f"run.device={app_device or device.type}", f"run.batch_size={sz['app_batch']}",
              f"data.cardinality_scale={sz['app_scale']}", f"run.checkpoint_every={first // 2}",
              "run.progress_bar=false", f"run.log_every={first // 2}", "run.eval_batches=2",
              "run.test_batches=2", "run.threads=1", "pipeline=fused_sparse_dist"]
    group = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in group}  # the app makes its own
    env["ROBE_RECORD_FBGEMM_OPS"] = str(run_dir / "fbgemm_ops.json")
    runs = []
    for steps in (first, second):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_torchrec.app_with_shim",
                               *common, f"run.steps={steps}", f"hydra.run.dir={run_dir}"],
                              capture_output=True, text=True, timeout=240.0, env=env, cwd=ROOT)
        runs.append({"steps": steps, "rc": proc.returncode, "wall_s": round(time.time() - t0, 1),
                     "stderr_tail": proc.stderr[-3000:], "stdout_tail": proc.stdout[-1500:]})
        if proc.returncode != 0:
            raise RuntimeError(f"the app (run.steps={steps}) exited {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    resumed = f"at step {first}" in log and "resumed from checkpoint" in log
    trained_to_end = any(line.startswith("train,") and line.split(",")[1] == str(second)
                         for line in (run_dir / "metrics.csv").read_text().splitlines())
    ops_file = run_dir / "fbgemm_ops.json"
    if not (resumed and trained_to_end and checkpoints):
        raise AssertionError(f"app: resumed={resumed}, trained to step {second}={trained_to_end}, "
                             f"checkpoints={checkpoints}")
    return {"runs": runs, "checkpoints": checkpoints, "resumed": resumed,
            "trained_to_end": trained_to_end, "run_dir": run_dir.name, "overrides": common,
            "fbgemm_ops_called": json.loads(ops_file.read_text()) if ops_file.exists() else None,
            "summary": f"trained {first} steps with checkpoints {checkpoints}, resumed at step "
                       f"{first}, trained to {second}"}


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
    print(f"   {name}: {'ok' if result['ok'] else 'FAILED: ' + result.get('error', '')[:2000]} "
          f"({result['wall_s']} s) {result.get('summary', '')}", flush=True)
    return result


def markdown(env: Dict[str, Any], parts: Dict[str, Dict[str, Any]], command: str,
             wall_s: float) -> str:
    """The parts and the pipelines' verdicts; the overlap and the comparison's numbers are
    in the JSON (and the comparison's own report beside it)."""
    def cell(text: object) -> str:
        return str(text).replace("|", "/").replace("\n", " ")

    failed = [n for n, r in parts.items() if not r["ok"]]
    keys = ("mode", "torch", "cuda", "torchrec", "fbgemm_gpu", "triton", "python", "commit", "host")
    lines = [f"# Pipelines and DMP on {'a GPU' if env['card'] else 'CPU'}: "
             f"{env['card'] or 'CPU mode'}", "",
             f"Generated by `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}), "
             f"{wall_s:.0f} s; every number is in the `.json` beside this file.", "",
             "; ".join(f"{k} {env[k]}" for k in keys)
             + f"; FBGEMM CUDA shim: {env['shim'] or env['shim_error']}", "", "## Parts", "",
             *table(["part", "result", "time (s)"],
                    [[n, cell(r.get("summary", "") if r["ok"] else
                              "FAILED: " + r.get("error", "")[:300]), r["wall_s"]]
                     for n, r in parts.items()])]
    if parts.get("pipelines", {}).get("rows"):
        lines += ["", "## Pipelines against the unpipelined loop", "",
                  f"Bitwise when two plain runs are; otherwise losses within {LOSS_RTOL} "
                  f"relative. SemiSync: bitwise before `start_batch`, then within "
                  f"{SEMI_SYNC_ATOL} absolute.", "",
                  *table(["sharding", "pipeline", "ok", "verdict"],
                         [[r["sharding"], r["pipeline"], "yes" if r["ok"] else "NO",
                           cell(r["verdict"])] for r in parts["pipelines"]["rows"]])]
    lines += ["", "## Verdict", "", f"Failed: {', '.join(failed)}." if failed
              else "All parts passed.", ""]
    for n in failed:
        lines += [f"### {n}", "", "```", parts[n].get("traceback", parts[n].get("error", ""))
                  [-4000:], "```", ""]
    return "\n".join(lines)


def write_report(out: Path, env: Dict[str, Any], sizes_used: Dict[str, Any],
                 parts: Dict[str, Dict[str, Any]], command: str, wall_s: float,
                 left: Sequence[str] = ()) -> List[str]:
    """Write the report and its JSON for the parts done; ``left``: the parts not run yet
    (named in the report). Returns the failed parts."""
    failed = [n for n, r in parts.items() if not r["ok"]]
    text = markdown(env, parts, command, wall_s)
    if left:  # under the title, before a verdict that speaks of the parts done only
        title, rest = text.split("\n", 1)
        text = f"{title}\n\nINCOMPLETE: written before {', '.join(left)} had run.\n{rest}"
    out.write_text(text)
    with open(out.with_suffix(".json"), "w") as f:
        json.dump({"environment": env, "sizes": sizes_used, "wall_s": wall_s, "parts": parts,
                   "failed": failed, "not_run": list(left)}, f, indent=1, default=str)
    return failed


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_torchrec.run",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the markdown report; .json beside it")
    p.add_argument("--cpu", action="store_true", help="CPU tensors, gloo (CI)")
    p.add_argument("--commit", help="the commit, where the tree has no .git")
    p.add_argument("--only", nargs="*", choices=PARTS, help="run only these parts")
    p.add_argument("--app-device", help="the app's run.device (default: cuda, or cpu with --cpu)")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device (use --cpu for the CPU mode)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    out, sz = Path(args.out), sizes(args.cpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment(args.cpu, args.commit)
    print(json.dumps(env), flush=True)
    jobs = {"shim": lambda: part_shim(device, sz), "pipelines": lambda: part_pipelines(device, sz),
            "overlap": lambda: part_overlap(device, sz, out.parent, out.stem),
            "compare": lambda: part_compare(device, sz, out.parent, out.stem),
            "app": lambda: part_app(device, sz, out.parent, out.stem, args.app_device),
            "sequence": lambda: part_sequence(device, sz, out.parent, out.stem)}
    command = "python -m benchmarks.gpu_torchrec.run " + " ".join(argv or sys.argv[1:])
    start, parts = time.time(), {}
    chosen = [name for name in PARTS if not args.only or name in args.only]
    failed = write_report(out, env, sz, parts, command, 0.0, left=chosen)
    for i, name in enumerate(chosen):
        parts[name] = _guarded(name, jobs[name])
        # written after every part: a time limit that ends the run leaves the parts done
        failed = write_report(out, env, sz, parts, command, time.time() - start,
                              left=chosen[i + 1:])
    print(f"written: {out} (+ .json); "
          + (f"FAILED: {', '.join(failed)}" if failed else "all parts passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
