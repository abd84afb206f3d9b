"""The training run: :func:`train` is the recipe, :func:`evaluate` scores a checkpoint
(``run.mode=eval``), :class:`Trainer` holds their steps.

Training advances in segments that end at every validation / checkpoint step: each segment
gives the pipeline a fresh iterator of exactly its batches and runs it dry, so at a segment
end no batch is in flight, the model holds exactly ``step`` updates and a checkpoint taken
there resumes bitwise (a resumed run re-enters the same segments).

Example::

    >>> results = train(cfg, run_dir="outputs/x")   # inside a process group; see app.py
    >>> results["test_auc"]
    >>> run(cfg, run_dir="outputs/y")               # train or evaluate, as run.mode says
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from robe_torchrec.pipelines import SemiSyncPipeline, run_to_end
from robe_torchrec.export import export_model
from robe_torchrec.ops import raise_pending_checks
from robe_torchrec.threads import choose_threads
from robe_torchrec.train.checkpoint import (CheckpointError, CheckpointException, Checkpointer,
                                            load_unsharded, on_rank0, read_manifest)
from robe_torchrec.train.config import ConfigError, validate
from robe_torchrec.train.guard import NonFiniteGuard
from robe_torchrec.train.preempt import CollectiveTimeout, Stopped, StopSignals, who_is_missing
from robe_torchrec.train.resume import compare, fingerprint, refusal
from robe_torchrec.train.rundir import RunLock
from robe_torchrec.train.data import build_data
from robe_torchrec.train.metrics import MetricsCsv, PhaseMetrics
from robe_torchrec.train.model import build_model, build_optimizer, build_predict_model, shard
from robe_torchrec.train.pipeline import make_pipeline

log = logging.getLogger("robe_torchrec.train")


class NonFiniteError(RuntimeError):
    """Training met inf / NaN (the message names the step and the tensors); no checkpoint
    was written from that state."""


@contextmanager
def _named_timeouts(trainer: "Trainer") -> Iterator[None]:
    """A collective that outlived ``run.collective_timeout`` becomes a
    :class:`CollectiveTimeout` naming the ranks that did not answer."""
    try:
        yield
    except RuntimeError as e:
        if trainer.world == 1 or "Timed out" not in str(e) or isinstance(e, CollectiveTimeout):
            raise
        raise trainer.timeout_error(e) from e


def run(cfg: DictConfig, run_dir: "str | os.PathLike") -> Dict[str, float]:
    """The config's job, as ``run.mode`` says: :func:`train` or :func:`evaluate`."""
    validate(cfg)
    return evaluate(cfg, run_dir) if cfg.run.get("mode") == "eval" else train(cfg, run_dir)


def train(cfg: DictConfig, run_dir: "str | os.PathLike") -> Dict[str, float]:
    """Run the config's training job in ``run_dir`` (every rank calls it); returns the final
    validation and test metrics and the training throughput."""
    validate(cfg)
    trainer = Trainer(cfg, run_dir)
    try:
        with _named_timeouts(trainer):
            trainer.build()
            trainer.resume()
            with trainer.training():
                while not trainer.done:
                    trainer.run_segment()
                    stopping = trainer.stop_requested()
                    if not trainer.healthy(scan=stopping):  # rolled back to the last good one
                        continue
                    if stopping:
                        trainer.stop()  # raises Stopped once the step reached is saved
                    trainer.checkpoint()
                    trainer.evaluate()
            results = trainer.finish()
            trainer.export()
    finally:
        trainer.close()
    return results


def evaluate(cfg: DictConfig, run_dir: "str | os.PathLike") -> Dict[str, float]:
    """``run.mode=eval``: load the model of ``run.checkpoint`` (written on any world size)
    and score it on the validation and test batches, training nothing; returns the metrics
    as :func:`train` does. Every rank calls it; one process is enough."""
    validate(cfg)
    trainer = Trainer(cfg, run_dir)
    try:
        with _named_timeouts(trainer):
            trainer.build()
            trainer.load_weights(cfg.run.checkpoint)
            results = trainer.finish()
            trainer.export()
    finally:
        trainer.close()
    return results


