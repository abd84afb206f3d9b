"""Sharding RobeEmbeddingCollection next to RobeEmbeddingBagCollection (2 ranks, gloo, one
spawn for everything): sharded == unsharded after 20 SGD steps (data-parallel and
table-wise), the unpooled module row-wise against the row-wise reference (and through a
DCP round trip), a DCP checkpoint moved between plans and into the unsharded model, the pipelines (SparseDist,
FusedSparseDist == the plain loop; SemiSync trains), VBE input to both sharded modules (the
bag module's KeyedTensor against stock TorchRec's sharded EmbeddingBagCollection), the
planner's compressed sizes and the default sharders."""

from __future__ import annotations

import copy
import tempfile
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.optim import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from robe_torchrec import RobeConfig, RobeEmbeddingCollection
from robe_torchrec.distributed import (
    RobeEmbeddingBagCollectionSharder,
    RobeEmbeddingCollectionSharder,
    ShardedRobeEmbeddingCollection,
    get_default_sharders,
)
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

B = common.B
SEQ = {"hist": 1000, "cat_hist": 50}
KEYS = common.FEATURES + list(SEQ)
DIM = 4


def ec_tables() -> List[EmbeddingConfig]:
    return [EmbeddingConfig(name="items", embedding_dim=DIM, num_embeddings=SEQ["hist"],
                            feature_names=["hist"]),
            EmbeddingConfig(name="cats", embedding_dim=DIM, num_embeddings=SEQ["cat_hist"],
                            feature_names=["cat_hist"])]


@torch.fx.wrap  # a leaf for the pipelines' tracer: it reads lengths
def sequence_sums(jt: JaggedTensor) -> torch.Tensor:
    """``[bags, DIM]``: the sum of each bag's embeddings."""
    lengths = jt.lengths()
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return torch.zeros(lengths.numel(), DIM).index_add(0, rows, jt.values())


class TwoModules(nn.Module):
    """A ROBE bag module and a ROBE unpooled module on one KJT, a linear head; forward(Batch)
    -> (loss, (loss, logits)) as TorchRec's pipelines expect (they return the second)."""

    def __init__(self, robe: RobeConfig) -> None:
        super().__init__()
        self.ebc = common.make_ebc(robe, seed=0)
        torch.manual_seed(1)
        self.ec = RobeEmbeddingCollection(ec_tables(), robe)
        self.head = nn.Linear(24 + 2 * DIM, 1)
        with torch.no_grad():
            self.head.weight.fill_(0.1)
            self.head.bias.zero_()

    def forward(self, batch: Batch):
        kjt = batch.sparse_features
        pooled = self.ebc(kjt).to_dict()
        seq = self.ec(kjt)
        x = torch.cat([pooled[f] for f in common.FEATURES]
                      + [sequence_sums(seq[f]) for f in SEQ], dim=1)
        logits = self.head(x).squeeze(1)
        loss = 0.5 * ((logits - batch.labels) ** 2).sum() * batch.dense_features[0, 0]
        return loss, (loss.detach(), logits)


def global_batch(step: int, world: int) -> KeyedJaggedTensor:
    bag = common.global_batch(step, world)
    g = torch.Generator().manual_seed(7000 + step)
    lengths = [torch.randint(0, 5, (world * B,), generator=g) for _ in SEQ]
    values = [torch.randint(0, rows, (int(n.sum()),), generator=g)
              for n, rows in zip(lengths, SEQ.values())]
    return KeyedJaggedTensor.from_lengths_sync(
        KEYS, torch.cat([bag.values()] + values), torch.cat([bag.lengths()] + lengths))


def batch_of(step: int, world: int, rank: int, scale: float) -> Batch:
    """Rank ``rank``'s samples of the global batch (``rank=-1``: all of them), the loss
    scaled by ``scale``."""
    kjt = global_batch(step, world)
    labels = common.target(step, world * B, 1)[:, 0]
    if rank >= 0:
        kjt, labels = common.local_slice(kjt, rank), labels[rank * B:(rank + 1) * B]
    return Batch(dense_features=torch.full((len(labels), 1), scale), sparse_features=kjt,
                 labels=labels)


def make_model(robe: RobeConfig, lr: float = 0.05) -> TwoModules:
    model = TwoModules(robe)
    for m in (model.ebc, model.ec):
        apply_optimizer_in_backward(torch.optim.SGD, [m.weight], {"lr": lr})
    return model


