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


def test_groups_with_slow_tests_are_collected_first(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from tests.conftest import pytest_collection_modifyitems  # noqa: F401
        def pytest_configure(config):
            config.addinivalue_line("markers", "slow: a long test")
    """))
    (tmp_path / "test_a.py").write_text("def test_a1(): pass\ndef test_a2(): pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\ndef test_b1(): pass\n"
                                        "@pytest.mark.slow\ndef test_b2(): pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-q",
                             "--collect-only", "-p", "no:cacheprovider"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    order = [line.split("::")[1] for line in result.stdout.splitlines() if "::" in line]
    # test_b.py holds a slow test: its group goes first, each file in its own order
    assert order == ["test_b1", "test_b2", "test_a1", "test_a2"]
