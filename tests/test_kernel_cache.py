"""The C++ kernel cache is keyed by content (every file of ``csrc/``, torch version and
build, flags, CPU), not by where the checkout, torch or ninja are installed: checkouts and
virtual environments of the same source and torch build share one build, which a later
process loads without compiling."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from robe_torchrec.ops import cpu

ROOT = Path(__file__).resolve().parents[1]


def test_key_ignores_where_things_are_installed(monkeypatch):
    monkeypatch.delenv("ROBE_TORCHREC_BUILD_DIR", raising=False)
    here = cpu.build_directory()
    assert here.startswith(os.path.join(os.path.expanduser("~"), ".cache", "robe_torchrec"))
    # another virtual environment: torch, the interpreter and ninja somewhere else
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/torch/__init__.py")
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv/bin/python")
    monkeypatch.setattr(cpu, "_ninja", lambda: "/elsewhere/venv/bin/ninja")
    assert cpu.build_directory() == here


def test_key_covers_every_file_of_csrc(monkeypatch, tmp_path):
    monkeypatch.delenv("ROBE_TORCHREC_BUILD_DIR", raising=False)
    base = cpu.build_directory()
    # another checkout of the same source: the same key
    copy = tmp_path / "checkout" / "csrc"
    shutil.copytree(cpu._CSRC, copy, ignore=shutil.ignore_patterns("*.tmp"))
    moved = [str(copy / os.path.relpath(p, cpu._CSRC)) for p in cpu._SOURCES]
    monkeypatch.setattr(cpu, "_CSRC", str(copy))
    monkeypatch.setattr(cpu, "_SOURCES", moved)
    assert cpu.build_directory() == base
    # a file the build list does not name yet (a split of the sources), whatever its name
    (copy / "new_part.inc").write_text("// more kernels\n")
    with_new = cpu.build_directory()
    assert with_new != base
    (copy / "new_part.inc").rename(copy / "renamed_part.inc")
    assert cpu.build_directory() not in (base, with_new)


def test_torch_version_is_part_of_the_key(monkeypatch):
    monkeypatch.delenv("ROBE_TORCHREC_BUILD_DIR", raising=False)
    base = cpu.cache_key()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert cpu.cache_key() != base


def test_a_finished_build_loads_without_compiling(tmp_path):
    """Another process (standing for another checkout or environment) whose compiler and
    ninja cannot run loads the cached build."""
    cpu.extension()  # built (or loaded) here first
    script = textwrap.dedent("""
        import torch.utils.cpp_extension as ext
        def no_build(*args, **kwargs):
            raise AssertionError("compiled although a finished build was cached")
        ext.load = no_build
        from robe_torchrec.ops import cpu
        assert cpu.extension().openmp_enabled() in (True, False)
        print("loaded")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
