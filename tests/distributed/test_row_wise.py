"""ROW_WISE semantics, tested exactly: rank ``r`` owns slice ``r`` of a table's ROBE array
(``world`` equal slices, remainder to the last) and the rows of its block
(``ceil(num_embeddings / world)`` rows, as TorchRec's input dist buckets them) hash, with
their global row as key, into that slice only. So a row-wise module equals the reference
below (an unsharded computation over the same flat array); on one rank, the unsharded module."""

from __future__ import annotations

import math

import pytest
import torch

from robe_torchrec import RobeConfig
from robe_torchrec.distributed.sharder import rw_rows, rw_slices
from robe_torchrec.hashing import hash_params
from robe_torchrec.ops.meta import build_table_meta
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

STEPS = 20


def row_wise_reference(ebc, weight: torch.Tensor, kjt, world: int,
                       features=tuple(common.FEATURES)) -> torch.Tensor:
    """Pooled output ``[batch, sum dims]`` (``features``, in that order) of a module whose
    tables are all row-wise over ``world`` ranks, differentiable in ``weight``. ``ebc`` may
    be a RobeEmbeddingCollection: its tables are then pooled by SUM."""
    # written from the config, not read from ebc.layout: the layout is what is under test
    tables = (ebc.embedding_bag_configs() if hasattr(ebc, "embedding_bag_configs")
              else ebc.embedding_configs())
    robe = ebc.layout.config
    array_sizes = robe.split_memory([t.num_embeddings * t.embedding_dim for t in tables])
    offsets = [sum(array_sizes[:i]) for i in range(len(array_sizes))]
    row_offsets = [sum(t.num_embeddings for t in tables[:i]) for i in range(len(tables))]
    by_feature = {f: t for t, tb in enumerate(tables) for f in tb.feature_names}
    params = hash_params(robe.hash_mode, robe.seed)
    outs = []
    for f in features:
        t = by_feature[f]
        cfg = tables[t]
        a = 0 if robe.shared else t
        jt = kjt[f]
        ids, lengths = jt.values(), jt.lengths()
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        block = math.ceil(cfg.num_embeddings / world)
        pooled = 0
        for r in range(world):
            start, rows = rw_rows(cfg.num_embeddings, world, r)
            off, size = rw_slices(array_sizes[a], world)[r]
            mine = (ids // block) == r
            local = ids[mine] - start
            lens = torch.bincount(bag[mine], minlength=lengths.numel())
            meta = build_table_meta([cfg.embedding_dim], [offsets[a] + off], [size],
                                    [(row_offsets[t] if robe.shared else 0) + start],
                                    [rows], [0])
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
            pooled = pooled + torch.ops.robe.forward(
                weight, local, offs, None, meta, cfg.embedding_dim, robe.block_size,
                int(robe.hash_mode), params, 0)
        if getattr(cfg, "pooling", None) is not None and cfg.pooling.name == "MEAN":
            pooled = pooled / lengths.clamp(min=1)[:, None]
        outs.append(pooled)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("shared", [False, True])
def test_reference_on_one_rank_is_the_unsharded_module(shared):
    ebc = common.make_ebc(RobeConfig(compression=10, block_size=4, shared=shared))
    kjt = common.global_batch(0, 2)
    ref = row_wise_reference(ebc, ebc.weight, kjt, 1)
    out = ebc(kjt).to_dict()
    assert torch.allclose(ref, torch.cat([out[f] for f in common.FEATURES], 1), atol=1e-6)
    # and over 2 ranks it is another function of the same array
    assert not torch.allclose(ref, row_wise_reference(ebc, ebc.weight, kjt, 2), atol=1e-3)


CASES = {
    "rw_shared": (RobeConfig(compression=10, block_size=4, shared=True),
                  {"t0": "row_wise", "t1": "row_wise", "t2": "row_wise"}),
    "rw_tables": (RobeConfig(compression=10, block_size=4, shared=False),
                  {"t0": "row_wise", "t1": "row_wise", "t2": "row_wise"}),
}


def _run(rank: int, world: int, name: str):
    robe, types = CASES[name]
    dmp = common.make_dmp(robe, types, world, optimizer=(torch.optim.Adagrad, {"lr": 0.1}))
    ebc = common.make_ebc(robe)
    weight = ebc.weight.detach().clone().requires_grad_(True)
    opt = torch.optim.Adagrad([weight], lr=0.1)
    assert torch.equal(common.full_weight(dmp), weight.detach())
    worst_out = worst_w = 0.0
    for step in range(STEPS):
        kjt = common.global_batch(step, world)
        tgt = common.target(step, world * common.B, 24)
        lo, hi = rank * common.B, (rank + 1) * common.B
        out = dmp(common.local_slice(kjt, rank))
        (0.5 * ((out - tgt[lo:hi]) ** 2).sum()).backward()
        ref = row_wise_reference(ebc, weight, kjt, world)
        worst_out = max(worst_out, (out.detach() - ref[lo:hi].detach()).abs().max().item())
        (0.5 * ((ref - tgt) ** 2).sum() / world).backward()  # rank-averaged, as TorchRec
        opt.step()
        opt.zero_grad()
        worst_w = max(worst_w, (common.full_weight(dmp) - weight.detach()).abs().max().item())
    return worst_out, worst_w


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_row_wise_matches_its_reference(name):
    for worst_out, worst_w in run_ranks(_run, 2, name):
        assert worst_out <= 1e-5 and worst_w <= 1e-5, (name, worst_out, worst_w)
