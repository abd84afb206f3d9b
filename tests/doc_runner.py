"""Runs the docs' python blocks for tests/test_docs.py, each in its own forked process.

A block must run as if pasted into a script and run with ``python block.py``. Starting a fresh
interpreter per block would spend most of each block's time importing torch and torchrec, so
this process imports them once and forks a child per block: the child starts with those modules
loaded (as ``sys.modules`` entries, not names in the block's namespace) and otherwise runs the
file as ``__main__`` does, exit code and ``atexit`` handlers included.

Protocol, one line per block on stdin: ``<script>\\t<stdout file>\\t<stderr file>``; for each,
one line on stdout: ``pid <n>`` when the child starts, then ``rc <code>`` when it ends.
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import sys
import traceback

PRELOAD = ("torch", "torchrec", "robe_torchrec")


def _run_child(script: str, out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report whatever the block raised, as python would
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        script, out, err = line.rstrip("\n").split("\t")
        pid = os.fork()
        if pid == 0:
            _run_child(script, out, err)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"rc {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
