"""The ops without torchrec or fbgemm_gpu (a bare GPU image has torch and Triton only): in a
fresh process whose import system refuses both, ``robe_torchrec`` imports, the names needing
torchrec raise an ImportError that says so, and ``benchmarks.gpu_check --cpu`` (the GPU proof
in Triton's interpreter: forward, gradients, fused optimizers and torch.compile of the Triton
kernels against the reference, then the speed rows), ``benchmarks.triton_tiles --cpu`` and
``benchmarks.host_layers --cpu`` run to their results files."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.abc, sys

class RefuseTorchrec(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, RefuseTorchrec())
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
from benchmarks import gpu_check, host_layers, triton_tiles

code = gpu_check.main(["--cpu", "--out", sys.argv[1]])
code = code or triton_tiles.main(["--cpu", "--reps", "1", "--out", sys.argv[2]])
code = code or host_layers.main(["--cpu", "--reps", "1", "--calls", "1", "--out", sys.argv[3]])
hidden = sorted(m for m in sys.modules if m.split(".")[0] in ("torchrec", "fbgemm_gpu"))
assert not hidden, hidden
sys.exit(code)
"""


def test_ops_and_gpu_check_without_torchrec(tmp_path):
    out = tmp_path / "gpu_check_cpu.md"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    tiles, layers = tmp_path / "triton_tiles_cpu.md", tmp_path / "host_layers_cpu.md"
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(tiles), str(layers)],
                            cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    text = out.read_text()
    assert "device: CPU" in text and "FAILED" not in text
    for row in ("full table, one lookup", "26 x nn.EmbeddingBag", "ROBE-Z Z=4 (+ fused SGD)",
                "pure-PyTorch ROBE-Z Z=4", "ROBE-Z Z=16 (+ fused Adagrad)",
                "floor: L2 block reads + pooling, Z=16", "Z=4 forward / full-table forward",
                "One table (the paper's appendix setting)"):
        assert row in text, row
    checks = [line for line in text.splitlines() if line.startswith("| ") and "| ok |" in line]
    assert any("fused[adam]" in c for c in checks) and any("torch_compile" in c for c in checks)
    # the launch-shape benchmark: its breakdown, and every swept shape bitwise the default's
    tiles_text = tiles.read_text()
    assert "where the op's time goes" in tiles_text and "| short bags | " in tiles_text
    assert "| NO |" not in tiles_text
    # the host-layers benchmark: every layer's row
    layers_text = layers.read_text()
    for row in ("| registered op, no_grad |", "| through the dispatcher twice |",
                "| implementation |", "| pure Python: 1000 additions |"):
        assert row in layers_text, row