def shard(model: TwoModules, types: Dict[str, str], world: int):
    bag, seq = RobeEmbeddingBagCollectionSharder(), RobeEmbeddingCollectionSharder()
    plan = ShardingPlan({
        "ebc": common.plan_for(model.ebc, {t: types[t] for t in ("t0", "t1", "t2")}, world, bag),
        "ec": common.plan_for(model.ec, {t: types[t] for t in ("items", "cats")}, world, seq),
    })
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=plan, sharders=[bag, seq])


def dense_sgd(model: nn.Module) -> torch.optim.Optimizer:
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return torch.optim.SGD([p for _, p in in_backward_optimizer_filter(model.named_parameters())],
                           lr=0.05)


def weights(dmp) -> Dict[str, torch.Tensor]:
    sd = dmp.state_dict()
    return {k: common.full_tensor(sd[k]) for k in sorted(sd)
            if k.endswith("weight") or k.endswith("bias")}


def _unwrap_keys(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k.replace("_dmp_wrapped_module.", "").replace("module.", ""): v
            for k, v in state.items()}


def sharded_equals_unsharded(rank: int, world: int, robe: RobeConfig, types: Dict[str, str],
                             steps: int) -> float:
    """Worst difference of outputs and final weights, sharded vs unsharded, over ``steps``."""
    ref = make_model(robe)
    ref_opt = torch.optim.SGD(ref.head.parameters(), lr=0.05)
    dmp = shard(make_model(robe), types, world)
    opt = dense_sgd(dmp)
    worst = 0.0
    for step in range(steps):
        loss, (_, logits) = dmp(batch_of(step, world, rank, 1.0))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss, (_, ref_logits) = ref(batch_of(step, world, -1, 1.0 / world))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, (logits.detach() - ref_logits.detach()[rank * B:(rank + 1) * B])
                    .abs().max().item())
    ours = _unwrap_keys(weights(dmp))
    for key, value in ref.state_dict().items():
        if key.endswith("weight") or key.endswith("bias"):
            worst = max(worst, (ours[key] - value).abs().max().item())
    return worst


def checkpoint_moves(rank: int, world: int, path: str) -> float:
    """DCP: save a table-wise model after 2 steps, load it into a data-parallel one and
    into the unsharded model; the largest difference of their weights."""
    robe = RobeConfig(memory_size=4000, block_size=4, shared=False)
    tw = shard(make_model(robe), {n: "table_wise" for n in
                                  ("t0", "t1", "t2", "items", "cats")}, world)
    for step in range(2):
        tw(batch_of(step, world, rank, 1.0))[0].backward()
    dcp.save(tw.state_dict(), checkpoint_id=path)
    dp = shard(make_model(RobeConfig(memory_size=4000, block_size=4, shared=False)),
               {n: "data_parallel" for n in ("t0", "t1", "t2", "items", "cats")}, world)
    state = dp.state_dict()
    dcp.load(state, checkpoint_id=path)
    dp.load_state_dict(state)
    saved, loaded = weights(tw), weights(dp)
    worst = max((saved[k] - loaded[k]).abs().max().item() for k in saved)
    # the unsharded model reads the assembled arrays
    plain = make_model(robe)
    # the arrays alone: their layout is the one this model was built with (the documented
    # opt-in for a state dict without robe_layout)
    layouts = {k: v for k, v in plain.state_dict().items() if k.endswith("robe_layout")}
    plain.load_state_dict({**_unwrap_keys(saved), **layouts}, strict=False)
    for key, value in _unwrap_keys(saved).items():
        worst = max(worst, (plain.state_dict()[key] - value).abs().max().item())
    return worst


