"""``benchmarks/gpu_session.sh``, the one command a lent GPU machine runs, can only be run
there, and a GPU session is rare: a flag renamed in one of the scripts it calls, or a time
limit that outgrows the device tool's 600 s a command, would cost that session. Each Python
command of the script is parsed here by the argument parser of the module it names (without
running it), and its time limits are added up. A part its limit cuts short must still leave
what it did: gpu_check writes its report after every check and speed section."""

from __future__ import annotations

import argparse
import json
import importlib
import re
import shlex
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "benchmarks" / "gpu_session.sh"
#: the script's own bound, seconds: 8 minutes, under the device tool's 600 s a command and
#: leaving a session's 15 minutes room to run a part again on the same machine
SESSION_LIMIT = 480
#: what the script does outside its time-limited parts (pip, tar), seconds
UNLIMITED_PARTS = 20


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once the arguments parsed."""


def _logical_lines(text: str) -> List[str]:
    return text.replace("\\\n", " ").splitlines()


def _python_commands(text: str) -> List[Tuple[str, List[str]]]:
    """``(module, arguments)`` of every ``python3 -m benchmarks.X ...`` in the script, its
    shell variables replaced by stand-ins and its redirections dropped."""
    commands = []
    for line in _logical_lines(text):
        match = re.search(r"python3 -m (benchmarks\.[\w.]+)(.*)", line)
        if match is None:
            continue
        words = shlex.split(re.sub(r"\$\{?(\w+)\}?", r"STANDIN_\1", match.group(2)),
                            comments=True)
        args = []
        for word in words:
            if word[0] in "<>|&" or word[:2] in ("2>", "1>"):
                break
            args.append(word)
        commands.append((match.group(1), args))
    return commands


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SESSION)], check=True)
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_torchrec" / "wheels.sh")],
                   check=True)


@pytest.fixture
def parse_only(monkeypatch):
    """``ArgumentParser.parse_args`` raises :class:`_Parsed` once the arguments parsed, so a
    module's ``main`` stops there (argparse exits with status 2 on an unknown flag)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)


def test_every_python_command_parses(parse_only):
    commands = _python_commands(SESSION.read_text())
    assert {m for m, _ in commands} == {"benchmarks.gpu_check", "benchmarks.host_overhead",
                                        "benchmarks.gpu_torchrec.run"}, commands
    for module, args in commands:
        with pytest.raises(_Parsed):
            importlib.import_module(module).main(args)


def test_an_unknown_flag_is_seen(parse_only):
    with pytest.raises(SystemExit):
        importlib.import_module("benchmarks.gpu_check").main(["--no-such-flag"])


def test_the_time_limits_fit_one_device_call():
    limits = [int(n) for n in re.findall(r"\btimeout (\d+)", SESSION.read_text())]
    # gpu_check's speed, its checks, host_overhead, gpu_torchrec, ncu
    assert len(limits) == 5, limits
    assert sum(limits) + UNLIMITED_PARTS <= SESSION_LIMIT, limits


def test_the_script_leaves_at_most_six_files_in_its_output():
    """The device tool brings back eight files of a command's output folder at most: the
    reports go there, the logs and each report's .json into one archive."""
    text = SESSION.read_text()
    written = set(re.findall(r'"\$out/([\w.$]+)"', text))
    written |= {name for name in re.findall(r'pack "([\w.$]+)"', text)}
    assert len(written) <= 6, written
    for report in re.findall(r'--out "\$logs/([\w.$]+\.md)"', text):
        assert f'pack "{report}"' in text, report  # each report copied out after its part


def test_on_a_gpu_the_sync_and_graph_checks_run_before_anything_compiles(monkeypatch):
    """``torch._dynamo.reset()`` (the ``torch_compile`` check) loads Inductor's CUDA graph
    trees where CUDA is present, which turns count rows off for the process: the checks of
    count rows and answer copies must run before it, and first, in case time runs out."""
    from benchmarks import gpu_check
    from robe_torchrec.testing import gpu_checks, gpu_torchrec_checks, op_checks

    ran: List[str] = []

    def recorded(*names: str):
        return [(name, lambda n=name: ran.append(n)) for name in names]

    monkeypatch.setattr(op_checks, "triton_checks",
                        lambda device, quick: recorded("forward[case0]", "torch_compile"))
    monkeypatch.setattr(gpu_checks, "sync_and_graph_checks",
                        lambda: recorded("count_rows_on_streams", "answers_copied_together"))
    monkeypatch.setattr(gpu_checks, "matrix_checks", lambda n: recorded("matrix[0]"))
    monkeypatch.setattr(gpu_checks, "compiled_checks",
                        lambda: recorded("compiled_op_reduce_overhead"))
    monkeypatch.setattr(gpu_torchrec_checks, "torchrec_gpu_checks",
                        lambda: recorded("compiled_dlrm_reduce_overhead"))
    gpu_check.run_checks("cuda", quick=False, only=None, matrix=1)
    assert ran == ["count_rows_on_streams", "answers_copied_together", "forward[case0]",
                   "torch_compile", "compiled_op_reduce_overhead",
                   "compiled_dlrm_reduce_overhead", "matrix[0]"]


class _Killed(BaseException):
    """What a time limit does to the process, as far as the report is concerned: nothing
    after it runs (a check's own failure is an ``Exception``, reported and passed over)."""


