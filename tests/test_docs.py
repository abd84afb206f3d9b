"""Every ```python and ```bash block of README.md and docs/*.md runs as written.

Python blocks run in a fresh interpreter (this one, ``sys.executable``) from a file, with the
repository root as working directory and on ``sys.path``, as if the block were pasted into a
script there. Bash blocks run under ``bash -euo pipefail`` from the repository root with the
virtual environment activated (its ``bin`` first on ``PATH``, ``VIRTUAL_ENV`` set).

Markers, as HTML comments on the lines right before a block (blank lines may separate them):

* ``<!-- skip-test: REASON -->``: the block is not run; REASON must say why.
* ``<!-- slow-test -->``: the block is marked ``slow`` (it still runs in CI).

No block may change the committed benchmark or pipeline results.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
RUN_LANGS = ("python", "bash")
MARKER = re.compile(r"^<!--\s*(skip-test|slow-test)\s*(?::(.*?))?-->\s*$")
TIMEOUT_S = 420


class Block(NamedTuple):
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the stated reason, "" if the marker gave none, None if not skipped
    slow: bool

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> List[Block]:
    lines = path.read_text().splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        ticks, lang, start = fence.group(1), fence.group(2).lower(), i
        end = i + 1
        while end < len(lines) and not lines[end].startswith(ticks):
            end += 1
        # markers: the comment lines right above the fence, blank lines allowed between
        skip, slow, j = None, False, start - 1
        while j >= 0 and (not lines[j].strip() or MARKER.match(lines[j].strip())):
            m = MARKER.match(lines[j].strip())
            if m and m.group(1) == "skip-test":
                skip = (m.group(2) or "").strip()
            elif m:
                slow = True
            j -= 1
        blocks.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n",
                            skip, slow))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for f in doc_files() for b in parse(f)]
RUNNABLE = [b for b in ALL_BLOCKS if b.lang in RUN_LANGS]


def _params():
    for b in RUNNABLE:
        marks = [pytest.mark.slow] if b.slow else []
        if b.skip is not None:
            marks.append(pytest.mark.skip(reason=b.skip or "(no reason given)"))
        yield pytest.param(b, id=b.id, marks=marks)


def _results_digest() -> Dict[str, str]:
    """Hashes of the committed results files the blocks must leave alone."""
    out = {}
    for folder in ("benchmarks/results", "pipelines/results"):
        for f in sorted((ROOT / folder).glob("*")):
            if f.is_file():
                out[str(f.relative_to(ROOT))] = hashlib.sha1(f.read_bytes()).hexdigest()
    return out


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    # a reader's shell has none of the test session's settings
    for key in ("TRITON_INTERPRET", "ROBE_RUN_STAMP", "TORCHELASTIC_RUN_ID", "PYTEST_CURRENT_TEST"):
        env.pop(key, None)
    return env


def test_docs_have_runnable_blocks():
    assert (ROOT / "docs").is_dir()
    ids = [b.id for b in RUNNABLE]
    assert len(ids) == len(set(ids))
    assert any(b.path.name == "README.md" and b.skip is None for b in RUNNABLE)


def test_every_skip_states_a_reason():
    missing = [b.id for b in ALL_BLOCKS if b.skip is not None and not b.skip]
    assert not missing, f"skip-test markers without a reason: {missing}"


def test_every_marker_belongs_to_a_block():
    """A marker followed by prose instead of a fence would silently mark nothing."""
    for path in doc_files():
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if not MARKER.match(line.strip()):
                continue
            k = n + 1
            while k < len(lines) and (not lines[k].strip() or MARKER.match(lines[k].strip())):
                k += 1
            assert k < len(lines) and lines[k].startswith("```"), \
                f"{path.relative_to(ROOT)}:{n + 1}: marker not right before a code block"


@pytest.mark.parametrize("block", list(_params()))
def test_block_runs(block: Block, tmp_path):
    before = _results_digest()
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id} ran past {TIMEOUT_S} s:\n{(e.stdout or '')[-2000:]}")
    assert out.returncode == 0, (
        f"{block.id} exited {out.returncode}\n--- block ---\n{block.code}"
        f"--- stdout ---\n{out.stdout[-3000:]}\n--- stderr ---\n{out.stderr[-5000:]}")
    assert _results_digest() == before, f"{block.id} changed committed results files"
