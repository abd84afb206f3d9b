"""Every ```python and ```bash block of README.md and docs/*.md runs as written.

Python blocks run as a script file, with the repository root as working directory and on
``sys.path``, as if the block were pasted into a script there; each runs in a process of its own
forked from one that has imported torch and torchrec already (tests/doc_runner.py), which saves
those imports per block. Bash blocks run under ``bash -euo pipefail`` from the repository root with the
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
import select
import signal
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
        # one page's blocks run in order on one worker: later blocks may read what earlier
        # ones wrote
        marks = [pytest.mark.xdist_group(str(b.path.relative_to(ROOT)))]
        if b.slow:
            marks.append(pytest.mark.slow)
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


LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def test_relative_links_resolve():
    """Every relative link in the prose of README.md and docs/*.md names a path that exists
    (a moved or renamed results file would otherwise leave a link to nothing)."""
    broken = []
    for path in doc_files():
        in_code = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
                continue
            for target in [] if in_code else LINK.findall(line):
                if "://" not in target and not (path.parent / target).exists():
                    broken.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


class BlockRunner:
    """A tests/doc_runner.py process: runs one python block file at a time in a forked child."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "doc_runner.py")],
                                     cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests/doc_runner.py died (exit {self.proc.wait()})")
        return line.split()[1]

    def run(self, script: Path, out: Path, err: Path) -> int:
        """The block's exit code; raises TimeoutError (after killing it) past TIMEOUT_S."""
        self.proc.stdin.write(f"{script}\t{out}\t{err}\n")
        pid = int(self._line(TIMEOUT_S))
        try:
            return int(self._line(TIMEOUT_S))
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._line(TIMEOUT_S)
            raise

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def block_runner():
    runner = BlockRunner()
    yield runner
    runner.close()


def _run(block: Block, tmp_path: Path, runner: BlockRunner) -> subprocess.CompletedProcess:
    if block.lang == "python":
        script, out, err = tmp_path / "block.py", tmp_path / "stdout", tmp_path / "stderr"
        script.write_text(block.code)
        try:
            rc = runner.run(script, out, err)
        except TimeoutError:
            pytest.fail(f"{block.id} ran past {TIMEOUT_S} s:\n{out.read_text()[-2000:]}")
        return subprocess.CompletedProcess(script, rc, out.read_text(), err.read_text())
    try:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT,
                              env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id} ran past {TIMEOUT_S} s:\n{(e.stdout or '')[-2000:]}")


@pytest.mark.parametrize("block", list(_params()))
def test_block_runs(block: Block, tmp_path, block_runner):
    before = _results_digest()
    out = _run(block, tmp_path, block_runner)
    assert out.returncode == 0, (
        f"{block.id} exited {out.returncode}\n--- block ---\n{block.code}"
        f"--- stdout ---\n{out.stdout[-3000:]}\n--- stderr ---\n{out.stderr[-5000:]}")
    assert _results_digest() == before, f"{block.id} changed committed results files"


@pytest.mark.parametrize("code, rc, stream, text", [
    ("print('ok')\n", 0, "stdout", "ok"),
    ("import sys\nsys.exit(3)\n", 3, "stdout", ""),
    ("raise KeyError('boom')\n", 1, "stderr", "KeyError: 'boom'"),
    ("import __main__, sys\nassert __name__ == '__main__' and sys.argv[0].endswith('block.py')\n",
     0, "stdout", ""),
])
def test_runner_reports_what_python_would(code, rc, stream, text, tmp_path, block_runner):
    block = Block(ROOT / "README.md", 0, "python", code, None, False)
    out = _run(block, tmp_path, block_runner)
    assert out.returncode == rc and text in getattr(out, stream)
