"""FP16 / BF16 ROBE arrays: the weight is stored in the tables' data_type, the kernels
accumulate in float32 and return float32, optimizer state stays float32; unsharded and
sharded (data-parallel, table-wise) modules."""

from __future__ import annotations

import copy
import io
from typing import List

import pytest
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.layout import RobeLayout
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

ROBE = RobeConfig(compression=10, block_size=4, shared=False)
DTYPES = {DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


def _tables(data_type: DataType) -> List[EmbeddingBagConfig]:
    tables = common.tables()
    for t in tables:
        t.data_type = data_type
    return tables


def _ebc(data_type: DataType, robe: RobeConfig = ROBE, seed: int = 0) -> RobeEmbeddingBagCollection:
    torch.manual_seed(seed)
    return RobeEmbeddingBagCollection(_tables(data_type), robe)


def _loss(ebc, step: int) -> torch.Tensor:
    kjt = common.global_batch(step, 2)
    out = ebc(kjt).values()
    tgt = common.target(step, 2 * common.B, ebc.layout.output_dim)
    return 0.5 * ((out - tgt) ** 2).sum()


@pytest.mark.parametrize("data_type", list(DTYPES))
def test_weight_dtype_and_forward_equals_fp32_of_the_same_values(data_type):
    ebc = _ebc(data_type)
    assert ebc.layout.weight_dtype == DTYPES[data_type]
    assert ebc.weight.dtype == DTYPES[data_type]
    ref = common.make_ebc(ROBE)
    with torch.no_grad():
        ref.weight.copy_(ebc.weight.float())
    for step in range(3):
        kjt = common.global_batch(step, 2)
        out, expected = ebc(kjt).values(), ref(kjt).values()
        assert out.dtype == torch.float32
        # the kernels read the half values and accumulate in float32, as the fp32 module does
        assert torch.equal(out, expected)


@pytest.mark.parametrize("data_type", list(DTYPES))
def test_fused_adagrad_trains_with_float32_state(data_type):
    ebc = _ebc(data_type)
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.05})
    losses = []
    for _ in range(10):
        loss = _loss(ebc, 0)
        loss.backward()
        losses.append(loss.item())
    assert ebc.weight.dtype == DTYPES[data_type] and ebc.weight.grad is None
    assert ebc.fused_optimizer.param_state["sum"].dtype == torch.float32
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("data_type", list(DTYPES))
def test_dense_sgd_trains(data_type):
    ebc = _ebc(data_type)
    opt = torch.optim.SGD(ebc.parameters(), lr=0.1)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = _loss(ebc, 0)
        loss.backward()
        assert ebc.weight.grad.dtype == DTYPES[data_type]
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("data_type", list(DTYPES))
def test_state_dict_round_trips_in_the_half_dtype(data_type):
    ebc = _ebc(data_type)
    buffer = io.BytesIO()
    torch.save(ebc.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    assert state["weight"].dtype == DTYPES[data_type]
    other = _ebc(data_type, seed=1)
    assert not torch.equal(other.weight, ebc.weight)
    other.load_state_dict(state)
    assert other.weight.dtype == DTYPES[data_type]
    assert torch.equal(other.weight, ebc.weight)


def test_mixed_data_types_are_refused():
    tables = _tables(DataType.FP16)
    tables[1].data_type = DataType.FP32
    with pytest.raises(ValueError, match="must share one data_type.*'t1': FP32"):
        RobeLayout.build(tables, ROBE)


def test_other_data_types_are_refused():
    with pytest.raises(ValueError, match="FP32, FP16 or BF16"):
        RobeLayout.build(_tables(DataType.INT8), ROBE)


# --- sharded -------------------------------------------------------------------------------

SHARDED = {
    "data_parallel": {"t0": "data_parallel", "t1": "data_parallel", "t2": "data_parallel"},
    "table_wise": {"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"},
}
OPT = (torch.optim.Adagrad, {"lr": 0.05})


def _sharded_fp16(rank: int, world: int, plan: str):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    import torch.distributed as dist
    from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder

    ebc = _ebc(DataType.FP16)
    ref = copy.deepcopy(ebc)
    apply_optimizer_in_backward(OPT[0], [ebc.weight], OPT[1])
    apply_optimizer_in_backward(OPT[0], [ref.weight], OPT[1])
    sharder = RobeEmbeddingBagCollectionSharder()
    splan = ShardingPlan({"ebc": common.plan_for(ebc, SHARDED[plan], world, sharder,
                                                 {"t0": 0, "t1": 1, "t2": 0})})
    dmp = DistributedModelParallel(common.Wrapper(ebc),
                                   env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=splan, sharders=[sharder])
    assert dmp.state_dict()["ebc.weight"].dtype == torch.float16
    worst_out = 0.0
    for step in range(2):
        worst_out = max(worst_out, common.sharded_and_unsharded_step(dmp, ref, rank, world, step))
    weight = common.full_weight(dmp)
    diff = (weight - ref.weight.float()).abs().max().item()
    moved = (ref.weight.float() - _ebc(DataType.FP16).weight.float()).abs().max().item()
    return worst_out, diff, moved


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(SHARDED))
def test_sharded_fp16_matches_unsharded_fp16(plan):
    for worst_out, diff, moved in run_ranks(_sharded_fp16, 2, plan):
        assert moved > 1e-3
        assert worst_out <= 1e-5, worst_out
        # a float32 difference in the averaged gradient may round to the neighbouring half
        assert diff <= 1e-4, diff
