"""How many intra-op threads a rank should use: the cores this process may run on
(``os.sched_getaffinity``), less the ones other processes keep busy right now, shared among
the ranks of this node (``LOCAL_WORLD_SIZE``), at most torch's own default, at least 1.

Why not torch's default: it is one thread per physical core, whatever else runs. A parallel
loop waits for its slowest thread, so when another process holds one of those cores every
loop waits for a time slice there, and a training run on a 2-core machine with one busy core
ran 6-16x slower than with 1 thread (``benchmarks/results/busy_machine.md``).

"Busy" is measured, not guessed: the non-idle share of each allowed CPU in ``/proc/stat``
over a short interval while this process sleeps (Linux; elsewhere nothing counts as busy).

Example::

    >>> from robe_torchrec.threads import choose_threads
    >>> choice = choose_threads(None)        # or choose_threads(4): the user's number
    >>> torch.set_num_threads(choice.threads)
    >>> print(choice)                        # the numbers behind it, for the log
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, Optional, Set, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    threads: int
    requested: Optional[int]
    usable: int
    busy: float
    local_world: int
    torch_default: int

    def __str__(self) -> str:
        if self.requested:
            return f"{self.threads} thread(s) per rank (run.threads)"
        return (f"{self.threads} thread(s) per rank: {self.usable} usable core(s), "
                f"{self.busy:.1f} busy with other processes, {self.local_world} rank(s) on "
                f"this node, torch's default {self.torch_default} (set run.threads to choose)")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask; the cgroup's cpuset included)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_world_size() -> int:
    """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE`` (1 when not launched by it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _cpu_times() -> Dict[int, Tuple[int, int]]:
    """``cpu -> (busy, total)`` jiffies from ``/proc/stat``."""
    times = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            counts = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle = counts[3] + counts[4]
            times[int(name[3:])] = (sum(counts) - idle, sum(counts))
    return times


def busy_cores(interval: float = 0.1, cpus: Optional[Set[int]] = None) -> float:
    """Cores' worth of CPU time other processes use now, on the CPUs this process may use
    (this process sleeps meanwhile). 0 where ``/proc/stat`` cannot be read."""
    try:
        cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        before = _cpu_times()
        time.sleep(interval)
        after = _cpu_times()
    except (OSError, AttributeError, ValueError):
        return 0.0
    busy = 0.0
    for cpu in cpus & before.keys() & after.keys():
        total = after[cpu][1] - before[cpu][1]
        if total > 0:
            busy += (after[cpu][0] - before[cpu][0]) / total
    return busy


def choose_threads(requested: Optional[int] = None) -> ThreadChoice:
    """``requested`` if given (> 0), else the default described in the module docstring."""
    usable, world, default = usable_cores(), local_world_size(), torch.get_num_threads()
    if requested is not None and requested < 0:
        raise ValueError(f"threads must be a positive number or null (chosen), got {requested}")
    if requested:
        return ThreadChoice(int(requested), int(requested), usable, 0.0, world, default)
    busy = busy_cores()
    # a core counts as taken once half of it is busy
    free = max(1, usable - int(busy + 0.5))
    threads = max(1, min(default, free // world))
    return ThreadChoice(threads, None, usable, busy, world, default)
