"""RobeEmbeddingCollection (unpooled) and variable batch size per feature (VBE) in both ROBE
modules: against stock TorchRec modules holding the materialised tables, the one-id-bag
identity with the bag module, training (dense and fused), bad input, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
import torchrec
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
)
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection, RobeEmbeddingCollection
from robe_torchrec.ops import cpu_backend, robe_unpooled_lookup
from robe_torchrec.optim import RowWiseAdagrad
from tests.test_embedding_bag import virtual_tables

DIM = 6
ROWS = {"t0": 40, "t1": 300, "t2": 9}


def ec_tables(dim: int = DIM):
    return [EmbeddingConfig(name="t0", embedding_dim=dim, num_embeddings=ROWS["t0"],
                            feature_names=["f0", "f_extra"]),
            EmbeddingConfig(name="t1", embedding_dim=dim, num_embeddings=ROWS["t1"],
                            feature_names=["f1"]),
            EmbeddingConfig(name="t2", embedding_dim=dim, num_embeddings=ROWS["t2"])]


def bag_tables(dim: int = DIM):
    return [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                               num_embeddings=t.num_embeddings, feature_names=t.feature_names)
            for t in ec_tables(dim)]


FEATURE_ROWS = {"f0": 40, "f_extra": 40, "f1": 300, "t2": 9}


def random_kjt(seed: int = 0, batch: int = 5, strides=None, dtype=torch.int64):
    """Random ids of every feature; with ``strides``, a VBE KJT (inverse indices of width
    ``batch``)."""
    g = torch.Generator().manual_seed(seed)
    keys = list(FEATURE_ROWS)
    strides = strides or [batch] * len(keys)
    lengths = [torch.randint(0, 5, (s,), generator=g) for s in strides]
    values = torch.cat([torch.randint(0, FEATURE_ROWS[k], (int(n.sum()),), generator=g)
                        for k, n in zip(keys, lengths)]).to(dtype)
    if len(set(strides)) == 1:
        return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.cat(lengths))
    inverse = torch.stack([torch.randint(0, s, (batch,), generator=g) for s in strides])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.cat(lengths),
                             stride_per_key_per_rank=[[s] for s in strides],
                             inverse_indices=(keys, inverse))


def stock_ec(ec: RobeEmbeddingCollection, need_indices: bool = False) -> EmbeddingCollection:
    """A TorchRec EmbeddingCollection holding ``ec``'s tables materialised (one feature per
    table, so that every feature of a ROBE table reads the same virtual table)."""
    virtual = virtual_tables(ec)
    tables = [EmbeddingConfig(name=f"v_{f}", embedding_dim=DIM, num_embeddings=len(w),
                              feature_names=[f]) for f, w in virtual.items()]
    stock = EmbeddingCollection(tables=tables, need_indices=need_indices)
    with torch.no_grad():
        for f, w in virtual.items():
            stock.embeddings[f"v_{f}"].weight.copy_(w)
    return stock


def assert_same_jagged(ours, theirs):
    assert list(ours) == list(theirs)
    for k in theirs:
        torch.testing.assert_close(ours[k].values(), theirs[k].values(), rtol=1e-6, atol=1e-7)
        assert torch.equal(ours[k].lengths(), theirs[k].lengths())
        assert torch.equal(ours[k].offsets(), theirs[k].offsets())
        w = theirs[k].weights_or_none()
        assert (ours[k].weights_or_none() is None) == (w is None)
        if w is not None:
            assert torch.equal(ours[k].weights(), w)


@pytest.mark.parametrize("shared,hash,backend", [
    (True, "reference", "cpp"), (False, "mix", "cpp"), (True, "mix", "reference"),
    (False, "reference", "triton"),
])
def test_output_and_gradient_match_stock_ec_on_materialised_tables(shared, hash, backend):
    robe = RobeConfig(memory_size=257, block_size=4, hash=hash, shared=shared)
    ec = RobeEmbeddingCollection(ec_tables(), robe, need_indices=True)
    stock = stock_ec(ec, need_indices=True)
    kjt = random_kjt(seed=1)
    with cpu_backend(backend):
        ours = ec(kjt)
        assert_same_jagged(ours, stock(kjt))
        # gradient of the array: through the materialised tables' gather, autograd's
        g = torch.Generator().manual_seed(2)
        coef = {k: torch.randn(v.values().shape, generator=g) for k, v in ours.items()}
        sum((ours[k].values() * c).sum() for k, c in coef.items()).backward()
    ref = copy.deepcopy(ec)
    ref.weight.grad = None
    virtual = virtual_tables(ref)
    jts = kjt.to_dict()
    sum((virtual[k][jts[k].values()] * c).sum() for k, c in coef.items()).backward()
    torch.testing.assert_close(ec.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shared", [True, False])
def test_a_bag_of_one_id_is_the_unpooled_vector_exactly(shared):
    robe = RobeConfig(memory_size=301, block_size=4, shared=shared)
    torch.manual_seed(7)
    ebc = RobeEmbeddingBagCollection(bag_tables(), robe)
    torch.manual_seed(7)
    ec = RobeEmbeddingCollection(ec_tables(), robe)
    assert torch.equal(ebc.weight, ec.weight)
    kjt = random_kjt(seed=3)
    unpooled = ec(kjt)
    for key, jt in kjt.to_dict().items():
        ids = jt.values()
        # the feature's ids one per bag, the other features' bags empty
        lengths = torch.cat([torch.full_like(ids, int(k == key)) for k in kjt.keys()])
        one_per_bag = KeyedJaggedTensor.from_lengths_sync(
            keys=kjt.keys(), values=ids, lengths=lengths)
        pooled = ebc(one_per_bag).to_dict()[key]
        assert torch.equal(pooled, unpooled[key].values())   # bit for bit


def test_unpooled_lookup_op_entry_point():
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=200, block_size=4))
    kjt = random_kjt(seed=4, dtype=torch.int32)
    rows = robe_unpooled_lookup(ec.weight, kjt.values(), kjt.length_per_key(),
                                ec.layout.op_args(ec.table_meta))
    torch.testing.assert_close(rows, torch.cat([jt.values() for jt in ec(kjt).values()]))
    with pytest.raises(ValueError, match="sum\\(counts\\)"):
        robe_unpooled_lookup(ec.weight, kjt.values(), [1, 2, 3, 4],
                             ec.layout.op_args(ec.table_meta))


def _train(ec, kjts, optimizer=None, fused=None, rows_of=None):
    """Steps of a fixed loss. ``rows_of``: ``optimizer`` updates a 2-D copy of the array
    (rows of block_size floats, as torchrec's RowWiseAdagrad needs), copied back each step."""
    if fused is not None:
        apply_optimizer_in_backward(fused[0], [ec.weight], fused[1])
    losses = []
    for kjt in kjts:
        out = ec(kjt)
        loss = sum(((jt.values() - 0.5) ** 2).sum() for jt in out.values())
        if optimizer:
            optimizer.zero_grad()
            ec.weight.grad = None
        loss.backward()
        if optimizer and rows_of is not None:
            rows_of.grad = ec.weight.grad.view_as(rows_of)
            optimizer.step()
            with torch.no_grad():
                ec.weight.copy_(rows_of.flatten())
        elif optimizer:
            optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.SGD, {"lr": 0.05}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (RowWiseAdagrad, {"lr": 0.1}),
    (torch.optim.Adam, {"lr": 0.01}),
])
def test_fused_optimizer_equals_torch_optim_on_dense_gradient(cls, kwargs):
    dense = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=256, block_size=4))
    fused = copy.deepcopy(dense)
    kjts = [random_kjt(seed=s) for s in range(3)]
    if cls is RowWiseAdagrad:  # torchrec's, on the array as rows of block_size floats
        rows = torch.nn.Parameter(dense.weight.detach().clone().view(-1, 4))
        dense_losses = _train(dense, kjts, optimizer=torchrec.optim.RowWiseAdagrad([rows], **kwargs),
                              rows_of=rows)
    else:
        dense_losses = _train(dense, kjts, optimizer=cls([dense.weight], **kwargs))
    fused_losses = _train(fused, kjts, fused=(cls, kwargs))
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.weight, dense.weight, rtol=1e-5, atol=1e-6)
    assert fused_losses == pytest.approx(dense_losses, rel=1e-5)
    assert dense_losses[-1] < dense_losses[0]


