"""Every ``sharding=`` option of the training app with its default embedding (ROBE-Z, one
shared array) either plans, shards and trains on 2 ranks, or is refused with a reason
(issue 31, item 3: ``sharding=row_wise`` always failed, the app's sharder did not offer
row-wise)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.multiprocess import run_ranks


def _option(rank: int, world: int, option: str):
    from robe_torchrec.data.synthetic import SyntheticCriteo
    from robe_torchrec.train.config import ConfigError
    from robe_torchrec.train.model import build_model, build_optimizer, shard
    from tests.train.helpers import compose

    option, _, unshared = option.partition("+")
    # per-table arrays large enough to give each rank a slice of a block at least (smaller
    # ones are refused row-wise by the sharder, naming the table)
    extra = ["embedding.shared=false", "embedding.compression=2",
             "data.cardinality_scale=0.01"] if unshared else []
    cfg = compose(f"sharding={option}", "data.num_sparse=4", *extra)
    assert cfg.embedding.kind == "robe"  # the default embedding
    assert cfg.embedding.shared != bool(unshared)
    data = SyntheticCriteo(batch_size=16, cardinality_scale=cfg.data.cardinality_scale,
                           num_sparse=cfg.data.num_sparse)
    model, _ = build_model(cfg, data.keys, data.cardinalities, torch.device("cpu"))
    try:
        dmp = shard(model, cfg, torch.device("cpu"))
    except ConfigError as err:
        return "refused", str(err)
    dense, _ = build_optimizer(cfg, dmp)
    losses = []
    for step in range(3):
        loss, _ = dmp(data.batch(step * world + rank))
        dense.zero_grad()
        loss.backward()
        dense.step()
        losses.append(loss.item())
    types = sorted({p.sharding_type for module in dmp.plan.plan.values()
                    for p in module.values()})
    return "trained", (types, losses)


# what each option gives with the default (shared) embedding
EXPECTED = {
    "auto": ["data_parallel"],
    "data_parallel": ["data_parallel"],
    "row_wise": ["row_wise"],  # failed: "No available sharding type and compute kernel ..."
    "row_wise+unshared": ["row_wise"],  # embedding.shared=false: failed alike
}


@pytest.mark.slow
@pytest.mark.parametrize("option", ["auto", "data_parallel", "row_wise", "row_wise+unshared",
                                    "table_wise"])
def test_every_sharding_option_with_the_default_embedding(option):
    for outcome, detail in run_ranks(_option, 2, option):
        if option in EXPECTED:
            assert outcome == "trained", detail
            types, losses = detail
            assert types == EXPECTED[option], types
            assert all(torch.isfinite(torch.tensor(losses))), losses
        else:
            # a shared array cannot be split by table: refused, with the reason and the fix
            assert outcome == "refused", detail
            assert "cannot be split by table" in detail and "embedding.shared=false" in detail