def pipelines_match(rank: int, world: int) -> Dict[str, object]:
    """Final weights of SparseDist and FusedSparseDist vs the plain loop (largest
    difference), and SemiSync's losses."""
    from robe_torchrec.pipelines import make_pipeline, run_to_end

    robe = RobeConfig(memory_size=4000, block_size=4, shared=False)
    types = {"t0": "table_wise", "t1": "data_parallel", "t2": "table_wise",
             "items": "table_wise", "cats": "data_parallel"}
    out: Dict[str, object] = {}
    results = {}
    for name in ("plain", "sparse_dist", "fused_sparse_dist", "semi_sync"):
        dmp = shard(make_model(robe), types, world)
        options = {"start_batch": 2} if name == "semi_sync" else {}
        pipeline = make_pipeline(name, dmp, dense_sgd(dmp), torch.device("cpu"), **options)
        losses: List[float] = []
        run_to_end(pipeline, iter([batch_of(s % 3, world, rank, 1.0) for s in range(8)]),
                   lambda o: losses.append(float(o[0].detach())))
        results[name] = (weights(dmp), losses)
    plain = results["plain"][0]
    for name in ("sparse_dist", "fused_sparse_dist"):
        out[name] = max((results[name][0][k] - plain[k]).abs().max().item() for k in plain)
    out["semi_sync_losses"] = results["semi_sync"][1]
    out["plain_losses"] = results["plain"][1]
    return out


def seq_vbe_kjt(rank: int) -> KeyedJaggedTensor:
    """Rank ``rank``'s VBE KJT of the sequence features (strides 3 and 5, inverse indices
    of width 6)."""
    g = torch.Generator().manual_seed(11 + rank)
    strides = [3, 5]
    lengths = [torch.randint(0, 4, (s,), generator=g) for s in strides]
    values = torch.cat([torch.randint(0, SEQ[k], (int(n.sum()),), generator=g)
                        for k, n in zip(SEQ, lengths)])
    inverse = torch.stack([torch.randint(0, s, (6,), generator=g) for s in strides])
    return KeyedJaggedTensor(keys=list(SEQ), values=values, lengths=torch.cat(lengths),
                             stride_per_key_per_rank=[[s] for s in strides],
                             inverse_indices=(list(SEQ), inverse))


