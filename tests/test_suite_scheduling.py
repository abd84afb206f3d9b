"""The suite's own scheduling: ``--dist loadgroup`` keeps a test file on one worker.

Tests of one file share module fixtures and run in order, and a docs page's blocks read what
earlier blocks wrote; that holds only if xdist's groups take effect, which a pytest or
pytest-xdist upgrade can silently undo (pytest 9.2 with xdist 3.8 did)."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_file_runs_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from tests.conftest import pytest_collection_modifyitems  # noqa: F401
    """))
    for name in ("a", "b"):
        tests = "\n".join(textwrap.dedent(f"""
            def test_{i}(worker_id):
                with open({str(tmp_path / name)!r} + "_" + worker_id, "a") as f:
                    f.write("{i}")
        """) for i in range(6))
        (tmp_path / f"test_{name}.py").write_text(tests)
    result = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-q", "-n", "2",
                             "--dist", "loadgroup", "-p", "no:cacheprovider"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for name in ("a", "b"):
        workers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f"{name}_gw"))
        assert len(workers) == 1, f"test_{name}.py ran on {workers}"
        assert (tmp_path / workers[0]).read_text() == "012345", "out of order"
