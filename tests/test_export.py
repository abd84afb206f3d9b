"""A TorchRec DLRM on RobeEmbeddingBagCollection through ``torch.export`` (strict and
non-strict) with a dynamic batch size and number of ids (``robe_torchrec.export``),
``torch.export.save`` / ``load`` in a fresh process serving other batch sizes, and
``torchrec.fx`` tracing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchrec
from torchrec import KeyedJaggedTensor

from robe_torchrec.export import export_model, load_program
from tests.test_drop_in import BATCH, NUM_DENSE, dense_input, make_dlrm, make_kjt

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["user", "user_hist", "item"]


def batch_of(size: int, seed: int, ids: bool = True):
    """Dense features and a KJT of ``size`` samples (without any id if not ``ids``)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * size,), generator=g) * int(ids)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    return (torch.rand(size, NUM_DENSE, generator=g),
            KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths))


#: (batch size, seed, with ids): the example's size with other lengths, larger, one
#: sample, and a batch without ids
SERVED = [(BATCH, 1, True), (7, 2, True), (1, 3, True), (3, 4, False)]


def exported(strict: bool):
    torch.manual_seed(0)
    model = make_dlrm()
    return model, export_model(model, dense_input(), make_kjt(), strict=strict)


@pytest.mark.parametrize("strict", [False, True])
def test_export_serves_any_batch_size_like_eager(strict):
    model, ep = exported(strict)
    for size, seed, ids in SERVED:
        dense, kjt = batch_of(size, seed, ids)
        out = ep.module()(dense, kjt)
        assert out.shape == (size, 1) and torch.equal(out, model(dense, kjt)), (size, ids)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "robe.forward.default" in ops


def test_export_refuses_what_has_no_batch_to_generalise():
    model = make_dlrm()
    dense, kjt = batch_of(1, 0)
    with pytest.raises(ValueError, match="two or more"):
        export_model(model, dense, kjt)
    dense, kjt = batch_of(3, 0)
    with pytest.raises(ValueError, match="do not make one batch"):
        export_model(model, dense[:2], kjt)


def test_saved_program_runs_in_a_fresh_process(tmp_path):
    model, ep = exported(strict=False)
    torch.export.save(ep, tmp_path / "dlrm.pt2")
    served = []
    for size, seed, ids in SERVED[1:3]:  # batch sizes other than the example's
        dense, kjt = batch_of(size, seed, ids)
        served.append({"dense": dense, "keys": kjt.keys(), "values": kjt.values(),
                       "lengths": kjt.lengths(), "expected": model(dense, kjt)})
    torch.save(served, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch, torchrec
        import robe_torchrec  # registers the robe ops

        program = torch.export.load({str(tmp_path / "dlrm.pt2")!r}).module()
        for io in torch.load({str(tmp_path / "io.pt")!r}):
            kjt = torchrec.KeyedJaggedTensor(keys=io["keys"], values=io["values"],
                                             lengths=io["lengths"])
            out = program(io["dense"], kjt)
            assert torch.equal(out, io["expected"]), (out, io["expected"])
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
    # torch.export.load read the program's KJT example inputs without falling back to a
    # full unpickle (which logs a traceback)
    assert "Traceback" not in done.stderr and "Unsupported global" not in done.stderr, done.stderr[-4000:]


def test_torchrec_fx_symbolic_trace():
    torch.manual_seed(0)
    model = make_dlrm()
    traced = torchrec.fx.symbolic_trace(model)
    assert isinstance(traced, torch.fx.GraphModule)
    for seed in range(2):
        dense, kjt = dense_input(seed), make_kjt(seed)
        assert torch.equal(traced(dense, kjt), model(dense, kjt))


INT_DTYPES = [(v, ln) for v in (torch.int32, torch.int64) for ln in (torch.int32, torch.int64)]


def _with_dtypes(kjt: KeyedJaggedTensor, values: torch.dtype, lengths: torch.dtype,
                 offsets: bool = False) -> KeyedJaggedTensor:
    if offsets:
        return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().to(values),
                                 offsets=kjt.offsets().to(lengths))
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().to(values),
                             lengths=kjt.lengths().to(lengths))


@pytest.mark.parametrize("example", INT_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
def test_program_serves_int32_and_int64_ids_and_lengths(tmp_path, example):
    """Exported on one pair of dtypes (the app's: int64 ids, int32 lengths), the program
    serves every pair, also once saved and loaded, like the eager model; likewise a program
    exported on offsets serves int32 and int64 offsets."""
    torch.manual_seed(0)
    model = make_dlrm()
    dense, kjt = batch_of(5, 0)
    program = export_model(model, dense, _with_dtypes(kjt, *example))
    torch.export.save(program, tmp_path / "p.pt2")
    loaded = torch.export.load(tmp_path / "p.pt2")
    for values, lengths in INT_DTYPES:
        for size, seed, ids in SERVED:
            d, k = batch_of(size, seed, ids)
            client = _with_dtypes(k, values, lengths)
            for p in (program, loaded):
                assert torch.equal(p.module()(d, client), model(d, k)), (values, lengths, size)
    with_offsets = export_model(model, dense, _with_dtypes(kjt, *example, offsets=True))
    for values, offsets in INT_DTYPES:
        d, k = batch_of(4, 7)
        assert torch.equal(with_offsets.module()(d, _with_dtypes(k, values, offsets, True)),
                           model(d, k))


class _SequenceModel(torch.nn.Module):
    """A RobeEmbeddingCollection (features on one array: the keys layout) and its rows."""

    def __init__(self):
        super().__init__()
        from robe_torchrec import RobeConfig, RobeEmbeddingCollection
        from tests.test_embedding_collection import ec_tables

        self.ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = self.ec(kjt)
        return torch.cat([out[key].values() for key in ("f0", "f_extra", "f1", "t2")])


def _sequence_batch(lengths, seed: int) -> KeyedJaggedTensor:
    lengths = torch.tensor(lengths)
    ids = torch.randint(0, 9, (int(lengths.sum()),), generator=torch.Generator().manual_seed(seed))
    return KeyedJaggedTensor(keys=["f0", "f_extra", "f1", "t2"], values=ids, lengths=lengths)


@pytest.mark.parametrize("strict", [False, True])
def test_a_sequence_model_exports_saves_and_serves_other_splits(strict, tmp_path):
    """A sequence model exports, strict or not, with its ids made keys by
    ``robe::unpooled_keys``; saved and loaded, the program gives eager's rows for the
    example and for a batch whose features split the ids otherwise."""
    model = _SequenceModel()
    example = _sequence_batch([1, 2, 0, 1, 3, 0, 1, 1], seed=0)
    program = torch.export.export(model, (example,), strict=strict)
    assert any("unpooled_keys" in str(node.target) for node in program.graph.nodes)
    torch.export.save(program, tmp_path / "sequence.pt2")
    served = load_program(tmp_path / "sequence.pt2").module()  # as a server loads it
    for lengths, seed in (([1, 2, 0, 1, 3, 0, 1, 1], 0), ([0, 0, 2, 2, 1, 1, 2, 1], 1)):
        assert torch.equal(served(_sequence_batch(lengths, seed)),
                           model(_sequence_batch(lengths, seed)))