def vbe_matches(rank: int, world: int) -> float:
    """A VBE KJT into the sharded unpooled module (table-wise and data-parallel) vs the
    unsharded module laid out as TorchRec's sharded EmbeddingCollection lays VBE out: the
    largest difference, lengths checked."""
    torch.manual_seed(3)
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=3000, block_size=4,
                                                         shared=False))
    apply_optimizer_in_backward(torch.optim.SGD, [ec.weight], {"lr": 0.1})
    ref = copy.deepcopy(ec)
    sharder = RobeEmbeddingCollectionSharder()
    plan = ShardingPlan({"": common.plan_for(ec, {"items": "table_wise", "cats": "data_parallel"},
                                             world, sharder)})
    dmp = DistributedModelParallel(ec, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    kjt = seq_vbe_kjt(rank)
    inverse = kjt.inverse_indices()[1]
    ours, theirs = dmp(kjt), ref(kjt)
    worst = 0.0
    for i, k in enumerate(SEQ):
        # TorchRec's sharded EmbeddingCollection expands each feature's bags by its
        # inverse indices (the unsharded one does not): the reference does the same
        offsets = theirs[k].offsets()
        bags = [theirs[k].values()[offsets[b]:offsets[b + 1]] for b in inverse[i].tolist()]
        assert torch.equal(ours[k].lengths(), theirs[k].lengths()[inverse[i]]), k
        worst = max(worst, (ours[k].values() - torch.cat(bags)).abs().max().item())
    return worst


def bag_vbe_kjt(rank: int, weighted: bool, width: int = 0) -> KeyedJaggedTensor:
    """Rank ``rank``'s VBE KJT of the bag module's features: per-feature strides differ
    between the ranks, and so does the inverse indices' width unless ``width`` is given; the
    sum over features of stride x dim does not (48 floats: row-wise on gloo needs it, see
    row_wise_vbe_on_gloo)."""
    strides = [[2, 3, 3, 1], [3, 1, 1, 2]][rank % 2]
    width = width or [5, 3][rank % 2]
    g = torch.Generator().manual_seed(40 + rank)
    lengths = [torch.randint(0, 4, (s,), generator=g) for s in strides]
    values = torch.cat([torch.randint(0, common.ROWS[f], (int(n.sum()),), generator=g)
                        for f, n in zip(common.FEATURES, lengths)])
    inverse = torch.stack([torch.randint(0, s, (width,), generator=g) for s in strides])
    return KeyedJaggedTensor(
        keys=common.FEATURES, values=values, lengths=torch.cat(lengths),
        weights=torch.rand(values.numel(), generator=g) + 0.5 if weighted else None,
        stride_per_key_per_rank=[[s] for s in strides],
        inverse_indices=(common.FEATURES, inverse))


def expand_bags(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The KJT of one stride whose bag ``b`` of feature ``f`` is the VBE KJT's bag
    ``inverse_indices[f][b]``: what a VBE lookup stands for."""
    keys, inverse = kjt.inverse_indices()
    lengths, values, weights = [], [], []
    for f in kjt.keys():
        jt = kjt[f]
        offsets = jt.offsets()
        for b in inverse[keys.index(f)].tolist():
            lengths.append(int(jt.lengths()[b]))
            values.append(jt.values()[offsets[b]:offsets[b + 1]])
            if jt.weights_or_none() is not None:
                weights.append(jt.weights()[offsets[b]:offsets[b + 1]])
    return KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), torch.cat(values), torch.tensor(lengths),
        torch.cat(weights) if weights else None)


# name: (plan, table-wise ranks, weighted)
BAG_VBE_PLANS = {
    "dp": ({"t0": "data_parallel", "t1": "data_parallel", "t2": "data_parallel"}, None, False),
    "mixed_weighted": ({"t0": "table_wise", "t1": "table_wise", "t2": "data_parallel"},
                       {"t0": 0, "t1": 1}, True),
    "tw_one_rank": ({"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"}, None, False),
    "rw": ({"t0": "row_wise", "t1": "row_wise", "t2": "row_wise"}, None, False),
}


def bag_vbe_matches(rank: int, world: int) -> Dict[str, float]:
    """Each rank's own VBE KJT into the sharded bag module under each of BAG_VBE_PLANS: the
    largest difference of the output and of the weights after one fused SGD step, against
    the same sharded model on the KJT of expanded bags, and (outputs; not row-wise, a
    different model) against the unsharded module."""
    robe = RobeConfig(memory_size=4000, block_size=4, shared=False)
    out: Dict[str, float] = {}
    for name, (types, ranks, weighted) in BAG_VBE_PLANS.items():
        row_wise = "row_wise" in types.values()
        # row-wise on gloo: the batch of expanded bags must be as large on every rank
        kjt = bag_vbe_kjt(rank, weighted, width=4 if row_wise else 0)
        sgd = (torch.optim.SGD, {"lr": 0.1})
        vbe = common.make_dmp(robe, types, world, sgd, ranks=ranks, is_weighted=weighted)
        dense = common.make_dmp(robe, types, world, sgd, ranks=ranks, is_weighted=weighted)
        ours, expanded = vbe(kjt), dense(expand_bags(kjt))
        worst = (ours - expanded).abs().max().item() if ours.shape == expanded.shape else 1.0
        if not row_wise:
            plain = common.Wrapper(common.make_ebc(robe, is_weighted=weighted))(kjt)
            worst = max(worst, (ours - plain).abs().max().item())
        coef = common.target(rank, ours.shape[0], ours.shape[1])
        (ours * coef).sum().backward()
        (expanded * coef).sum().backward()
        worst = max(worst, (common.full_weight(vbe) - common.full_weight(dense)).abs().max().item())
        out[name] = worst
    return out


def stock_vbe_layout(rank: int, world: int) -> float:
    """The sharded ROBE bag module's KeyedTensor for a VBE KJT against stock TorchRec's
    sharded EmbeddingBagCollection holding the ROBE module's tables materialised, both
    table-wise over the two ranks: the largest difference (keys and lengths must match)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from tests.test_embedding_bag import virtual_tables

    robe = RobeConfig(memory_size=4000, block_size=4, shared=False)
    # one pooling per rank: stock merges the VBE outputs of several TBEs of a rank with a
    # pre-allocated output, which fbgemm refuses on CPU
    ranks = {"t0": 0, "t1": 1, "t2": 0}
    ours = common.make_dmp(robe, {t: "table_wise" for t in ranks}, world,
                           (torch.optim.SGD, {"lr": 0.1}), ranks=ranks)
    ebc = common.make_ebc(robe)
    pooling = {f: t.pooling for t in ebc.embedding_bag_configs() for f in t.feature_names}
    owner = {f: ranks[t.name] for t in ebc.embedding_bag_configs() for f in t.feature_names}
    virtual = {f: w.detach() for f, w in virtual_tables(ebc).items()}
    stock = EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"v_{f}", embedding_dim=w.shape[1], num_embeddings=len(w),
                           feature_names=[f], pooling=pooling[f]) for f, w in virtual.items()])
    apply_optimizer_in_backward(torch.optim.SGD, stock.parameters(), {"lr": 0.1})
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan({"ebc": common.plan_for(
        stock, {f"v_{f}": "table_wise" for f in virtual}, world, sharder,
        {f"v_{f}": r for f, r in owner.items()})})
    theirs = DistributedModelParallel(common.Wrapper(stock),
                                      env=ShardingEnv.from_process_group(dist.group.WORLD),
                                      device=torch.device("cpu"), plan=plan, sharders=[sharder])
    # TorchRec's sharded tables start from fresh values: give them the materialised tables
    with torch.no_grad():
        for key, value in theirs.state_dict().items():
            for shard in value.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(virtual[key.split(".")[-2][2:]][row:row + rows, col:col + cols])
    kjt = bag_vbe_kjt(rank, False)
    ours_kt, theirs_kt = ours.module.ebc(kjt), theirs.module.ebc(kjt)
    assert ours_kt.keys() == theirs_kt.keys(), (ours_kt.keys(), theirs_kt.keys())
    assert ours_kt.length_per_key() == theirs_kt.length_per_key()
    if ours_kt.values().shape != theirs_kt.values().shape:
        return 1.0
    return (ours_kt.values() - theirs_kt.values()).abs().max().item()


