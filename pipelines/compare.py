"""Train the same DLRM under each pipeline and compare them (Hydra runner).

Per pipeline: P50 and P90 step time (first and last iterations dropped, nearest-rank
quantiles, as TorchRec's pipeline benchmark does; a step's time is the slowest rank's),
peak memory (CUDA allocated/reserved, or the process's peak RSS on CPU), samples/s, final
loss, and parity against SparseDist (bit-identical or how far). Printed as a table, written
as ``compare_<tag>.{md,json,png}`` with the machine's description into a fresh directory,
``outputs/compare/<date>/<time>-<pid>`` (Hydra's run directory, beside the run's log), or
into ``out_dir=...``, where an existing report of the same tag is kept unless
``overwrite=true``.

The model is :class:`robe_torchrec.dlrm.DLRMSpec` (the config's ``model``, via
``DLRMSpec.from_dict``), every table sharded as ``sharding`` (``robe_torchrec.pipelines.model``).

Every pipeline runs in fresh rank processes (so the peak RSS is its own) and, with
``rounds: N``, N times in alternating order, so a load change on a shared machine hits every
pipeline alike; the step times of all rounds are pooled.

Example::

    python -m robe_torchrec.pipelines.compare                              # CPU, 2 gloo ranks
    python -m robe_torchrec.pipelines.compare steps=20 rounds=1 batch_size=256 tag=quick
    python -m robe_torchrec.pipelines.compare device=cuda tag=gpu          # one rank per GPU, NCCL
    python -m robe_torchrec.pipelines.compare out_dir=pipelines/results overwrite=true   # the committed one
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

# Without a GPU, Triton kernels (imported with the ROBE ops) run in Triton's interpreter;
# it must be chosen before triton is imported, and the spawned ranks inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from robe_torchrec.pipelines.report import (  # noqa: E402
    machine, machine_line, nearest_rank, process_memory_mib, write_report)
from robe_torchrec.distributed.spawn import run_ranks  # noqa: E402 (imports triton)
from robe_torchrec.dlrm import DLRMSpec  # noqa: E402
from robe_torchrec.hydra_configs import config_dir  # noqa: E402

# the default run directory's last part: two runs started in the same second stay apart
OmegaConf.register_new_resolver("pid", os.getpid, replace=True)


# ---------------------------------------------------------------- statistics

def kept(step_times: Sequence[float]) -> List[float]:
    """Drop the first iteration (pipeline fill, first-touch allocations) and the last (drain)."""
    return list(step_times[1:-1]) if len(step_times) > 2 else list(step_times)


# ---------------------------------------------------------------- one rank

def _time_segment(pipeline) -> Optional[List[float]]:
    """FusedSparseDist only: time its "dense optimizer step + next batch's lookup" segment,
    the one its options reorder or overlap (the list fills as training runs)."""
    from robe_torchrec.pipelines import FusedSparseDistPipeline

    if not isinstance(pipeline, FusedSparseDistPipeline):
        return None
    return pipeline.time_segments()


def _rank_run(rank: int, world: int, cfg: Dict[str, Any], name: str,
              options: Dict[str, Any], want_init: bool) -> Optional[Dict[str, Any]]:
    from robe_torchrec.pipelines import make_pipeline
    from robe_torchrec.pipelines.model import build_sharded_dlrm, gather_state
    from robe_torchrec.data.synthetic import SyntheticCriteo

    device = torch.device(cfg["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    data = SyntheticCriteo(batch_size=int(cfg["batch_size"]),
                           cardinality_scale=float(cfg["cardinality_scale"]), seed=rank,
                           num_sparse=int(cfg["num_sparse"]))
    # generated up front so that the step time is the pipeline's, not the generator's
    batches = [data.batch(i) for i in range(int(cfg["steps"]))]
    rss_before = process_memory_mib("VmRSS")
    dmp, dense = build_sharded_dlrm(DLRMSpec.from_dict(cfg["model"]), data, cfg["sharding"],
                                    device, seed=int(cfg["seed"]))
    init = gather_state(dmp) if want_init else None
    pipeline = make_pipeline(name, dmp, dense, device, **options)
    segment = _time_segment(pipeline)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    it = iter(batches)
    times: List[float] = []
    losses: List[float] = []
    while True:
        start = time.perf_counter()
        try:
            loss, _logits, _labels = pipeline.progress(it)  # DLRMTrain output
        except StopIteration:
            break
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    # a step takes as long as its slowest rank; the loss is the global batch's mean
    t = torch.tensor(times, dtype=torch.float64)
    lo = torch.tensor(losses, dtype=torch.float64)
    cuda = device.type == "cuda"
    mem = torch.tensor([process_memory_mib("VmHWM"), rss_before,
                        torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0,
                        torch.cuda.max_memory_reserved(device) / 2**20 if cuda else 0.0],
                       dtype=torch.float64)
    if device.type == "cuda":
        t, lo, mem = t.to(device), lo.to(device), mem.to(device)
    seg = torch.tensor(segment or [0.0] * len(times), dtype=torch.float64)
    if device.type == "cuda":
        seg = seg.to(device)
    dist.all_reduce(seg, op=dist.ReduceOp.MAX)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    state = gather_state(dmp)
    if rank != 0:
        return None
    return {
        "step_s": t.cpu().tolist(),
        "segment_s": seg.cpu().tolist() if segment is not None else None,
        "loss": (lo.cpu() / world).tolist(),
        "peak_rss_mib": float(mem[0]), "rss_before_model_mib": float(mem[1]),
        "cuda_alloc_mib": float(mem[2]), "cuda_reserved_mib": float(mem[3]),
        # numpy: tensors sent between processes live in shared memory that dies with the rank
        "state": {k: v.cpu().numpy() for k, v in state.items()},
        "init": {k: v.cpu().numpy() for k, v in init.items()} if init is not None else None,
    }


# ---------------------------------------------------------------- the report

def _options(pipeline_cfg: DictConfig) -> Dict[str, Any]:
    options = pipeline_cfg.get("options")
    return OmegaConf.to_container(options, resolve=True) if options else {}


def _identical(state, ref) -> bool:
    return all(state[k].shape == ref[k].shape and (state[k] == ref[k]).all() for k in ref)


def _parity(state, ref, init) -> str:
    from robe_torchrec.pipelines.model import travel_diff  # as _rank_run, imported where used

    if _identical(state, ref):
        return "bit-identical"
    worst = max(float(abs(state[k].astype("float64") - ref[k]).max())
                for k in ref if ref[k].dtype.kind == "f")
    return f"differs: {travel_diff(state, ref, init):.2g} of travel, max abs {worst:.2g}"


def summarize(runs: Dict[str, List[Dict[str, Any]]], cfg: DictConfig) -> List[Dict[str, Any]]:
    world = int(cfg.world_size)
    global_batch = world * int(cfg.batch_size)
    ref_label = cfg.reference
    ref = runs[ref_label][0]
    init = next(r["init"] for rs in runs.values() for r in rs if r["init"] is not None)
    base_p90 = None
    rows = []
    for label, rs in runs.items():
        steps = [s for r in rs for s in kept(r["step_s"])]
        p50, p90 = nearest_rank(steps, 50), nearest_rank(steps, 90)
        if label == ref_label:
            base_p90 = p90
        # identical in every round (deterministic), else the run is not reproducible
        repeat_ok = all(_identical(r["state"], rs[0]["state"]) for r in rs[1:])
        tail = max(1, min(10, len(rs[0]["loss"]) // 5))
        rows.append({
            "pipeline": label, "name": cfg.pipelines[label].name,
            "options": _options(cfg.pipelines[label]),
            "p50_ms": 1e3 * p50, "p90_ms": 1e3 * p90,
            "p50_by_round_ms": [1e3 * nearest_rank(kept(r["step_s"]), 50) for r in rs],
            "opt_and_lookup_p50_ms": (
                1e3 * nearest_rank([x for r in rs for x in kept(r["segment_s"])], 50)
                if rs[0]["segment_s"] is not None else None),
            "load_by_round": [r["load_before"] for r in rs],
            "mean_ms": 1e3 * sum(steps) / len(steps),
            "samples_per_s": global_batch * len(steps) / sum(steps),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "rss_before_model_mib": max(r["rss_before_model_mib"] for r in rs),
            "cuda_alloc_mib": max(r["cuda_alloc_mib"] for r in rs),
            "cuda_reserved_mib": max(r["cuda_reserved_mib"] for r in rs),
            "final_loss": sum(rs[0]["loss"][-tail:]) / tail, "loss_tail_steps": tail,
            "first_loss": sum(rs[0]["loss"][:tail]) / tail,
            "parity": _parity(rs[0]["state"], ref["state"], init),
            "reproducible": repeat_ok, "kept_steps": len(steps),
            "step_ms": [1e3 * s for s in steps],  # the kept steps of every round
            "losses": rs[0]["loss"],
        })
    base_best = min(next(r for r in rows if r["pipeline"] == ref_label)["p50_by_round_ms"])
    for row in rows:
        row["p90_vs_ref"] = row["p90_ms"] / (1e3 * base_p90)
        # the least disturbed estimate on a shared machine: other jobs only ever add time
        row["best_round_p50_ms"] = min(row["p50_by_round_ms"])
        row["best_round_p50_vs_ref"] = row["best_round_p50_ms"] / base_best
    return rows


def table(rows: List[Dict[str, Any]], cuda: bool, ref_label: str) -> str:
    mem_head = "peak CUDA alloc / reserved (MiB)" if cuda else "peak RSS per rank (MiB)"
    lines = [f"| pipeline | P50 step (ms) | P90 step (ms) | P90 vs {ref_label} | samples/s | "
             f"{mem_head} | loss first→final | parity vs {ref_label} | P50 by round (ms) | "
             f"best-round P50 vs {ref_label} | opt + next lookup P50 (ms) |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|"]
    for r in rows:
        mem = (f"{r['cuda_alloc_mib']:.0f} / {r['cuda_reserved_mib']:.0f}" if cuda
               else f"{r['peak_rss_mib']:.0f}")
        lines.append(f"| {r['pipeline']} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} | "
                     f"{r['p90_vs_ref']:.3f}x | {r['samples_per_s']:.0f} | {mem} | "
                     f"{r['first_loss']:.4f}→{r['final_loss']:.4f} | {r['parity']} | "
                     + " / ".join(f"{x:.1f}" for x in r["p50_by_round_ms"])
                     + f" | {r['best_round_p50_vs_ref']:.3f}x | "
                     + ("–" if r["opt_and_lookup_p50_ms"] is None
                        else f"{r['opt_and_lookup_p50_ms']:.2f}") + " |")
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [r["pipeline"] for r in rows]
    x = range(len(rows))
    ax_t.bar([i - 0.2 for i in x], [r["p50_ms"] for r in rows], 0.4, label="P50")
    ax_t.bar([i + 0.2 for i in x], [r["p90_ms"] for r in rows], 0.4, label="P90")
    for i, r in enumerate(rows):
        pts = r["step_ms"]
        ax_t.scatter([i + 0.35] * len(pts), pts, s=4, color="black", alpha=0.3)
    ax_t.set_xticks(list(x))
    ax_t.set_xticklabels(labels, rotation=25, ha="right")
    ax_t.set_ylabel("step time (ms)")
    ax_t.set_title("step time (first and last steps dropped)")
    ax_t.legend()
    for r in rows:
        ax_l.plot(r["losses"], label=r["pipeline"], linewidth=1)
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("training loss (global batch)")
    ax_l.set_title("loss")
    ax_l.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REPORT_SUFFIXES = (".md", ".json", ".png")


def report_stem(out_dir: "str | os.PathLike", tag: str, overwrite: bool = False) -> Path:
    """``<out_dir>/compare_<tag>``, the report's path without suffix. Raises
    FileExistsError if a report of that tag is there already, unless ``overwrite``."""
    stem = Path(out_dir) / f"compare_{tag}"
    existing = [str(stem.with_suffix(s)) for s in REPORT_SUFFIXES
                if stem.with_suffix(s).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"a report of tag {tag!r} exists ({', '.join(existing)}); pick "
                              "another out_dir or tag, or set overwrite=true to replace it")
    return stem


def write_comparison(rows, cfg: DictConfig, stem: Path, info: Dict[str, Any], loads,
                     wall_s: float) -> Path:
    out_dir = stem.parent
    cuda = cfg.device == "cuda"
    tab = table(rows, cuda, cfg.reference)
    m = cfg.model
    kind = DLRMSpec.from_dict(OmegaConf.to_container(m, resolve=True)).kind
    title = (f"{kind} {cfg.sharding} DLRM, {cfg.world_size} ranks x batch {cfg.batch_size}, "
             f"{cfg.steps} steps x {cfg.rounds} rounds, {machine_line(info)}")
    md = [f"# Train pipelines compared ({cfg.tag})", "",
          "Generated by `python -m robe_torchrec.pipelines.compare` "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
          f"raw numbers in `{stem.name}.json`, plot in `{stem.name}.png`.", "",
          "## Machine", "",
          *[f"- {k}: {v}" for k, v in info.items()],
          f"- load average (1 min) before each run, in run order: "
          f"{', '.join(f'{l:.2f}' for l in loads)} (this comparison's own ranks add about "
          f"{cfg.world_size * cfg.threads_per_rank})",
          *([f"- note: {cfg.machine_note}"] if cfg.get("machine_note") else []),
          "", "## Setup", "",
          f"- model: {OmegaConf.to_container(m)}, every table {cfg.sharding}, seed {cfg.seed}",
          f"- data: SyntheticCriteo, {cfg.num_sparse} sparse features, cardinality scale "
          f"{cfg.cardinality_scale}, local batch {cfg.batch_size}, {cfg.world_size} ranks "
          f"({'NCCL' if cuda else 'gloo'}), {cfg.threads_per_rank} intra-op thread(s) per rank",
          f"- {cfg.steps} steps per run, {cfg.rounds} round(s) in alternating order, each run "
          "in fresh processes; step time = slowest rank's `progress()`; first and last step "
          "of every run dropped; nearest-rank P50/P90 over the pooled steps; samples/s from "
          "the mean kept step; loss = global-batch mean, first and final = mean of "
          f"{rows[0]['loss_tail_steps']} steps",
          "- opt + next lookup: FusedSparseDist only, the segment its options reorder or overlap "
          "(dense optimizer step and the next batch's lookup), timed inside `progress()`",
          "- P50 by round: one value per run, so load from other jobs shows up as an outlier "
          "round; best-round P50 (the minimum) is the least disturbed estimate",
          "- parity: the final weights against the reference pipeline's (same seed, same "
          "batches); 'of travel' = ||w - w_ref|| / ||w_ref - w_init||",
          f"- wall time of the whole comparison: {wall_s:.0f} s",
          "", "## Results", "", tab, ""]
    write_report(out_dir, stem.name, {"config": OmegaConf.to_container(cfg, resolve=True),
                                      "machine": info, "load_average": loads, "wall_s": wall_s,
                                      "rows": rows}, "\n".join(md))
    plot(rows, stem.with_suffix(".png"), title)
    return stem.with_suffix(".md")


def _out_dir(cfg: DictConfig) -> Path:
    """``out_dir`` (relative: to the working directory), or this run's fresh directory."""
    if cfg.out_dir is not None:
        return Path(cfg.out_dir)
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


