"""Small Criteo TSV fixtures written into a test's tmp_path."""

from __future__ import annotations

import random
from pathlib import Path
from typing import List, Sequence

Row = List[str]


def random_rows(n: int, seed: int = 0, empty_rate: float = 0.1) -> List[Row]:
    """``n`` valid 40-field rows; dense column 0 holds the row number so order can be checked."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = str(rng.randint(0, 1))
        dense = [str(i)] + [
            "" if rng.random() < empty_rate else str(rng.randint(-2, 5000)) for _ in range(12)
        ]
        cats = ["" if rng.random() < empty_rate else f"{rng.getrandbits(32):08x}" for _ in range(26)]
        rows.append([label, *dense, *cats])
    return rows


def write_tsv(path: Path, rows: Sequence[Sequence[str]] | Sequence[str], newline: str = "\n") -> Path:
    """Writes rows (field lists, or raw line strings kept as they are) with a final newline."""
    lines = [r if isinstance(r, str) else "\t".join(r) for r in rows]
    path.write_bytes("".join(line + newline for line in lines).encode())
    return path
