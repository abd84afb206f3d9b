"""Run a command in a fresh Python process whose Triton compiles instead of interpreting:
the test process imported ``triton.language`` interpreted and cannot compile."""

import os
import subprocess
import sys
from typing import List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compiled(args: List[str], cache_dir) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root with ``TRITON_INTERPRET`` unset and an
    empty kernel cache in ``cache_dir`` (no cache hits); skips where Triton cannot compile
    for NVIDIA GPUs (which needs no GPU), fails on a non-zero exit."""
    import triton

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    if "cannot find" in result.stderr and "ptxas" in result.stderr:  # pragma: no cover
        pytest.skip("ptxas unavailable")
    assert result.returncode == 0, result.stderr[-4000:]
    return result
