"""Entry point: set up torch.distributed, agree on one run directory, then hand over to Hydra.

The app always runs inside a process group. Under ``torchrun`` / torchx (``RANK`` and
``MASTER_ADDR`` set) it joins the ``env://`` rendezvous; launched plainly it makes a 1-rank
group itself, so ``python -m robe_torchrec.train`` and a 64-rank job run the same code.

Hydra creates its output directory in every process, named by each process's clock. To get
one directory per run, the name is decided once (the elastic run id, which stays the same
across ``max_restarts`` restarts so a restarted job finds its checkpoints; otherwise rank 0's
clock plus a random suffix, broadcast) and handed to Hydra through ``ROBE_RUN_STAMP`` (see ``configs/config.yaml``);
only rank 0 writes Hydra's ``.hydra/`` files and log file there.

Example::

    python -m robe_torchrec.train run.steps=100 embedding.compression=100
    python -m robe_torchrec.train run.mode=eval run.checkpoint=outputs/x/checkpoints/step_100
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from robe_torchrec.distributed.process_group import (before_init_process_group,
                                                     destroy_process_group)


def init_distributed() -> None:
    """Join the launcher's process group (env://) or create a 1-rank one."""
    if dist.is_initialized():
        return
    before_init_process_group()
    cuda = torch.cuda.is_available()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Under torchrun the workers share the agent's store, and a restarted worker group
            # could read the dead group's gloo addresses from it (seen as "connectFullMesh
            # failed ... Connection refused" after a restart): key this attempt's group apart.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  world, is_master=False, timeout=timedelta(minutes=10))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(backend, store=dist.PrefixStore(f"robe/attempt_{attempt}",
                                                                    store),
                                    rank=rank, world_size=world)
        else:
            dist.init_process_group(backend)
    else:
        # no launcher: an in-memory store needs no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def agree_on_run_stamp() -> str:
    """The run directory's name, the same on every rank (collective)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    # the suffix keeps two launches within one second apart
    stamp = [time.strftime("%Y-%m-%d/%H-%M-%S") + "-" + uuid.uuid4().hex[:6]]
    dist.broadcast_object_list(stamp, src=0)
    return stamp[0]


def _hydra_argv(argv: list, rank: int) -> list:
    if rank == 0:
        return argv
    # other ranks share rank 0's directory but leave Hydra's files to it
    return argv + ["hydra.output_subdir=null", "hydra/job_logging=stdout"]


def own_errors() -> Tuple[type, ...]:
    """The app's own error types: refusals whose message names the problem and the fix, so
    the app prints them as one line (:func:`_task`)."""
    from robe_torchrec.data.criteo_tsv import CriteoFileError, CriteoRowError
    from robe_torchrec.export import UnsafeProgramError
    from robe_torchrec.ops.deferred_checks import DeferredCheckError
    from robe_torchrec.train.checkpoint import CheckpointError, CheckpointSaveError
    from robe_torchrec.train.config import ConfigError
    from robe_torchrec.train.preempt import CollectiveTimeout
    from robe_torchrec.train.rundir import RunDirLocked
    from robe_torchrec.train.trainer import NonFiniteError

    return (ConfigError, CheckpointError, CheckpointSaveError, CollectiveTimeout, RunDirLocked,
            NonFiniteError, CriteoRowError, CriteoFileError, UnsafeProgramError,
            DeferredCheckError)


def _task(cfg) -> Optional[Dict[str, Any]]:
    from hydra.core.hydra_config import HydraConfig

    from robe_torchrec.train.trainer import log, run

    try:
        return run(cfg, HydraConfig.get().runtime.output_dir)
    except own_errors() as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        # one line, in the log and its file, instead of Hydra's traceback (whose last line
        # this is); exit status 1 as with the traceback
        log.error("%s: %s  (HYDRA_FULL_ERROR=1 shows the traceback)", type(e).__name__, e)
        raise SystemExit(1) from None


def main() -> None:
    """``python -m robe_torchrec.train [hydra overrides]``."""
    import hydra

    from robe_torchrec.hydra_configs import config_dir
    from robe_torchrec.train.schema import register

    register()  # the schemas the YAML files extend: Hydra checks the config against them
    init_distributed()
    try:
        if "ROBE_RUN_STAMP" not in os.environ:
            os.environ["ROBE_RUN_STAMP"] = agree_on_run_stamp()
        sys.argv = _hydra_argv(sys.argv, dist.get_rank())
        hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(_task)()
    finally:
        destroy_process_group()  # its threads end before the interpreter's shutdown


if __name__ == "__main__":
    main()