def test_a_check_cut_short_still_leaves_its_report(tmp_path, monkeypatch):
    """gpu_check writes its report after every check and speed section: a time limit that
    kills it mid-run (here: during the second check) leaves what had run."""
    from benchmarks import gpu_check
    from robe_torchrec.testing import op_checks

    def killed():
        raise _Killed()

    monkeypatch.setattr(op_checks, "triton_checks", lambda device, quick: [
        ("forward[case0]", lambda: None), ("forward[case1]", killed)])
    out = tmp_path / "gpu_check_h100.md"
    with pytest.raises(_Killed):
        gpu_check.main(["--cpu", "--out", str(out)])
    text = out.read_text()
    assert "INCOMPLETE: written before the rest of the checks had run" in text
    assert "| forward[case0] | ok |" in text and "case1" not in text
    assert (tmp_path / "gpu_check_h100.json").exists()


def test_a_speed_section_cut_short_still_leaves_the_checks_and_sections_before(
        tmp_path, monkeypatch):
    from benchmarks import gpu_check, gpu_speed

    monkeypatch.setattr(gpu_check, "run_checks", lambda *a, **k: [
        {"name": "forward[case0]", "ok": True, "seconds": 0.5, "error": ""}])
    monkeypatch.setattr(gpu_speed, "run_scenario", lambda s, *a, **k: (
        [f"### {s.name}", "", "| row | ms |"], {"scenario": s.name}))

    def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(gpu_speed, "single_table", killed)
    out = tmp_path / "gpu_check.md"
    with pytest.raises(_Killed):
        gpu_check.main(["--cpu", "--out", str(out)])
    text = out.read_text()
    assert "INCOMPLETE: written before the rest of the speed section had run" in text
    assert "| forward[case0] | ok |" in text
    assert "### 1 id(s) a bag" in text and "### 20 id(s) a bag" in text


def test_the_torchrec_side_cut_short_still_leaves_the_parts_done(tmp_path, monkeypatch):
    from benchmarks.gpu_torchrec import run

    def killed(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(run, "part_shim", lambda device, sizes: {"summary": "shim fine"})
    monkeypatch.setattr(run, "part_pipelines", killed)
    out = tmp_path / "gpu_pipelines_h100.md"
    with pytest.raises(_Killed):
        run.main(["--cpu", "--out", str(out), "--commit", "test"])
    text = out.read_text()
    assert "shim fine" in text
    assert "INCOMPLETE: written before pipelines, overlap, sequence, app, compare had run" in text
    assert text.index("INCOMPLETE") < text.index("## Verdict")  # read before "passed"
    report = json.loads(out.with_suffix(".json").read_text())
    assert list(report["parts"]) == ["shim"] and report["not_run"][0] == "pipelines"


def test_checks_past_their_budget_are_listed_as_not_run(tmp_path, monkeypatch):
    """``--checks-budget``: once it has gone, the checks left are reported as not run
    (neither passed nor failed), and the speed section still runs after them."""
    from benchmarks import gpu_check
    from robe_torchrec.testing import op_checks

    clock = iter([0.0, 0.0, 5.0, 50.0, 50.0] + [60.0] * 1000)
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(op_checks, "triton_checks", lambda device, quick: [
        ("forward[case0]", lambda: None), ("forward[case1]", lambda: None),
        ("torch_compile", lambda: None)])
    out = tmp_path / "gpu_check_h100.md"
    status = gpu_check.main(["--cpu", "--skip-speed", "--checks-budget", "10",
                             "--out", str(out)])
    text = out.read_text()
    assert "1 of 1 passed; 2 not run (--checks-budget): forward[case1], torch_compile" in text
    assert "| forward[case1] | not run |" in text
    assert "INCOMPLETE: 2 checks not run (--checks-budget)" in text
    assert status == 1  # not a pass


def test_the_default_arguments_parse_to_what_the_check_uses():
    """Defaults bypass argparse's ``type``: a string default would reach the code as a
    string (the one-table sizes once did, and only a GPU run reads them)."""
    from benchmarks import gpu_check

    args = gpu_check.parse_args([])
    assert [int(n) for n in args.single_table] == [4_000_000, 32_000_000, 256_000_000]
    assert all(isinstance(n, float) for n in args.single_table)


def test_a_failed_check_leaves_its_traceback_and_no_state_behind(monkeypatch, capsys):
    """A check that raised may have left the sync debug mode on, a failed capture's stream
    current (``torch.cuda.graph`` leaves it so), or, compiled, Inductor's graph trees: all
    are put back before the next check, and the log gets the traceback (the report keeps
    one line). CUDA's calls stand in."""
    from benchmarks import gpu_check
    from robe_torchrec.testing import op_checks

    calls: List[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: calls.append(mode))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "capture stream")
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: "default stream")
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: calls.append(stream))
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("dynamo reset"))

    def failing():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(op_checks, "triton_checks", lambda device, quick: [
        ("compiled_thing", failing), ("next", lambda: calls.append("next ran"))])
    results = gpu_check.run_checks("cpu", quick=True, only=None, matrix=0)
    assert [r["ok"] for r in results] == [False, True]
    assert calls == ["default", "default stream", "dynamo reset", "next ran"]
    assert "in failing" in capsys.readouterr().out  # the traceback, with its frame
