"""The training run, top to bottom: build, resume, train (with periodic validation and
checkpoints), validate, test.

Training advances in segments that end at every validation / checkpoint step: each segment
gives the pipeline a fresh iterator of exactly its batches and runs it dry, so at a segment
end no batch is in flight, the model holds exactly ``step`` updates and a checkpoint taken
there resumes bitwise (a resumed run re-enters the same segments).

Example::

    >>> results = train(cfg, run_dir="outputs/x")   # inside a process group; see app.py
    >>> results["test_auc"]
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Dict, Iterator, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from pipelines import SemiSyncPipeline, run_to_end
from robe_torchrec.train.checkpoint import Checkpointer
from robe_torchrec.train.config import ConfigError, validate
from robe_torchrec.train.data import build_data
from robe_torchrec.train.metrics import MetricsCsv, PhaseMetrics
from robe_torchrec.train.model import build_model, build_optimizer, shard
from robe_torchrec.train.pipeline import make_pipeline

log = logging.getLogger("robe_torchrec.train")


def _quiet_planner(record: logging.LogRecord) -> bool:
    # the planner warns (on the root logger) for every data-parallel table, which has no
    # sharding spec by design
    return not str(record.msg).startswith("Sharding spec not found")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                            else "cpu")
    return torch.device(name)


def _resume_path(ckpt: Checkpointer, mode) -> Optional[Path]:
    mode = str(mode).lower()
    if mode == "false":
        return None
    path = ckpt.latest()
    if path is None and mode == "true":
        raise ConfigError(f"run.resume=true but there is no checkpoint in {ckpt.dir}")
    return path


def _maybe_fail(cfg: DictConfig, step: int, rank: int) -> None:
    """The fault test's deliberate crash (first attempt only)."""
    f = cfg.fault
    if f.kill_rank == rank and f.kill_at_step == step \
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        log.error("fault injection: rank %d exits at step %d", rank, step)
        logging.shutdown()
        os._exit(1)


def evaluate(pipeline, dmp, batches: Iterator) -> Dict[str, float]:
    """AUC and log loss over ``batches`` (all ranks together)."""
    metrics = PhaseMetrics()
    dmp.eval()
    with torch.no_grad():
        run_to_end(pipeline, batches, lambda out: metrics.update(out[1], out[2]))
    dmp.train()
    return metrics.compute()


