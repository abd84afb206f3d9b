"""The training app with one deliberate crash, for the fault-tolerance test only::

    torchrun --nproc-per-node 2 --max-restarts 1 -m tests.train.faulty_app \\
        --kill-rank 1 --kill-at-step 10 run.steps=12 run.checkpoint_every=4

Rank ``kill-rank`` exits (``os._exit(1)``) once the pipeline has trained step
``kill-at-step``, before that step is counted or logged, on the first attempt only
(``TORCHELASTIC_RESTART_COUNT=0``): the restart resumes from the last checkpoint. The other
arguments are the app's Hydra overrides.

``--sigkill-in-save N`` instead SIGKILLs the process while it saves checkpoint ``step_N``:
after DCP has written every file of ``step_N.tmp``, before the manifest and the rename::

    python -m tests.train.faulty_app --sigkill-in-save 4 run.steps=6 run.checkpoint_every=2
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from robe_torchrec.train import app, checkpoint
from robe_torchrec.train.trainer import Trainer

log = logging.getLogger("robe_torchrec.train")


def inject_fault(kill_rank: int, kill_at_step: int) -> None:
    """Make :meth:`Trainer.on_step` (called with each trained step's output) crash there."""
    on_step = Trainer.on_step

    def on_step_or_crash(self: Trainer, output) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and self.rank == kill_rank and self.step + 1 == kill_at_step:
            log.error("fault injection: rank %d exits at step %d", kill_rank, kill_at_step)
            logging.shutdown()
            os._exit(1)
        on_step(self, output)

    Trainer.on_step = on_step_or_crash


def sigkill_in_save(step: int) -> None:
    """Make the save of checkpoint ``step_<step>`` end in SIGKILL once DCP has written it."""
    save = checkpoint.dcp.save

    def save_then_die(state, checkpoint_id):
        out = save(state, checkpoint_id=checkpoint_id)
        if str(checkpoint_id).endswith(f"step_{step}.tmp"):
            log.error("fault injection: SIGKILL while saving %s", checkpoint_id)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    checkpoint.dcp.save = save_then_die


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kill-rank", type=int)
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--sigkill-in-save", type=int)
    args, overrides = parser.parse_known_args()
    sys.argv = [sys.argv[0], *overrides]  # the rest is Hydra's
    if args.sigkill_in_save is not None:
        sigkill_in_save(args.sigkill_in_save)
    else:
        inject_fault(args.kill_rank, args.kill_at_step)
    app.main()


if __name__ == "__main__":
    main()