def row_wise_vbe_on_gloo(rank: int, world: int) -> Dict[str, str]:
    """VBE batches whose pooled sizes differ between the ranks, row-wise on gloo: stock
    TorchRec's sharded EmbeddingBagCollection fails in backward (its reduce-scatter's
    backward all-gathers uneven pieces, which gloo cannot); ours refuses in forward. The
    error messages of both."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    g = torch.Generator().manual_seed(rank)
    kjt = KeyedJaggedTensor(keys=["f0", "f3"], values=torch.randint(0, 300, (2 * rank + 4,),
                                                                      generator=g),
                            lengths=torch.tensor([1] * (2 * rank + 4)),
                            stride_per_key_per_rank=[[rank + 2], [rank + 2]],
                            inverse_indices=(["f0", "f3"], torch.zeros(2, 3, dtype=torch.long)))
    out: Dict[str, str] = {}
    stock = EmbeddingBagCollection([EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=300, feature_names=["f0", "f3"])])
    apply_optimizer_in_backward(torch.optim.SGD, stock.parameters(), {"lr": 0.1})
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan({"": common.plan_for(stock, {"t": "row_wise"}, world, sharder)})
    dmp = DistributedModelParallel(stock, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    try:
        dmp(kjt).values().sum().backward()
        out["stock"] = ""
    except RuntimeError as err:
        out["stock"] = str(err)
    ours = common.make_dmp(RobeConfig(memory_size=4000, block_size=4, shared=False),
                           {t: "row_wise" for t in ("t0", "t1", "t2")}, world,
                           (torch.optim.SGD, {"lr": 0.1}))
    kjt = KeyedJaggedTensor(keys=common.FEATURES, values=torch.cat([kjt.values()] * 2),
                            lengths=torch.cat([kjt.lengths()] * 2),
                            stride_per_key_per_rank=[[rank + 2]] * 4,
                            inverse_indices=(common.FEATURES, torch.zeros(4, 3, dtype=torch.long)))
    try:
        ours(kjt)
        out["ours"] = ""
    except ValueError as err:
        out["ours"] = str(err)
    with torch.no_grad():  # forward alone runs
        out["ours_no_grad_shape"] = str(tuple(ours(kjt).shape))
    return out


def row_wise_ec(world: int, shared: bool, seed: int):
    """``(unsharded module, its initial array, its row-wise DMP)``: the unpooled module
    planned row-wise (the opt-in), fused SGD."""
    torch.manual_seed(seed)
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=3000, block_size=4,
                                                         shared=shared))
    initial = ec.weight.detach().clone()
    apply_optimizer_in_backward(torch.optim.SGD, [ec.weight], {"lr": 0.1})
    sharder = RobeEmbeddingCollectionSharder(row_wise=True)
    plan = ShardingPlan({"": common.plan_for(ec, {"items": "row_wise", "cats": "row_wise"},
                                             world, sharder)})
    dmp = DistributedModelParallel(ec, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    return ec, initial, dmp


def row_wise_unpooled_matches(rank: int, world: int, path: str, steps: int = 5) -> float:
    """The unpooled module planned row-wise (opt-in), shared and per-table arrays, against
    the row-wise reference of the bag module's tests on one-id bags (an id's vector is that
    of a row-wise bag holding it): the largest difference of the outputs and of the
    weights over ``steps`` fused SGD steps, then of the output for a VBE KJT (laid out as
    in vbe_matches), then of weights and outputs after a DCP round trip into a row-wise
    model of another seed."""
    from tests.distributed.test_row_wise import row_wise_reference

    worst = 0.0
    for shared in (True, False):
        ec, initial, dmp = row_wise_ec(world, shared, seed=3)
        weight = initial.requires_grad_(True)
        opt = torch.optim.SGD([weight], lr=0.1)
        for step in range(steps):
            # the sequence features only, as the VBE KJT below (the input dist keeps the
            # keys of its first batch)
            kjt = global_batch(step, world).permute([KEYS.index(f) for f in SEQ])
            local = common.local_slice(kjt, rank)
            ours = dmp(local)
            loss, ref_loss = 0.0, 0.0
            for f in SEQ:
                ids = kjt[f].values()
                one_per_bag = KeyedJaggedTensor.from_lengths_sync([f], ids, torch.ones_like(ids))
                ref = row_wise_reference(ec, weight, one_per_bag, world, features=[f])
                coef = common.target(step, len(ids), DIM)
                # this rank's ids: those of its samples
                lo, hi = (int(kjt[f].offsets()[i]) for i in (rank * B, (rank + 1) * B))
                worst = max(worst, (ours[f].values() - ref[lo:hi]).abs().max().item())
                loss = loss + (ours[f].values() * coef[lo:hi]).sum()
                ref_loss = ref_loss + (ref * coef).sum() / world   # rank-averaged
            loss.backward()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
        state = dmp.state_dict()
        worst = max(worst, (common.full_tensor(state["weight"]) - weight.detach()).abs().max().item())
    kjt = seq_vbe_kjt(rank)
    ours = dmp(kjt)
    for f, rows in zip(kjt.inverse_indices()[0], kjt.inverse_indices()[1]):
        jt = kjt[f]
        ids = torch.cat([jt.values()[jt.offsets()[b]:jt.offsets()[b + 1]] for b in rows.tolist()])
        one_per_bag = KeyedJaggedTensor.from_lengths_sync([f], ids, torch.ones_like(ids))
        ref = row_wise_reference(ec, weight, one_per_bag, world, features=[f])
        assert torch.equal(ours[f].lengths(), jt.lengths()[rows]), f
        worst = max(worst, (ours[f].values() - ref).abs().max().item())
    dcp.save(dmp.state_dict(), checkpoint_id=path)
    _, _, restored = row_wise_ec(world, shared=False, seed=4)
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=path)
    restored.load_state_dict(state)
    worst = max(worst, (common.full_tensor(restored.state_dict()["weight"])
                        - weight.detach()).abs().max().item())
    again = restored(kjt)
    for f in ours.keys():
        worst = max(worst, (again[f].values() - ours[f].values()).abs().max().item())
    return worst


def run_all(rank: int, world: int):
    out = {}
    shared = RobeConfig(memory_size=4000, block_size=4, shared=True)
    per_table = RobeConfig(memory_size=4000, block_size=4, shared=False)
    dp = {n: "data_parallel" for n in ("t0", "t1", "t2", "items", "cats")}
    tw = {"t0": "table_wise", "t1": "table_wise", "t2": "data_parallel", "items": "table_wise",
          "cats": "table_wise"}
    out["dp_shared"] = sharded_equals_unsharded(rank, world, shared, dp, 20)
    out["tw"] = sharded_equals_unsharded(rank, world, per_table, tw, 20)
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)
        out["checkpoint"] = checkpoint_moves(rank, world, path[0])
        dist.barrier()
    out.update(pipelines_match(rank, world))
    out["vbe"] = vbe_matches(rank, world)
    out["bag_vbe"] = bag_vbe_matches(rank, world)
    out["stock_vbe"] = stock_vbe_layout(rank, world)
    out["rw_vbe_gloo"] = row_wise_vbe_on_gloo(rank, world)
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)
        out["rw_unpooled"] = row_wise_unpooled_matches(rank, world, path[0])
        dist.barrier()
    return out


@pytest.mark.slow
def test_sharded_sequence_and_bag_modules():
    for result in run_ranks(run_all, 2, timeout=600):
        assert result["dp_shared"] < 1e-5 and result["tw"] < 1e-5, result
        assert result["checkpoint"] < 1e-6, result
        assert result["sparse_dist"] == 0.0 and result["fused_sparse_dist"] == 0.0, result
        # SemiSync: synchronous (the plain loop's losses) before start_batch=2, then one
        # step stale, so close to them
        semi, plain = torch.tensor(result["semi_sync_losses"]), torch.tensor(result["plain_losses"])
        assert len(semi) == 8 and bool(torch.isfinite(semi).all()), result
        assert torch.equal(semi[:2], plain[:2]), result
        assert bool(((semi - plain).abs() <= 0.25 * plain.abs() + 0.05).all()), result
        assert result["vbe"] < 1e-6, result
        assert set(result["bag_vbe"]) == set(BAG_VBE_PLANS), result
        assert all(v < 1e-5 for v in result["bag_vbe"].values()), result
        assert result["stock_vbe"] < 1e-5, result
        gloo = result["rw_vbe_gloo"]
        assert "allgather" in gloo["stock"], gloo    # stock TorchRec cannot either
        assert "row_wise" in gloo["ours"] and "NCCL" in gloo["ours"], gloo
        assert gloo["ours_no_grad_shape"] == "(3, 24)", gloo
        assert result["rw_unpooled"] < 1e-5, result


def test_planner_sizes_and_default_sharders():
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    model = TwoModules(RobeConfig(compression=100, block_size=4, shared=False))
    apply_optimizer_in_backward(torch.optim.SGD, [model.ec.weight], {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.SGD, [model.ebc.weight], {"lr": 0.1})
    sharders = get_default_sharders()
    assert any(isinstance(s, RobeEmbeddingCollectionSharder) for s in sharders)
    params = RobeEmbeddingCollectionSharder().shardable_parameters(model.ec)
    floats = sum(p.numel() for p in params.values())
    assert model.ec.memory_size <= floats < model.ec.memory_size + 2 * DIM
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu")
                                    ).plan(model, sharders)
    assert set(plan.plan["ec"]) == {"items", "cats"}
    assert {ps.sharding_type for ps in plan.plan["ec"].values()} <= {"data_parallel",
                                                                     "table_wise"}
    assert RobeEmbeddingCollectionSharder(row_wise=True).sharding_types_for(model.ec) == [
        "data_parallel", "table_wise", "row_wise"]
    assert ShardedRobeEmbeddingCollection.__name__ in repr(
        RobeEmbeddingCollectionSharder().sharded_module_type)


def test_sharding_without_a_fused_optimizer_names_the_sequence_module():
    from robe_torchrec.distributed.sharder import resolve_fused_optimizer

    ec = RobeEmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                  feature_names=["f"])],
                                 RobeConfig(memory_size=32, block_size=4))
    with pytest.raises(ValueError, match="^sharding RobeEmbeddingCollection needs a fused "):
        resolve_fused_optimizer(ec, None)


def test_a_sharded_sequence_lookup_compiles_with_the_keys():
    """The rank's lookup of a sharded RobeEmbeddingCollection compiles with
    ``fullgraph=True``, takes the keys layout from its own buffer (its features, placed in
    the local weight, as one feature of keys) and gives eager's rows."""
    from robe_torchrec.distributed.lookup import RobeShardedLookup
    from tests.test_embedding_collection import ec_tables, random_kjt
    from tests.train.helpers import one_rank_group

    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4))
    apply_optimizer_in_backward(torch.optim.SGD, [ec.weight], {"lr": 0.1})
    with one_rank_group():
        dmp = DistributedModelParallel(nn.ModuleDict({"ec": ec}), device=torch.device("cpu"))
    lookup, = [m for m in dmp.modules() if isinstance(m, RobeShardedLookup)]
    assert lookup.keys_table_meta is not None
    names = [f.name for f in lookup.features]
    traced = set()

    def backend(gm, example_inputs):
        traced.update(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    compiled = torch.compile(lookup, fullgraph=True, backend=backend)

    def batch(seed):
        kjt = random_kjt(seed=seed)
        return KeyedJaggedTensor.from_jt_dict({name: kjt[name] for name in names})

    with torch.no_grad():
        for seed in range(3):
            assert torch.equal(compiled(batch(seed)), lookup(batch(seed)))
    assert any("unpooled_keys" in target for target in traced), traced
