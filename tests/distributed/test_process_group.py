"""A process group's gloo threads end before the interpreter's shutdown (a group alive then
can abort a finished run with SIGABRT): with our set-up and teardown, and in the training
app. Each check runs in a fresh interpreter, since a process imports a module only once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.train.helpers import REPO, TINY, env

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="counts threads through Linux's /proc")

GLOO_THREADS = textwrap.dedent("""
    import os, time
    def thread_names():
        return {t: open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")}
    def gloo_threads():
        return sum("gloo" in n for n in thread_names().values())
    def gloo_threads_started(before, timeout=60.0):
        # A gloo thread names itself once it first runs, so on a busy machine it may still
        # carry the process's name just after init_process_group: wait until all threads
        # created since `before` have taken their names.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            new = [n for t, n in thread_names().items() if t not in before]
            if new and all("gloo" in n for n in new):
                break
            time.sleep(0.01)
        return gloo_threads()
""")


def _last_line(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", GLOO_THREADS + textwrap.dedent(code), *args],
                         cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


# What TorchRec does: import torch.distributed.optim once the group exists (through
# apply_optimizer_in_backward), and hold the group in reference cycles (a DMP).
HOLD_THE_GROUP = """
    import sys
    import torch.distributed as dist
    from robe_torchrec.distributed import process_group
    ours = sys.argv[1] == "ours"
    if ours:
        process_group.before_init_process_group()
    before = thread_names()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert gloo_threads_started(before) > 0
    import torch.distributed.optim
    cycle = [dist.group.WORLD]
    cycle.append(cycle)
    del cycle
    (process_group.destroy_process_group if ours else dist.destroy_process_group)()
    print(gloo_threads())
"""


def test_our_teardown_ends_the_groups_threads():
    assert _last_line(HOLD_THE_GROUP, "ours") == "0"


def test_plain_teardown_leaves_them_running():
    """The failure mode the above guards against: if this starts failing, torch no longer
    keeps the group alive and :mod:`robe_torchrec.distributed.process_group` can go."""
    assert int(_last_line(HOLD_THE_GROUP, "plain")) > 0


def test_training_app_leaves_no_gloo_thread(tmp_path):
    code = f"""
        import sys
        from robe_torchrec.train import app
        sys.argv = ["train", *{[*TINY, "run.steps=4", f"hydra.run.dir={tmp_path}"]!r}]
        app.main()
        print(gloo_threads())
    """
    assert _last_line(code) == "0"