def test_variable_batch_per_feature_matches_stock_modules():
    strides = [3, 5, 2, 4]
    kjt = random_kjt(seed=5, batch=6, strides=strides)
    assert kjt.variable_stride_per_key()
    # unpooled: stock EmbeddingCollection gives each feature its own lengths
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=257, block_size=4))
    assert_same_jagged(ec(kjt), stock_ec(ec)(kjt))
    # pooled: stock EmbeddingBagCollection expands each feature's bags by inverse_indices
    ebc = RobeEmbeddingBagCollection(bag_tables(), RobeConfig(memory_size=257, block_size=4,
                                                              shared=False))
    virtual = virtual_tables(ebc)
    stock = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"v_{f}", embedding_dim=DIM, num_embeddings=len(w),
                           feature_names=[f]) for f, w in virtual.items()])
    with torch.no_grad():
        for f, w in virtual.items():
            stock.embedding_bags[f"v_{f}"].weight.copy_(w)
    ours, theirs = ebc(kjt), stock(kjt)
    assert ours.keys() == theirs.keys() and ours.values().shape == (6, 4 * DIM)
    torch.testing.assert_close(ours.values(), theirs.values(), rtol=1e-5, atol=1e-6)
    # gradient through the expansion: a bag picked twice gets both rows' gradients
    ours.values().sum().backward()
    ref = copy.deepcopy(ebc)
    ref.weight.grad = None
    stock_grad = {}
    theirs.values().sum().backward()
    for f in virtual:
        stock_grad[f] = stock.embedding_bags[f"v_{f}"].weight.grad
    virt = virtual_tables(ref)
    sum((virt[f] * stock_grad[f]).sum() for f in virt).backward()
    torch.testing.assert_close(ebc.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("strides", [None, [5, 3, 5, 2]], ids=["one_stride", "vbe"])
def test_fullgraph_compile_of_fresh_kjts_equals_eager(pooled, strides):
    """``torch.compile(fullgraph=True)``, called first on KJTs as a data loader builds them
    (no lengths per key computed yet, so the trace holds them as unknowns), as TorchRec's
    modules compile: the outputs and the gradient equal eager's, call after call."""
    robe = RobeConfig(memory_size=257, block_size=4)
    module = (RobeEmbeddingBagCollection(bag_tables(), robe) if pooled
              else RobeEmbeddingCollection(ec_tables(), robe))

    def loss(kjt):
        out = module(kjt)
        return out.values().square().sum() if pooled else sum(
            jt.values().square().sum() for jt in out.values())

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for seed in range(3):
        got = compiled(random_kjt(seed=seed, batch=6, strides=strides))
        got_grad, = torch.autograd.grad(got, module.weight)
        want = loss(random_kjt(seed=seed, batch=6, strides=strides))
        want_grad, = torch.autograd.grad(want, module.weight)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def test_vbe_padding_and_its_gpu_check_on_cpu():
    """The padding a VBE batch gets before the lookup: each feature's bags, then empty ones
    up to the largest stride (the GPU check also runs it under CUDA's sync debug mode);
    lengths that do not match the strides are refused."""
    from robe_torchrec.testing.gpu_torchrec_checks import check_vbe_padding_no_host_sync
    from robe_torchrec.variable_batch import pad_variable_strides

    check_vbe_padding_no_host_sync("cpu")
    kjt = random_kjt(seed=7, batch=6, strides=[3, 6, 1, 4])
    padded = pad_variable_strides(kjt).lengths().view(4, 6)
    for f, (stride, lengths) in enumerate(zip([3, 6, 1, 4], kjt.lengths().split([3, 6, 1, 4]))):
        assert torch.equal(padded[f, :stride], lengths) and not padded[f, stride:].any()
    short = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2]),
                              lengths=torch.tensor([1, 1]), stride_per_key_per_rank=[[2], [1]])
    with pytest.raises(ValueError, match="holds 3 bags, but its lengths have 2 entries"):
        pad_variable_strides(short)


