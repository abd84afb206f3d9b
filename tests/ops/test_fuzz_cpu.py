"""The ops against hand-built adversarial metadata: a clean ValueError every time, never a signal.

The cases live in :mod:`tests.ops.fuzz_ops` and run in one child process (all backends and
cases in it), so a kernel that crashes fails the test with the case it crashed on instead of
killing pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fuzz(*args: str, env: Dict[str, str] | None = None, timeout: int = 120) -> List[dict]:
    """Run the fuzz child; fail naming the signal and the last case if it did not exit 0."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), child_env.get("PYTHONPATH", "")])
    child_env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-m", "tests.ops.fuzz_ops", *args], cwd=ROOT,
                          env=child_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        started = [line for line in proc.stderr.splitlines() if line.strip()]
        how = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        last_case = next((line for line in reversed(started) if line.count(" ") == 2), "?")
        # a sanitizer's report ends in a legend: keep its headline and summary
        report = [line for line in started if "ERROR: AddressSanitizer" in line or
                  line.startswith("SUMMARY:")]
        pytest.fail(f"fuzz child ended with {how} during case {last_case!r}; stderr tail:\n"
                    + "\n".join(report + started[-15:]))
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _check(records: List[dict]) -> None:
    assert records, "the fuzz child ran no case"
    problems = []
    for r in records:
        if "case" not in r:
            continue
        where = f"{r['backend']} {r['case']} {r['op']}"
        if r["outcome"] not in ("ok", "ValueError"):
            problems.append(f"{where}: {r['outcome']} {r['message']}")
        elif r["bad"] and r["outcome"] != "ValueError":
            problems.append(f"{where}: accepted")
        elif r["outcome"] == "ValueError" and not r["message"].startswith("robe:"):
            problems.append(f"{where}: message {r['message']!r} does not start with 'robe:'")
        elif r.get("reference", r["outcome"]) != r["outcome"]:
            problems.append(f"{where}: {r['outcome']} but reference {r['reference']} "
                            f"({r['message']})")
        elif r.get("reference_message", r["message"]) != r["message"]:
            problems.append(f"{where}: message {r['message']!r} but reference's "
                            f"{r['reference_message']!r}")
    assert not problems, "\n".join(problems)


def test_ops_refuse_adversarial_metadata():
    # ~60 targeted defects x the four ops on each backend, then 150 random mutations on the
    # C++ ops, whose forward must end as the reference's does (ok, or ValueError with the
    # same message); one child process pays the imports once
    records = _fuzz("--backends", "cpp,reference,triton", "--random", "150",
                    "--compare-reference")
    _check(records)
    seen = {(r["backend"], r["case"]) for r in records}
    for backend in ("cpp", "reference", "triton"):
        assert {(backend, "out_offset_plus_dim_wraps"), (backend, "w_offset_plus_w_size_wraps"),
                (backend, "bounds_check_7"), (backend, "pooling_7")} <= seen
    assert ("cpp", "random_149") in seen


def _asan_runtime() -> List[str]:
    """libasan and libstdc++ to preload into python (libstdc++ first loaded after ASan breaks
    its exception interceptor: 'CHECK failed: asan_interceptors.cpp ... real___cxa_throw')."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if compiler is None:
        return []
    libs = []
    for name in ("libasan.so", "libstdc++.so"):
        path = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True,
                              text=True).stdout.strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            return []
        libs.append(os.path.realpath(path))
    return libs


@pytest.mark.slow
def test_cpp_ops_under_address_sanitizer():
    """The same cases with the kernels built with -fsanitize=address: an out-of-bounds read or
    write that happens not to crash is still reported (and aborts the child). The first run
    builds the sanitized kernels (minutes); later runs load them from the build cache."""
    libs = _asan_runtime()
    if not libs:
        pytest.skip("no g++ with libasan.so / libstdc++.so to preload")
    env = dict(os.environ, LD_PRELOAD=" ".join(libs),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1")
    records = _fuzz("--backends", "cpp", "--random", "60", "--asan", env=env, timeout=1200)
    assert any("asan_build" in r for r in records)
    _check(records)
