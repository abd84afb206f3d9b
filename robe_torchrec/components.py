"""torchx component of the training app: one function returning an ``AppDef`` that runs
``python -m robe_torchrec.train`` under torchrun (``python -m torch.distributed.run``) on any
torchx scheduler.

torchrun is started through an interpreter, not looked up on ``PATH``: this one
(``sys.executable``) where it exists on the node, as with ``local_cwd`` from a venv that is
not activated, else the image's ``python``; ``--python`` names another.

Run (2 processes on this machine; the Hydra overrides go after ``--``)::

    torchx run -s local_cwd robe_torchrec/components.py:train -j 1x2 -- run.steps=100

Kubernetes / Slurm: the same component, another scheduler (see the README section
"Training DLRM with Hydra and torchx")::

    torchx run -s kubernetes -cfg namespace=ml,queue=default robe_torchrec/components.py:train \\
        --image registry/robe:latest -j 4x8 --gpu 8 --max_restarts 3 \\
        --run_dir /mnt/shared/robe/run1 -- embedding.compression=1000
    torchx run -s slurm -cfg partition=gpu,time=04:00:00 robe_torchrec/components.py:train \\
        -j 2x8 --gpu 8 --run_dir /shared/robe/run1 -- model=dcn
"""

import shlex
import sys
from typing import Dict, List, Optional

import torchx
import torchx.specs as specs
from torchx.components import dist


def train(
    *overrides: str,
    j: str = "1x2",
    name: str = "robe-train",
    image: str = torchx.IMAGE,
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    max_restarts: int = 0,
    max_retries: int = 0,
    run_dir: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
    python: Optional[str] = None,
) -> specs.AppDef:
    """DLRM training with ROBE-Z embeddings (``python -m robe_torchrec.train``).

    Args:
        overrides: Hydra overrides for the app (``run.steps=1000 embedding=full ...``).
        j: ``{nnodes}x{nproc_per_node}`` (``[min_nnodes:]`` prefix for elastic jobs).
        name: job name.
        image: container image holding this repository (ignored by local_cwd).
        h: a registered named resource (overrides cpu / gpu / memMB).
        cpu: CPUs per node.
        gpu: GPUs per node (the app uses NCCL when CUDA is available).
        memMB: memory per node in MB.
        max_restarts: torchrun restarts of the whole worker group after a failure; each
            restart resumes from the run directory's last checkpoint.
        max_retries: scheduler-level retries of a node (Kubernetes, Slurm, ...).
        run_dir: the run directory (on a file system every node sees); by default
            ``outputs/<app id>``, which restarts and retries keep, so they resume.
        env: extra environment variables.
        mounts: volume mounts (``type=bind,src=/host,dst=/job``), see torchx.
        python: the interpreter that runs torchrun on the nodes; by default this one where
            its path exists there, else ``python``.
    """
    args = list(overrides)
    if run_dir is not None:
        args.append(f"hydra.run.dir={run_dir}")
    app = dist.ddp(*args, m="robe_torchrec.train", image=image, name=name, h=h, cpu=cpu,
                   gpu=gpu, memMB=memMB, j=j, env=env, max_retries=max_retries,
                   mounts=mounts)
    role = app.roles[0]
    # the role runs `bash -c "torchrun ..."`: swap in our launcher, and torchrun's own
    # restarts, for which torchx's ddp has no knob
    cmd = role.args[-1]
    if not cmd.startswith("torchrun "):
        raise RuntimeError(f"unexpected torchx ddp command: {cmd!r}")
    restarts = f"--max_restarts {int(max_restarts)} " if max_restarts else ""
    role.args[-1] = f"{_torchrun(python)} {restarts}{cmd[len('torchrun '):]}"
    return app


def _torchrun(python: Optional[str]) -> str:
    """The shell words that start torchrun. ``$$`` is torchx's escape of ``$`` (it
    substitutes macros such as ``${app_id}`` into the command)."""
    if python:
        return f"{shlex.quote(python)} -m torch.distributed.run"
    here = shlex.quote(sys.executable)
    return f'"$$([ -x {here} ] && echo {here} || echo python)" -m torch.distributed.run'


__all__ = ["train"]