def test_variable_batch_without_inverse_indices():
    jts = {"f0": JaggedTensor(torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2])),
           "f_extra": JaggedTensor(torch.tensor([4]), lengths=torch.tensor([1, 0, 0])),
           "f1": JaggedTensor(torch.tensor([5, 6]), lengths=torch.tensor([2])),
           "t2": JaggedTensor(torch.tensor([7]), lengths=torch.tensor([0, 1]))}
    kjt = KeyedJaggedTensor.from_jt_dict(jts)
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=257, block_size=4))
    out = ec(kjt)
    for k, jt in jts.items():
        assert torch.equal(out[k].lengths(), jt.lengths())
    ebc = RobeEmbeddingBagCollection(bag_tables(), RobeConfig(memory_size=257, block_size=4))
    with pytest.raises(ValueError, match="needs inverse_indices"):
        ebc(kjt)


def test_sharded_vbe_layout_helpers():
    """The layout a sharded pooled lookup hands TorchRec's VBE output dist (rank by rank,
    then feature by feature), and the inverse indices put in the sharded module's order
    (the multi-rank checks are in tests/distributed/test_sequence.py)."""
    from robe_torchrec.variable_batch import flatten_variable_strides, order_inverse_indices

    pooled = torch.arange(12.).view(3, 4)   # 2 features of dim 2; strides 3 and 1
    flat = flatten_variable_strides(pooled, [[2, 1], [1, 0]], [2, 2])
    # rank 0: feature 0's bags 0-1, feature 1's bag 0; rank 1: feature 0's bag 2
    assert flat.tolist() == [0., 1., 4., 5., 2., 3., 8., 9.]
    kjt = random_kjt(seed=3, batch=4, strides=[2, 3, 1, 2])
    keys, rows = kjt.inverse_indices()
    ordered = order_inverse_indices(kjt, ["t2", "f0"])
    assert ordered.inverse_indices()[0] == ["t2", "f0"]
    assert torch.equal(ordered.inverse_indices()[1], rows[[keys.index("t2"), keys.index("f0")]])
    assert torch.equal(ordered.lengths(), kjt.lengths()) and ordered.keys() == kjt.keys()
    assert ordered.stride_per_key_per_rank() == kjt.stride_per_key_per_rank()
    assert order_inverse_indices(kjt, keys) is kjt
    plain = random_kjt(seed=3, batch=4)
    assert order_inverse_indices(plain, ["t2", "f0"]) is plain


