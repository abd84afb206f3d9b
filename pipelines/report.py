"""A comparison's report: its results side by side (:func:`write_report`: ``<stem>.json``
with every number, ``<stem>.md`` with the tables), with what :mod:`robe_torchrec.machine`
records about the machine (re-exported here).

Example::

    >>> result = {"machine": machine(), ...}
    >>> write_report("pipelines/results", "compare_cpu", result, text)
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from robe_torchrec.machine import machine, machine_line, nearest_rank, process_memory_mib


def write_report(out_dir: "str | os.PathLike", stem: str, result: Dict[str, Any],
                 markdown: str) -> None:
    """Write ``result`` as ``<out_dir>/<stem>.json`` and ``markdown`` as ``<stem>.md``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown)


__all__ = ["machine", "machine_line", "nearest_rank", "process_memory_mib", "write_report"]