@hydra.main(config_path=str(config_dir("pipeline_compare")), config_name="config",
            version_base="1.3")
def main(cfg: DictConfig) -> None:
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    labels = [k for k, v in cfg.pipelines.items() if v is not None]  # null: left out
    if cfg.reference not in labels:
        raise ValueError(f"reference {cfg.reference!r} is not among the pipelines {labels}")
    # a bad model or an existing report fails now, not after the runs
    DLRMSpec.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    stem = report_stem(_out_dir(cfg), cfg.tag, cfg.overwrite)
    plain_cfg = OmegaConf.to_container(cfg, resolve=True)
    runs: Dict[str, List[Dict[str, Any]]] = {label: [] for label in labels}
    loads: List[float] = []
    start = time.time()
    for rnd in range(int(cfg.rounds)):
        order = labels if rnd % 2 == 0 else labels[::-1]
        for label in order:
            p = cfg.pipelines[label]
            options = _options(p)
            loads.append(os.getloadavg()[0])
            t0 = time.time()
            res = run_ranks(_rank_run, int(cfg.world_size), plain_cfg, p.name, options,
                            label == cfg.reference and rnd == 0, backend=backend,
                            threads=int(cfg.threads_per_rank), timeout=600.0)[0]
            res["load_before"] = loads[-1]
            runs[label].append(res)
            steps = kept(res["step_s"])
            print(f"round {rnd} {label:32s} P50 {1e3 * nearest_rank(steps, 50):8.1f} ms  "
                  f"({time.time() - t0:.0f} s)", flush=True)
    wall = time.time() - start
    rows = summarize(runs, cfg)
    print(table(rows, cfg.device == "cuda", cfg.reference))
    path = write_comparison(rows, cfg, stem, machine(), loads, wall)
    print(f"written: {path} (+ .json, .png)")


if __name__ == "__main__":
    main()