class Trainer:
    """One run's model, pipeline, checkpoints and metrics; every method is collective (call
    it on every rank). :func:`train` calls them in order.

    Example::

        >>> trainer = Trainer(cfg, "outputs/x")
        >>> trainer.build()
        >>> trainer.resume()
        >>> with trainer.training():
        ...     trainer.run_segment()      # up to the first validation / checkpoint step
        ...     trainer.healthy()          # inf/NaN: raises, or rolls back and says False
        >>> trainer.step, trainer.metrics(trainer.data.eval_batches("val", 8))
        >>> trainer.close()                # releases the run directory's lock
    """

    def __init__(self, cfg: DictConfig, run_dir: "str | os.PathLike") -> None:
        self.cfg, self.run = cfg, cfg.run
        self.run_dir = Path(run_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.main = self.rank == 0
        self.say = log.info if self.main else log.debug
        self.collective_timeout = float(self.run.get("collective_timeout", 1800))
        self.step = 0
        self.csv = MetricsCsv(self.run_dir / "metrics.csv", enabled=self.main,
                              tensorboard=self.run_dir / "tensorboard"
                              if self.run.get("tensorboard", False) else None)
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", keep=self.run.keep_checkpoints)
        self.window = _Window()
        self.bar: Optional[tqdm] = None
        self.lock = RunLock(self.run_dir)
        self.guard = NonFiniteGuard()
        self.rollbacks = 0
        # (step, learning rates) of each rollback: one that would repeat another is futile
        self.rolled_back_to: List[Tuple[int, Tuple[float, ...]]] = []
        self.start_lrs: List[float] = []
        self.fingerprint = fingerprint(cfg, self.world)
        self.allow_unverified = bool(self.run.get("allow_unverified", False))
        self.signals: Optional[StopSignals] = None

    def close(self) -> None:
        """Release the run directory (every rank; rank 0 holds its lock)."""
        self.csv.close()
        self.lock.release()

    @property
    def done(self) -> bool:
        return self.step >= self.run.steps

    # ------------------------------------------------------------------ set-up

    def build(self) -> None:
        """Data, model, sharding, optimizers and pipeline."""
        cfg, run = self.cfg, self.run
        # TorchRec logs several warnings per table while sharding; keep the run's log readable
        # (the known noise is already filtered by robe_torchrec.install(); this also drops
        # the rest of TorchRec's warnings, which user scripts keep)
        logging.getLogger("torchrec").setLevel(logging.ERROR)
        # one run per directory; taking the lock also shows the directory is writable
        on_rank0(self.lock.acquire)
        if self.world > 1:
            # a stopped or hung peer ends the run after this long instead of blocking it
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.collective_timeout))
        self.signals = StopSignals(self.world, timedelta(seconds=self.collective_timeout))
        threads = choose_threads(run.threads)
        torch.set_num_threads(threads.threads)
        self.say("threads: %s", threads)
        device = _device(run.device)
        # same seed everywhere: each rank's shards start from the same unsharded weights
        torch.manual_seed(run.seed)
        self.data = build_data(cfg, self.rank, self.world)
        model, self.summary = build_model(cfg, self.data.keys, self.data.cardinalities, device)
        self.dmp = shard(model, cfg, device)
        # the pipeline steps the dense optimizer; checkpoints hold both (fused one included)
        dense_optimizer, self.optimizer = build_optimizer(cfg, self.dmp)
        options = OmegaConf.to_container(cfg.pipeline.options) if cfg.pipeline.options else {}
        self.pipeline = make_pipeline(cfg.pipeline.name, self.dmp, dense_optimizer, device,
                                      **options)
        log.debug("config:\n%s", OmegaConf.to_yaml(cfg))  # also saved in <run dir>/.hydra
        self.say("%s", self.summary)
        self.say("model: %s, %d rank(s) on %s, pipeline %s, global batch %d, run dir %s",
                 cfg.model.name, self.world, device, cfg.pipeline.name,
                 run.batch_size * self.world, self.run_dir)
        if isinstance(self.pipeline, SemiSyncPipeline) and options.get("stash_gradients") \
                and run.checkpoint_every:
            log.warning("pipeline=semi_sync with stash_gradients: a checkpoint does not hold "
                        "the stashed dense gradient, so a resumed run skips that one dense "
                        "update (resume is not bitwise exact)")

    def resume(self) -> None:
        """Continue from the run directory's last good checkpoint, as ``run.resume`` says;
        a new run gets a new run id."""
        mode = str(self.run.resume).lower()
        removed = on_rank0(self.ckpt.tidy)
        if removed:
            self.say("removed %s in %s: left by a run stopped during a save",
                     ", ".join(removed), self.ckpt.dir)
        found = self.ckpt.candidates()
        # unusable checkpoints set aside are history too: a run never starts over on them
        history = [Path(p) for p in on_rank0(lambda: [str(p) for p in self.ckpt.history()])]
        if mode == "false" and (found or history):
            self.set_aside(found + history)
            found, history = [], []
        if found and self.load_good(found):
            self.say("resumed from checkpoint %s at step %d (run %s)", self.resumed_from,
                     self.step, self.ckpt.run_id)
        elif mode == "true":
            raise ConfigError(f"run.resume=true but there is no checkpoint in "
                              f"{self.ckpt.dir}")
        elif history:
            raise CheckpointError(
                f"{self.ckpt.dir} holds only unusable checkpoints of an earlier run ("
                + "; ".join(f"{p.name}: {_why(p)}" for p in history) + "): this run would "
                "start over from step 0. To start over on purpose, set run.resume=false "
                "run.existing_checkpoints=move (the checkpoints and metrics.csv are renamed "
                "aside), or use another run dir")
        else:
            self.ckpt.run_id = on_rank0(lambda: uuid.uuid4().hex[:12])
            self.say("new run %s", self.ckpt.run_id)
        self.start_lrs = [g["lr"] for g in self.optimizer.param_groups]
        dropped = on_rank0(lambda: self.csv.rewind(self.step))
        if dropped:
            log.warning("metrics.csv: moved %d row(s) past step %d (written after the "
                        "checkpoint this run starts from) to %s", dropped, self.step,
                        self.csv.dropped_path)

    def set_aside(self, found: List[Path]) -> None:
        """``run.resume=false`` in a directory holding checkpoints: refuse, or with
        ``run.existing_checkpoints=move`` rename them (and metrics.csv) aside."""
        if self.run.get("existing_checkpoints", "refuse") != "move":
            raise ConfigError(
                f"run.resume=false but {self.ckpt.dir} holds checkpoints "
                f"({', '.join(p.name for p in found)}) of an earlier run: use another run dir, "
                f"resume it (run.resume=auto), or move them aside with "
                f"run.existing_checkpoints=move")

        def move() -> Path:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            target = self.ckpt.dir.with_name(f"{self.ckpt.dir.name}.old-{stamp}")
            self.ckpt.dir.rename(target)
            for path in (self.csv.path, self.csv.dropped_path):
                if path.exists():
                    path.rename(path.with_name(f"{path.stem}.old-{stamp}.csv"))
            return target

        target = on_rank0(move)
        log.warning("run.resume=false: moved the earlier run's checkpoints %s to %s",
                    ", ".join(p.name for p in found), target)

    def load_good(self, found: List[Path], overrides: bool = True) -> bool:
        """Load the newest of ``found`` that verifies, loads and holds finite values,
        skipping (and renaming to ``step_N.bad``) each that does not, with a warning;
        False when ``found`` is empty. A config mismatch is refused, not skipped.
        ``overrides``: apply the config's learning rates where they changed."""
        skipped = []
        for path in found:
            problem = self.ckpt.verify(path, self.allow_unverified)
            manifest = None if problem else on_rank0(lambda: read_manifest(path))
            if manifest is not None:
                self.check_compatible(path, manifest)
            if problem is None:
                try:
                    step = self.ckpt.load(path, self.dmp, self.optimizer)
                except (Exception, CheckpointException) as e:  # DCP: BaseException
                    problem = f"cannot be read: {_last_line(e)}"
            if problem is None:
                problem = self.guard.check(self.dmp, self.optimizer, tensors=True)
            if problem is not None:
                log.warning("checkpoint %s is unusable (%s): trying the one before", path,
                            problem)
                skipped.append(f"{path.name}: {problem}")
                self.ckpt.quarantine(path, problem)
                continue
            self.step, self.resumed_from = step, path
            self.ckpt.run_id = (manifest or {}).get("run_id") or self.ckpt.run_id \
                or on_rank0(lambda: uuid.uuid4().hex[:12])
            if manifest is not None and overrides:
                self.apply_overrides(compare(manifest.get("config", {}), self.fingerprint))
            if isinstance(self.pipeline, SemiSyncPipeline):
                # its start_batch counts batches: continue the count of the run we resume
                self.pipeline.set_next_batch_index(self.step)
            return True
        if skipped:
            raise CheckpointError(f"no usable checkpoint in {self.ckpt.dir}: "
                                  + "; ".join(skipped))
        return False

    def check_compatible(self, path: Path, manifest: Dict) -> None:
        """Refuse a checkpoint made with another resume-relevant config or past run.steps."""
        saved = manifest.get("config")
        if saved is not None:
            refused = compare(saved, self.fingerprint).refused
            if refused:
                raise refusal(str(path), refused)
        step = int(manifest.get("step", 0))
        if step > self.run.steps:
            raise ConfigError(
                f"checkpoint {path} is at step {step}, past run.steps={self.run.steps}: "
                f"resuming would report that model as this run's result. Raise run.steps to "
                f"train on, or score it with run.mode=eval run.checkpoint={path}")

    def apply_overrides(self, changes) -> None:
        """Apply the learning rates of the config where they differ from the checkpoint's
        config (the param groups hold the checkpoint's); logged."""
        parts = dict(self.optimizer.optimizers)
        for key, (then, now) in changes.allowed.items():
            part = parts["dense" if key == "optimizer.dense_lr" else "embedding"]
            for group in part.param_groups:
                group["lr"] = now
            log.warning("resume: %s changed from %s (checkpoint) to %s: applied", key, then, now)
        if changes.allowed:
            parts["embedding"].zero_grad()  # FBGEMM's fused optimizer picks up lr there

    def set_lrs(self, lrs: List[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        dict(self.optimizer.optimizers)["embedding"].zero_grad()  # FBGEMM reads it there

    def load_weights(self, path: "str | os.PathLike") -> None:
        """The model of checkpoint ``path`` (no optimizer state: nothing is trained), after
        its checksums; refuses a damaged checkpoint or one holding inf/NaN."""
        problem = self.ckpt.verify(path, self.allow_unverified)
        if problem is None:
            self.step = self.ckpt.load_model(path, self.dmp)
            problem = self.guard.check(self.dmp, self.optimizer, tensors=True)
        if problem is not None:
            raise CheckpointError(f"run.checkpoint={path} is unusable: {problem}")
        self.say("loaded the model of checkpoint %s (step %d)", path, self.step)

    @contextmanager
    def training(self) -> Iterator[None]:
        """The training phase: the model in train mode, a progress bar (rank 0) with the
        log lines printed above it."""
        self.bar = tqdm(total=self.run.steps, initial=self.step,
                        disable=not (self.main and self.run.progress_bar), desc="train",
                        unit="step", dynamic_ncols=True)
        self.window.restart()
        self.dmp.train()
        self.signals.install()
        try:
            with logging_redirect_tqdm():
                yield
        finally:
            self.signals.uninstall()
            self.bar.close()

    # ------------------------------------------------------------------ training

    def run_segment(self) -> None:
        """Train up to the next validation / checkpoint step (or the last step)."""
        run = self.run
        ends = [run.steps] + [(self.step // every + 1) * every
                              for every in (run.eval_every, run.checkpoint_every,
                                            run.get("check_every", 0)) if every]
        end = min(ends)
        # on a stop signal every rank stops taking batches at the same one; the pipeline
        # then trains those in flight, so each rank ends on the same finished step
        batches = self.signals.until_stopped(self.data.train_batches(self.step,
                                                                     end - self.step))
        run_to_end(self.pipeline, batches, self.on_step)
        # the GPU ops check their input after returning (deferred checks); every batch of
        # the segment has passed before a checkpoint holds its updates or a metric its loss
        raise_pending_checks()
        if self.step != end and not self.signals.agreed:
            raise RuntimeError(f"the data ran out at step {self.step} (expected {end})")

    def on_step(self, output) -> None:
        """Called by the pipeline with each step's ``(loss, logits, labels)``."""
        loss, logits, labels = output
        self.step += 1
        self.guard.observe_loss(loss, self.step)
        self.window.update(logits, labels)
        self.bar.update(1)
        if (self.run.log_every and self.step % self.run.log_every == 0) \
                or self.step == self.run.steps:
            self.log_window()

    def log_window(self) -> None:
        """Log and record the training metrics of the steps since the last log line."""
        elapsed, steps, m = self.window.close()
        rate = steps * self.run.batch_size * self.world / elapsed
        self.bar.set_postfix(loss=f"{m['log_loss']:.4f}", auc=f"{m['auc']:.4f}",
                             rate=f"{rate:,.0f}/s")
        self.say("step %d  train log loss %.4f  AUC %.4f  %.0f samples/s", self.step,
                 m["log_loss"], m["auc"], rate)
        self.csv.write("train", self.step, m["samples"], m["auc"], m["log_loss"], rate, elapsed)
        self.window.restart()

    def checkpoint_due(self) -> bool:
        """Whether this step is a checkpoint step, or the last step (always with
        ``run.export``: the export reads the final weights from it)."""
        every = self.run.checkpoint_every
        return bool((every and self.step % every == 0)
                    or (self.done and (every or self.run.get("export"))))

    def checkpoint(self) -> None:
        """Save a checkpoint if :meth:`checkpoint_due`."""
        if self.checkpoint_due():
            path = self.ckpt.save(self.step, self.dmp, self.optimizer,
                                  meta={"config": self.fingerprint})
            self.say("checkpoint %s", path)

    def stop_requested(self) -> bool:
        """Whether any rank got a stop signal (SIGTERM, SIGUSR1) by now (collective: the
        same answer on every rank)."""
        return bool(self.signals.settle())

    def stop(self) -> None:
        """After a stop signal, at a segment end: a checkpoint of the step reached (unless
        there is one), a log line, and :class:`Stopped` (the process exits 128 + signal)."""
        name = signal.Signals(self.signals.agreed).name
        path = self.ckpt.dir / f"step_{self.step}"
        if path not in self.ckpt.candidates():
            path = self.ckpt.save(self.step, self.dmp, self.optimizer,
                                  meta={"config": self.fingerprint})
        if self.main:
            log.warning("stopped by %s at step %d, checkpoint %s", name, self.step, path.name)
        raise Stopped(self.signals.agreed, self.step, path)

    def timeout_error(self, exc: BaseException) -> CollectiveTimeout:
        """What a collective that timed out on this rank means: which ranks did not
        answer, asked through the process group's store."""
        missing = who_is_missing(self.rank, self.world, self.step)
        if missing is None:
            who = ("the process group's store did not answer either: rank 0 (which holds it "
                   "outside torchrun) is stopped, hung or gone")
        elif missing:
            who = (f"rank(s) {', '.join(map(str, missing))} did not answer (stopped, hung, or "
                   f"on a lost host)")
        else:
            who = "every rank answered, so they waited in different collectives"
        return CollectiveTimeout(
            f"rank {self.rank}: a collective waited more than run.collective_timeout="
            f"{self.collective_timeout:g}s at step {self.step}; {who}. The run stops; start it "
            f"again to resume from its last checkpoint ({_last_line(exc)})")

    def healthy(self, scan: bool = False) -> bool:
        """At a segment end: True if the losses so far were finite (and the parameters and
        optimizer state, scanned every ``run.check_every`` steps and before a checkpoint).
        Otherwise, as ``run.on_nonfinite`` says: raise :class:`NonFiniteError` (``stop``),
        or go back to the last good checkpoint with the learning rates scaled by
        ``run.rollback_lr_scale`` and return False (``rollback``, at most
        ``run.max_rollbacks`` times)."""
        every = self.run.get("check_every", 0)
        scan = scan or self.checkpoint_due() or bool(every and self.step % every == 0)
        problem = self.guard.check(self.dmp, self.optimizer, tensors=scan)
        if problem is None:
            return True
        what = f"non-finite values at step {self.step}: {problem}"
        good = self.ckpt.candidates()
        if self.run.get("on_nonfinite", "stop") != "rollback":
            raise NonFiniteError(
                f"{what}. Training stopped; no checkpoint was written from this state (last "
                f"good checkpoint: {good[0] if good else 'none'}). Lower the learning rates "
                f"(optimizer.dense_lr / optimizer.embedding_lr), or set "
                f"run.on_nonfinite=rollback")
        limit = self.run.get("max_rollbacks", 3)
        if self.rollbacks >= limit:
            raise NonFiniteError(f"{what}. Training stopped: {self.rollbacks} rollback(s) done "
                                 f"already (run.max_rollbacks={limit})")
        if not good:
            raise NonFiniteError(f"{what}. Training stopped: there is no checkpoint to roll "
                                 f"back to (set run.checkpoint_every)")
        self.guard.reset()
        self.load_good(good, overrides=False)
        self.rollbacks += 1
        # compounded from the learning rates this process started with: the k-th rollback
        # trains at scale^k of them, never again at those of an earlier try
        factor = self.run.get("rollback_lr_scale", 0.5) ** self.rollbacks
        lrs = [lr * factor for lr in self.start_lrs]
        attempt = (self.step, tuple(lrs))
        if attempt in self.rolled_back_to:
            earlier = self.rolled_back_to.index(attempt) + 1
            raise NonFiniteError(
                f"{what}. Training stopped: rollback {self.rollbacks} would repeat rollback "
                f"{earlier} exactly (checkpoint {self.resumed_from.name}, the same batches, "
                f"learning rates {', '.join(f'{lr:g}' for lr in lrs)}) and meet the same "
                f"values. Lower the learning rates in the config, or look at the data past "
                f"step {self.step}")
        self.rolled_back_to.append(attempt)
        self.set_lrs(lrs)
        on_rank0(lambda: self.csv.rewind(self.step))
        log.warning("%s: rolled back to checkpoint %s (step %d) with the learning rates x %g "
                    "(now %s; rollback %d of at most %d)", what, self.resumed_from, self.step,
                    factor, ", ".join(f"{lr:g}" for lr in lrs), self.rollbacks, limit)
        self.bar.n = self.step
        self.bar.refresh()
        self.window.discard()
        return False

    def evaluate(self) -> None:
        """Validate if this step is a validation step before the last (which
        :meth:`finish` validates)."""
        run = self.run
        if not (run.eval_batches and run.eval_every and self.step % run.eval_every == 0
                and not self.done):
            return
        batches = self.data.eval_batches("val", run.eval_batches)
        if batches is None:  # a file source without a val split
            return
        start = time.perf_counter()
        m = self.metrics(batches)
        self.say("step %d  validation log loss %.4f  AUC %.4f", self.step, m["log_loss"],
                 m["auc"])
        self.csv.write("val", self.step, m["samples"], m["auc"], m["log_loss"],
                       elapsed_s=time.perf_counter() - start)
        self.window.restart()  # keep evaluation out of the training rate

    # ------------------------------------------------------------------ the end

    def finish(self) -> Dict[str, float]:
        """Final validation and test; the results (metrics, memory, throughput)."""
        run = self.run
        results: Dict[str, float] = {"step": self.step,
                                     "stored_floats": self.summary.stored_floats,
                                     "compression": self.summary.compression_ratio}
        if self.window.timed_steps:
            results["train_samples_per_s"] = self.window.samples_per_s(run.batch_size * self.world)
        for split, count in (("val", run.eval_batches), ("test", run.test_batches)):
            batches = self.data.eval_batches(split, count) if count else None
            if batches is None:
                continue
            outputs: Optional[List] = [] if run.get("predictions") else None
            m = self.metrics(batches, outputs)
            if outputs is not None:
                self.write_predictions(split, outputs)
            self.say("%s log loss %.4f  AUC %.4f  (%d samples)", split, m["log_loss"], m["auc"],
                     m["samples"])
            self.csv.write(split, self.step, m["samples"], m["auc"], m["log_loss"])
            results[f"{split}_auc"], results[f"{split}_log_loss"] = m["auc"], m["log_loss"]
        if "train_samples_per_s" in results:
            self.say("training throughput %.0f samples/s (after the first log window)",
                     results["train_samples_per_s"])
        return results

    def metrics(self, batches: Iterator, outputs: Optional[List] = None) -> Dict[str, float]:
        """AUC and log loss of the model over ``batches`` (all ranks together); each batch's
        ``(logits, labels)`` is appended to ``outputs`` if given."""
        metrics = PhaseMetrics()

        def update(out) -> None:
            metrics.update(out[1], out[2])
            if outputs is not None:
                outputs.append((out[1].detach().cpu(), out[2].detach().cpu()))

        self.dmp.eval()
        with torch.no_grad():
            run_to_end(self.pipeline, batches, update)
        self.dmp.train()
        raise_pending_checks()  # no metric from a batch whose input failed its checks
        return metrics.compute()

    def write_predictions(self, split: str, outputs: List) -> None:
        """``<run dir>/predictions_<split>.csv``: every rank's logits and labels, rank 0's
        first, each rank's in batch order (collective)."""
        logits = torch.cat([o[0].reshape(-1) for o in outputs]) if outputs else torch.empty(0)
        labels = torch.cat([o[1].reshape(-1) for o in outputs]) if outputs else torch.empty(0)
        gathered: Optional[List] = [None] * self.world if self.main else None
        dist.gather_object((logits, labels), gathered, dst=0)
        if not self.main:
            return
        path = self.run_dir / f"predictions_{split}.csv"
        table = torch.stack([torch.cat([g[0] for g in gathered]).float(),
                             torch.cat([g[1] for g in gathered]).float()], dim=1)
        # %.9g: float32 logits read back bit for bit
        np.savetxt(path, table.numpy(), fmt=["%.9g", "%g"], delimiter=",",
                   header="logit,label", comments="")
        self.say("%s predictions: %s", split, path)

    # ------------------------------------------------------------------ export

    def export(self) -> None:
        """With ``run.export``: rank 0 builds the unsharded predict model on CPU
        (:func:`robe_torchrec.dlrm.build_predict_model`), loads the weights of the final
        checkpoint (``run.checkpoint`` in eval mode), ``torch.export``-s it on the first
        validation batch, with a dynamic batch size (:func:`robe_torchrec.export.export_model`),
        and saves the program to ``run.export`` (collective: the other ranks wait)."""
        target = self.run.get("export")
        if not target:
            return
        source = self.run.get("checkpoint") or self.ckpt.latest()
        if self.main:
            model, _ = build_predict_model(self.cfg, self.data.keys, self.data.cardinalities)
            step = load_unsharded(source, model)
            dense, kjt = self.example_inputs()
            with torch.no_grad():
                # any batch size and number of ids, not only the example's
                program = export_model(model.eval(), dense, kjt)
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.export.save(program, path)
            self.say("exported the predict model of step %d (checkpoint %s) to %s", step,
                     source, path)
        dist.barrier()

    def example_inputs(self) -> Tuple[torch.Tensor, KeyedJaggedTensor]:
        """``(dense_features, sparse_features)`` of the first batch of rank 0's validation
        split (test, else training, when there is none). The KeyedJaggedTensor is rebuilt
        from keys, values and lengths only: the inputs the exported program is called with
        must be built the same way (its input spec holds which KJT fields are set)."""
        batches = self.data.eval_batches("val", 1) or self.data.eval_batches("test", 1) \
            or self.data.train_batches(0, 1)
        batch = next(iter(batches))
        kjt = batch.sparse_features
        return batch.dense_features, KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(),
                                                       lengths=kjt.lengths())


class _Window:
    """The training metrics and time of the steps since the last log line, and the
    throughput over every window but the first (which pays for warm-up)."""

    def __init__(self) -> None:
        self.metrics = PhaseMetrics()
        self.start, self.steps = time.perf_counter(), 0
        self.timed_s, self.timed_steps, self.first = 0.0, 0, True

    def restart(self) -> None:
        self.start = time.perf_counter()

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.steps += 1
        self.metrics.update(logits, labels)

    def close(self):
        """``(seconds, steps, metrics)`` of the window (metrics: collective); :meth:`restart`
        starts the next one's clock."""
        elapsed, steps = time.perf_counter() - self.start, self.steps
        m = self.metrics.compute()
        if not self.first:
            self.timed_s += elapsed
            self.timed_steps += steps
        self.first = False
        self.metrics.reset()
        self.steps = 0
        return elapsed, steps, m

    def discard(self) -> None:
        """Forget the steps since the last log line (they were rolled back)."""
        self.metrics.reset()
        self.steps = 0
        self.restart()

    def samples_per_s(self, samples_per_step: int) -> float:
        """The training rate over the timed windows (there must be one)."""
        return self.timed_steps * samples_per_step / self.timed_s


def _why(bad: Path) -> str:
    """The reason recorded in a ``step_N.bad`` directory."""
    try:
        return (bad / "WHY").read_text().strip() or "unusable"
    except OSError:
        return "unusable"


def _last_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                            else "cpu")
    return torch.device(name)
