"""A TorchRec DLRM on RobeEmbeddingBagCollection through ``torch.export`` (strict and
non-strict), ``torch.export.save`` / ``load`` in a fresh process, and ``torchrec.fx`` tracing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchrec
from torch.export import Dim
from torchrec import KeyedJaggedTensor

from tests.test_drop_in import dense_input, make_dlrm, make_kjt

ROOT = Path(__file__).resolve().parents[1]

# the number of ids changes from batch to batch: the KJT's values are dynamic (its other
# fields, in KeyedJaggedTensor._fields order, keep their shapes: the batch size is fixed)
DYNAMIC_SHAPES = {
    "dense_features": None,
    "sparse_features": [{0: Dim.DYNAMIC}] + [None] * (len(KeyedJaggedTensor._fields) - 1),
}


def exported(strict: bool):
    torch.manual_seed(0)
    model = make_dlrm()
    ep = torch.export.export(model, (dense_input(), make_kjt()), dynamic_shapes=DYNAMIC_SHAPES,
                             strict=strict)
    return model, ep


@pytest.mark.parametrize("strict", [False, True])
def test_export_equals_eager(strict):
    model, ep = exported(strict)
    for seed in range(2):  # another batch of the same size, other lengths
        dense, kjt = dense_input(seed), make_kjt(seed)
        assert torch.equal(ep.module()(dense, kjt), model(dense, kjt))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "robe.forward.default" in ops


def test_saved_program_runs_in_a_fresh_process(tmp_path):
    model, ep = exported(strict=False)
    dense, kjt = dense_input(5), make_kjt(5)
    torch.export.save(ep, tmp_path / "dlrm.pt2")
    torch.save({"dense": dense, "keys": kjt.keys(), "values": kjt.values(),
                "lengths": kjt.lengths(), "expected": model(dense, kjt)}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch, torchrec
        import robe_torchrec  # registers the robe ops

        io = torch.load({str(tmp_path / "io.pt")!r})
        kjt = torchrec.KeyedJaggedTensor(keys=io["keys"], values=io["values"],
                                         lengths=io["lengths"])
        out = torch.export.load({str(tmp_path / "dlrm.pt2")!r}).module()(io["dense"], kjt)
        assert torch.equal(out, io["expected"]), (out, io["expected"])
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")


def test_torchrec_fx_symbolic_trace():
    torch.manual_seed(0)
    model = make_dlrm()
    traced = torchrec.fx.symbolic_trace(model)
    assert isinstance(traced, torch.fx.GraphModule)
    for seed in range(2):
        dense, kjt = dense_input(seed), make_kjt(seed)
        assert torch.equal(traced(dense, kjt), model(dense, kjt))