def test_bad_input_is_refused_clearly():
    robe = RobeConfig(memory_size=257, block_size=4)
    with pytest.raises(ValueError, match="same embedding dimension"):
        RobeEmbeddingCollection(ec_tables()[:2] + [
            EmbeddingConfig(name="t9", embedding_dim=DIM + 1, num_embeddings=5)], robe)
    ec = RobeEmbeddingCollection(ec_tables(), robe)
    with pytest.raises(TypeError, match="expects a KeyedJaggedTensor"):
        ec({"f0": torch.tensor([1])})
    kjt = random_kjt(seed=6)
    with pytest.raises(ValueError, match=r"missing \['t2'\]"):
        ec(kjt.permute([0, 1, 2]))
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=torch.full_like(kjt.values(), 41),
                            lengths=kjt.lengths())
    with pytest.raises((ValueError, RuntimeError), match=r"out of range|outside") as err:
        ec(bad)
    assert "'f0'" in str(err.value)


def test_state_dict_round_trip_layout_check_and_meta_init():
    robe = RobeConfig(memory_size=257, block_size=4)
    torch.manual_seed(0)
    ec = RobeEmbeddingCollection(ec_tables(), robe)
    assert set(ec.state_dict()) == {"weight", "robe_layout"}
    other = RobeEmbeddingCollection(ec_tables(), robe)
    other.load_state_dict(ec.state_dict())
    assert torch.equal(other.weight, ec.weight)
    # the bag module's checkpoint of the same layout loads too: the same array
    ebc = RobeEmbeddingBagCollection(bag_tables(), robe)
    ebc.load_state_dict(ec.state_dict())
    with pytest.raises(ValueError, match="another ROBE layout"):
        RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=257, block_size=2)
                                ).load_state_dict(ec.state_dict())
    meta = RobeEmbeddingCollection(ec_tables(), robe, device="meta")
    assert meta.weight.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.reset_parameters()
    assert torch.equal(meta.weight, ec.weight)


def _unpooled_layout_by_hand(counts):
    """The unpooled lookup's offsets and gather index, one bag and one id at a time; at
    least one bag a feature (empty ones when no feature holds an id)."""
    width, num_features = max(counts, default=0) or 1, len(counts)
    offsets, index, start = [], [], 0
    for f, count in enumerate(counts):
        offsets += [start + min(b, count) for b in range(width)]
        index += [b * num_features + f for b in range(count)]
        start += count
    return offsets + [start], index


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_unpooled_args_lay_out_bags_and_rows_as_by_hand(dtype):
    """Fresh random counts (features without ids, all features empty, one feature): the
    offsets and the gather index the op's arguments hold are those laid out by hand."""
    from robe_torchrec.ops.args import LayoutArgs
    from robe_torchrec.ops.unpooled import unpooled_args

    g = torch.Generator().manual_seed(5)
    cases = [[0, 0, 0], [4], [0], [3, 0, 5, 1]]
    cases += [torch.randint(0, 9, (int(t),), generator=g).tolist()
              for t in torch.randint(1, 7, (12,), generator=g)]
    for counts in cases:
        table_meta = torch.zeros(7, len(counts), dtype=torch.int64)
        layout = LayoutArgs(table_meta, 4 * len(counts), 4, 0, [1, 2, 3], 0)
        values = torch.arange(sum(counts), dtype=dtype)
        args, index = unpooled_args(values, counts, layout)
        offsets, rows = _unpooled_layout_by_hand(counts)
        if len(counts) == 1:  # one feature is its own feature of keys: a bag an id
            offsets = list(range(counts[0] + 1))
        assert args.offsets.dtype == dtype and args.offsets.tolist() == offsets, counts
        assert args.layout.output_dim == 4 * len(counts)
        if len(counts) == 1:
            assert index is None
        else:
            assert index.dtype == torch.int64 and index.tolist() == rows, counts
