"""Shared pieces of the training-app tests: tiny configs, a 1-rank process group,
subprocess launches with timeouts, and reading DCP checkpoints back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from robe_torchrec.distributed.process_group import (before_init_process_group,
                                                     destroy_process_group)

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

# a few seconds per run on 2 shared cores
TINY_RUN = [
    "run.batch_size=32", "run.log_every=2", "run.eval_batches=1", "run.test_batches=1",
    "run.progress_bar=false",
]
TINY = [*TINY_RUN, "data.cardinality_scale=0.001"]


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from robe_torchrec.hydra_configs import config_dir
    from robe_torchrec.train.schema import register

    register()  # as the app does before Hydra composes
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        tiny = TINY_RUN if any(o.startswith("data=") for o in overrides) else TINY
        return hydra_compose("config", overrides=[*tiny, *overrides])


@contextmanager
def one_rank_group():
    before_init_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_process_group()


def env(marker: str = "", venv_on_path: bool = True) -> Dict[str, str]:
    """The launch environment; ``venv_on_path=False``: the venv's bin/ is not on PATH (a venv
    that is not activated), so nothing launched can find torchrun there."""
    e = dict(os.environ)
    path = [p for p in e.get("PATH", "").split(os.pathsep)
            if p and Path(p).resolve() != VENV_BIN.resolve()]
    e["PATH"] = os.pathsep.join([str(VENV_BIN), *path] if venv_on_path else path)
    e["PYTHONPATH"] = f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}"
    e.pop("ROBE_RUN_STAMP", None)
    e.pop("TORCHELASTIC_RUN_ID", None)
    e["ROBE_TEST_LAUNCH"] = marker
    return e


def _kill_marked(marker: str) -> None:
    """Kill every process started with ``ROBE_TEST_LAUNCH=marker`` in its environment:
    torchrun starts its workers in their own sessions, so killing the launcher's process
    group would leave them running."""
    needle = f"ROBE_TEST_LAUNCH={marker}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def run(cmd: List[str], cwd: Path, timeout: float, venv_on_path: bool = True,
        env_extra: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run a launcher with a timeout; afterwards (and on timeout) no process it started is
    left. Output goes through a file, so a leftover worker holding it cannot block us."""
    marker = uuid.uuid4().hex
    log = cwd / f"launch-{marker[:8]}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env={**env(marker, venv_on_path), **(env_extra or {})},
                                stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill_marked(marker)
            proc.wait()
    text = log.read_text()
    if proc.returncode in (-signal.SIGKILL,) and "Job finished" not in text:
        raise AssertionError(f"{cmd} timed out after {timeout}s:\n{text[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, text, None)


def torchrun(nproc: int, *args: str, max_restarts: int = 0,
             module: str = "robe_torchrec.train") -> List[str]:
    return [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "-m", module, *args]


def read_checkpoint(path: Path, tmp: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer), assembled, by key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.parent.parent.name}_{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    flat: Dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj

    walk("", torch.load(out, weights_only=False))
    return flat


def assert_same_tensors(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], prefix: str
                        ) -> int:
    keys = sorted(k for k in a if k.startswith(prefix) and not k.startswith("rng"))
    assert keys and keys == sorted(k for k in b if k.startswith(prefix) and not
                                   k.startswith("rng")), "checkpoints hold different keys"
    differ = [k for k in keys if not torch.equal(a[k], b[k])]
    assert not differ, f"tensors differ: {differ[:5]}"
    return len(keys)


def run_dirs(root: Path) -> List[Path]:
    """Run directories under ``root`` (those holding a metrics.csv)."""
    return sorted(p.parent for p in root.rglob("metrics.csv"))
