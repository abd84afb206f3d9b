"""Writes a benchmark's results next to each other: ``<stem>.json`` (every number) and
``<stem>.md`` (the table the README quotes).

Example::

    >>> write_report("robe_torchrec/benchmarks/results", "distributed_step", result, text)
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict


def write_report(out_dir: "str | os.PathLike", stem: str, result: Dict[str, Any],
                 markdown: str) -> None:
    """Write ``result`` as ``<out_dir>/<stem>.json`` and ``markdown`` as ``<stem>.md``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown)
