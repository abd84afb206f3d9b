"""A Hydra callback: each job's results in ``<job dir>/results.json``, and at the end of a
``-m`` sweep one table of every job's overrides and results, ``summary.md`` and
``summary.csv`` in the sweep directory (also printed).

Registered in ``configs/config.yaml`` (``hydra.callbacks.sweep_summary``). Only rank 0
writes. The table is built from the jobs' ``results.json`` files, so it also works with
launchers that run the jobs in other processes.

Example::

    python -m robe_torchrec.train -m embedding.compression=100,1000 run.steps=100
    cat multirun/<date>/<time>/summary.md
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("robe_torchrec.train")

RESULTS_FILE = "results.json"
#: the results shown first, in this order (any others follow, sorted)
FIRST_COLUMNS = ("val_auc", "val_log_loss", "test_auc", "test_log_loss", "train_samples_per_s",
                 "compression", "stored_floats", "step")


def _rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _number(x: Any) -> Any:
    try:
        return float(x) if not isinstance(x, (int, float)) else x
    except (TypeError, ValueError):
        return str(x)


class SweepSummary(Callback):
    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if not _rank0():
            return
        hydra_cfg = job_return.hydra_cfg
        if hydra_cfg is not None and "hydra" in hydra_cfg:
            hydra_cfg = hydra_cfg.hydra
        out_dir = Path(hydra_cfg.runtime.output_dir if hydra_cfg is not None else os.getcwd())
        completed = job_return.status.name == "COMPLETED"
        raw = job_return._return_value  # the results, or the exception of a failed job
        record = {
            "job": hydra_cfg.job.get("num") if hydra_cfg is not None else None,
            "overrides": list(job_return.overrides or []),
            "status": "completed" if completed else "failed",
            "results": {k: _number(v) for k, v in (raw or {}).items()} if completed else {},
            "error": None if completed else f"{type(raw).__name__}: {raw}",
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / RESULTS_FILE).write_text(json.dumps(record, indent=1) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not _rank0():
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        summary = write_summary(sweep_dir)
        if summary is not None:
            log.info("sweep summary: %s and %s\n%s", sweep_dir / "summary.md",
                     sweep_dir / "summary.csv", summary)


def write_summary(sweep_dir: "str | os.PathLike") -> "str | None":
    """``summary.md`` and ``summary.csv`` in ``sweep_dir`` from its jobs' ``results.json``
    (one row per job, by job number: the job, its overrides, its results, its status; the
    markdown shows only the overrides that differ between jobs); returns the markdown, or
    None when no job wrote results."""
    sweep_dir = Path(sweep_dir)
    records: List[Dict[str, Any]] = []
    for path in sweep_dir.glob(f"*/{RESULTS_FILE}"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            log.warning("sweep summary: skipped %s (%s)", path, e)
    if not records:
        return None
    records.sort(key=lambda r: (r.get("job") is None, r.get("job") or 0))
    keys: List[str] = []
    rows = []
    for r in records:
        overrides = dict(o.split("=", 1) if "=" in o else (o, "") for o in r["overrides"])
        keys += [k for k in overrides if k not in keys]
        rows.append((r, overrides))
    found = {k for r in records for k in r["results"]}
    metrics = [k for k in FIRST_COLUMNS if k in found] + sorted(found - set(FIRST_COLUMNS))
    header = ["job", *keys, *metrics, "status"]
    table = []
    for r, overrides in rows:
        values = [r["results"].get(m, "") for m in metrics]
        status = r["status"] if r["status"] == "completed" else r.get("error") or r["status"]
        table.append([r.get("job", ""), *(overrides.get(k, "") for k in keys), *values, status])
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(table)

    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", " ")

    # the markdown leaves out the overrides every job shares (the CSV has them all)
    shown = [i for i, name in enumerate(header)
             if name not in keys or len(records) == 1 or len({str(row[i]) for row in table}) > 1]
    lines = ["| " + " | ".join(header[i] for i in shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(row[i]) for i in shown) + " |" for row in table]
    markdown = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(markdown)
    return markdown
