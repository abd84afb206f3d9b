"""The ops without torchrec or fbgemm_gpu (a bare GPU image has torch and Triton only): in a
fresh process whose import system refuses both, ``robe_torchrec`` imports, the names needing
torchrec raise an ImportError that says so, and ``benchmarks.gpu_check --cpu`` (the GPU proof
in Triton's interpreter: forward, gradients, fused optimizers and torch.compile of the Triton
kernels against the reference, then the speed rows) and ``benchmarks.host_overhead`` run to
their results, read from their JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: the start of a script run in a fresh process where torchrec and fbgemm_gpu cannot be
#: imported (a bare GPU image)
HIDE_TORCHREC = r"""
import importlib.abc, sys

class RefuseTorchrec(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, RefuseTorchrec())
"""

SCRIPT = HIDE_TORCHREC + r"""
import robe_torchrec
import robe_torchrec.ops
from robe_torchrec.ops import reference, triton_kernels

assert robe_torchrec.RobeConfig(compression=10).compression == 10
try:
    robe_torchrec.RobeEmbeddingBagCollection
except ImportError as exc:
    assert "needs torchrec" in str(exc), exc
else:
    raise AssertionError("RobeEmbeddingBagCollection without torchrec")
from benchmarks import gpu_check, host_overhead

code = gpu_check.main(["--cpu", "--out", sys.argv[1]])
host_overhead.main(["--reps", "1", "--calls", "1", "--batch", "8", "--out", sys.argv[2]])
hidden = sorted(m for m in sys.modules if m.split(".")[0] in ("torchrec", "fbgemm_gpu"))
assert not hidden, hidden
sys.exit(code)
"""


def test_ops_and_gpu_check_without_torchrec(tmp_path):
    out, host = tmp_path / "gpu_check_cpu.md", tmp_path / "host_overhead_cpu.md"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(host)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    check = json.loads(out.with_suffix(".json").read_text())
    assert check["device"].startswith("CPU")
    names = [c["name"] for c in check["checks"]]
    assert all(c["ok"] for c in check["checks"]), [c for c in check["checks"] if not c["ok"]]
    assert any("fused[adam]" in n for n in names) and any("torch_compile" in n for n in names)
    rows = {r["name"] for scenario in check["speed"] for r in scenario["rows"]}
    for row in ("full table, one lookup (+ in-place SGD rows)", "ROBE-Z Z=4 (+ fused SGD)",
                "pure-PyTorch ROBE-Z Z=4", "ROBE-Z Z=16 (+ fused Adagrad)",
                "floor: L2 block reads + pooling, Z=16", "floor: output write",
                "floor: F.embedding_bag of the same blocks, [M/Z, Z] table, Z=16"):
        assert row in rows, row
    assert [s["scenario"] for s in check["speed"]] == ["1 id(s) a bag", "20 id(s) a bag",
                                                       "one table"]
    assert "3 x nn.EmbeddingBag (+ sparse backward)" in rows  # the second peer
    assert any("launched via JITFunction.run" in row for row in rows), sorted(rows)
    one_table = {(r["table_rows"], r["name"]) for r in check["speed"][2]["rows"]}
    assert {(1000, "full table, one lookup (+ in-place SGD rows)"),
            (4000, "ROBE-Z 100x")} <= one_table
    assert "Z=4 forward / full-table forward" in {t["target"] for t in check["speed"][0]["targets"]}
    medians = json.loads(host.with_suffix(".json").read_text())["medians"]
    for row in ("op, no grad", "through the dispatcher twice", "wrapper, summary kernel",
                "pure Python: 1000 additions"):
        assert medians[row] > 0, row