def train(cfg: DictConfig, run_dir: "str | os.PathLike") -> Dict[str, float]:
    """Run the config's training job in ``run_dir`` (every rank calls it); returns the final
    validation and test metrics and the training throughput."""
    validate(cfg)
    # TorchRec logs several warnings per table while sharding; keep the run's log readable
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger().addFilter(_quiet_planner)
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    device = _device(cfg.run.device)
    run, main = cfg.run, rank == 0
    say = log.info if main else log.debug

    # same seed everywhere: each rank's shards start from the same unsharded weights
    torch.manual_seed(run.seed)
    data = build_data(cfg, rank, world)
    model, summary = build_model(cfg, data.keys, data.cardinalities, device)
    dmp = shard(model, cfg, device)
    # the pipeline steps the dense optimizer; checkpoints hold both (fused one included)
    dense_optimizer, optimizer = build_optimizer(cfg, dmp)
    options = OmegaConf.to_container(cfg.pipeline.options) if cfg.pipeline.options else {}
    pipeline = make_pipeline(cfg.pipeline.name, dmp, dense_optimizer, device, **options)
    log.debug("config:\n%s", OmegaConf.to_yaml(cfg))  # also saved in <run dir>/.hydra
    say("%s", summary)
    say("model: %s, %d rank(s) on %s, pipeline %s, global batch %d, run dir %s",
        cfg.model.name, world, device, cfg.pipeline.name, run.batch_size * world, run_dir)

    if isinstance(pipeline, SemiSyncPipeline) and options.get("stash_gradients") and \
            run.checkpoint_every:
        log.warning("pipeline=semi_sync with stash_gradients: a checkpoint does not hold the "
                    "stashed dense gradient, so a resumed run skips that one dense update "
                    "(resume is not bitwise exact)")
    ckpt = Checkpointer(run_dir / "checkpoints", keep=run.keep_checkpoints)
    step = 0
    resume_from = _resume_path(ckpt, run.resume)
    if resume_from is not None:
        step = ckpt.load(resume_from, dmp, optimizer)
        if isinstance(pipeline, SemiSyncPipeline):
            # its start_batch counts batches: continue the count of the run we resume
            pipeline.set_next_batch_index(step)
        say("resumed from checkpoint %s at step %d", resume_from, step)
    csv = MetricsCsv(run_dir / "metrics.csv", enabled=main)

    # train: segments end at validation / checkpoint steps (see module docstring)
    window = PhaseMetrics()
    bar = tqdm(total=run.steps, initial=step, disable=not (main and run.progress_bar),
               desc="train", unit="step", dynamic_ncols=True)
    window_start, window_steps = time.perf_counter(), 0
    trained_time, trained_steps, first_window = 0.0, 0, True
    dmp.train()

    def on_step(output) -> None:
        nonlocal step, window_start, window_steps, trained_time, trained_steps, first_window
        _loss, logits, labels = output
        step += 1
        window_steps += 1
        window.update(logits, labels)
        bar.update(1)
        _maybe_fail(cfg, step, rank)
        if (run.log_every and step % run.log_every == 0) or step == run.steps:
            elapsed = time.perf_counter() - window_start
            rate = window_steps * run.batch_size * world / elapsed
            m = window.compute()
            if not first_window:  # the first window pays for warm-up
                trained_time += elapsed
                trained_steps += window_steps
            first_window = False
            bar.set_postfix(loss=f"{m['log_loss']:.4f}", auc=f"{m['auc']:.4f}",
                            rate=f"{rate:,.0f}/s")
            say("step %d  train log loss %.4f  AUC %.4f  %.0f samples/s", step, m["log_loss"],
                m["auc"], rate)
            csv.write("train", step, m["samples"], m["auc"], m["log_loss"], rate, elapsed)
            window.reset()
            window_start, window_steps = time.perf_counter(), 0

    with logging_redirect_tqdm():  # log lines print above the progress bar, not through it
        while step < run.steps:
            ends = [run.steps]
            for every in (run.eval_every, run.checkpoint_every):
                if every:
                    ends.append((step // every + 1) * every)
            end = min(ends)
            run_to_end(pipeline, data.train_batches(step, end - step), on_step)
            if step != end:
                raise RuntimeError(f"the data ran out at step {step} (expected {end})")
            if run.checkpoint_every and (step % run.checkpoint_every == 0 or step == run.steps):
                path = ckpt.save(step, dmp, optimizer)
                say("checkpoint %s", path)
            val = (data.eval_batches("val", run.eval_batches)
                   if run.eval_batches and run.eval_every and step % run.eval_every == 0
                   and step < run.steps else None)
            if val is not None:  # a file source without a val split gives None
                t = time.perf_counter()
                m = evaluate(pipeline, dmp, val)
                say("step %d  validation log loss %.4f  AUC %.4f", step, m["log_loss"], m["auc"])
                csv.write("val", step, m["samples"], m["auc"], m["log_loss"],
                          elapsed_s=time.perf_counter() - t)
                window_start = time.perf_counter()  # keep evaluation out of the training rate
    bar.close()

    results: Dict[str, float] = {"step": step, "stored_floats": summary.stored_floats,
                                 "compression": summary.compression_ratio}
    if trained_steps:
        results["train_samples_per_s"] = trained_steps * run.batch_size * world / trained_time
    for split, count in (("val", run.eval_batches), ("test", run.test_batches)):
        batches = data.eval_batches(split, count) if count else None
        if batches is not None:
            m = evaluate(pipeline, dmp, batches)
            say("%s log loss %.4f  AUC %.4f  (%d samples)", split, m["log_loss"], m["auc"],
                m["samples"])
            csv.write(split, step, m["samples"], m["auc"], m["log_loss"])
            results[f"{split}_auc"], results[f"{split}_log_loss"] = m["auc"], m["log_loss"]
    if "train_samples_per_s" in results:
        say("training throughput %.0f samples/s (after the first log window)",
            results["train_samples_per_s"])
    return results
