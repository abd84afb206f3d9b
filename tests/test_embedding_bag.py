"""RobeEmbeddingBagCollection: EBC compatibility, layouts, training (dense and fused),
checkpoints, and the DLRM swap."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection, RobeLayout
from robe_torchrec.layout import name_fingerprint
from robe_torchrec.ops import meta as m
from robe_torchrec.ops.reference import element_indices


def make_tables(dims=(8, 5, 16), rows=(50, 300, 7), poolings=None, two_features_on_first=True):
    poolings = poolings or [PoolingType.SUM, PoolingType.MEAN, PoolingType.SUM]
    tables = []
    for t, (d, n, p) in enumerate(zip(dims, rows, poolings)):
        features = [f"f{t}"] + (["f_extra"] if t == 0 and two_features_on_first else [])
        tables.append(EmbeddingBagConfig(name=f"t{t}", embedding_dim=d, num_embeddings=n,
                                         feature_names=features, pooling=p))
    return tables


def random_kjt(tables, batch=6, max_len=4, seed=0, weighted=False, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for table in tables:
        for f in table.feature_names:
            ls = torch.randint(0, max_len + 1, (batch,), generator=g)
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, table.num_embeddings, (int(ls.sum()),), generator=g))
    values = torch.cat(values).to(dtype)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.cat(lengths).to(torch.int32),
                             weights=weights)


def virtual_tables(ebc: RobeEmbeddingBagCollection):
    """Materialise every feature's full (num_embeddings x dim) table from the ROBE array."""
    out = {}
    meta, layout = ebc.table_meta, ebc.layout
    for t, name in enumerate(layout.feature_names):
        col = [int(v) for v in meta[:, t].tolist()]
        ids = torch.arange(col[m.NUM_ROWS])
        idx = element_indices(ids, col, layout.block_size, int(layout.hash_mode),
                              list(layout.hash_params))
        out[name] = ebc.weight[idx]
    return out


def expected_output(ebc, kjt, weighted=False):
    """The module's output computed with nn.functional.embedding_bag on the virtual tables."""
    tables = virtual_tables(ebc)
    pooled = []
    for table in ebc.embedding_bag_configs():
        mode = "sum" if table.pooling == PoolingType.SUM else "mean"
        for f in table.feature_names:
            jt = kjt[f]
            psw = jt.weights() if weighted else None
            if psw is not None and mode == "mean":  # embedding_bag refuses psw with mean
                out = torch.nn.functional.embedding_bag(
                    jt.values(), tables[f], jt.offsets(), mode="sum", per_sample_weights=psw,
                    include_last_offset=True) / jt.lengths().clamp(min=1)[:, None]
            else:
                out = torch.nn.functional.embedding_bag(
                    jt.values(), tables[f], jt.offsets(), mode=mode, per_sample_weights=psw,
                    include_last_offset=True)
            pooled.append(out)
    return torch.cat(pooled, dim=1)


def test_a_module_built_or_moved_under_inference_mode_checks_its_layout_once(monkeypatch):
    """A serving process may build or move its model under ``inference_mode``: the layout
    buffer stays a normal tensor, whose check the Triton ops remember by version (an
    inference tensor has none: it would be copied to the host and checked at every call,
    on a GPU a wait for the device each time)."""
    from robe_torchrec.ops import cpu_backend, validation

    checks = []
    check = validation.check_table_meta
    monkeypatch.setattr(validation, "check_table_meta",
                        lambda *args: checks.append(1) or check(*args))
    tables = make_tables()
    kjt = random_kjt(tables)
    with torch.inference_mode():
        ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=512, block_size=4))
        assert not ebc.table_meta.is_inference()
        ebc._apply(lambda t: t.clone())  # a move, as .to(device) makes new tensors
        assert not ebc.table_meta.is_inference() and not ebc.weight.is_inference()
        with cpu_backend("triton"):  # the GPU's path, in Triton's interpreter
            for _ in range(3):
                ebc(kjt)
    assert len(checks) == 1


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("hash", ["reference", "mix"])
@pytest.mark.parametrize("weighted", [False, True])
def test_output_matches_materialised_tables(shared, hash, weighted):
    tables = make_tables()
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=613, block_size=3, hash=hash,
                                                        shared=shared), is_weighted=weighted)
    kjt = random_kjt(tables, weighted=weighted, seed=3)
    out = ebc(kjt)
    stock = EmbeddingBagCollection(tables=make_tables())
    assert out.keys() == stock(kjt).keys()
    assert out.length_per_key() == stock(kjt).length_per_key()
    torch.testing.assert_close(out.values(), expected_output(ebc, kjt, weighted), rtol=1e-5, atol=1e-6)


def test_permuted_keys_give_same_output():
    tables = make_tables()
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=500, block_size=4))
    kjt = random_kjt(tables, seed=1)
    permuted = kjt.permute([3, 1, 0, 2])
    torch.testing.assert_close(ebc(permuted).values(), ebc(kjt).values())


def test_shared_layout_is_the_papers():
    """Shared array: row i of table 1 is hashed as key i + num_embeddings of table 0."""
    tables = make_tables(dims=(8, 8, 8), two_features_on_first=False)
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=1000, block_size=4))
    assert len(list(ebc.parameters())) == 1
    v = virtual_tables(ebc)
    n0, n1 = tables[0].num_embeddings, tables[1].num_embeddings
    # table 1 row 0 == what table 0 would read at row n0 (same key)
    col0 = [int(x) for x in ebc.table_meta[:, 0].tolist()]
    beyond = element_indices(torch.tensor([n0, n0 + n1 + 2]), col0, 4, 0, list(ebc.layout.hash_params))
    torch.testing.assert_close(v["f1"][0], ebc.weight[beyond[0]])
    torch.testing.assert_close(v["f2"][2], ebc.weight[beyond[1]])


def test_per_table_arrays_split_the_budget():
    tables = make_tables(two_features_on_first=False)
    robe = RobeConfig(memory_size=1000, block_size=2, shared=False)
    ebc = RobeEmbeddingBagCollection(tables, robe)
    sizes = ebc.table_meta[m.W_SIZE].tolist()
    assert sum(sizes) == ebc.memory_size == 1000
    logical = [t.num_embeddings * t.embedding_dim for t in tables]
    for size, n in zip(sizes, logical):
        assert size >= 2 and abs(size - 1000 * n / sum(logical)) <= 2 + 1000 * 0.01
    # arrays are disjoint: every element index of table t stays in its own region
    offsets = ebc.table_meta[m.W_OFFSET].tolist()
    for t, (name, table) in enumerate(zip(ebc.layout.feature_names, virtual_tables(ebc).values())):
        col = [int(x) for x in ebc.table_meta[:, t].tolist()]
        idx = element_indices(torch.arange(col[m.NUM_ROWS]), col, 2, 0, list(ebc.layout.hash_params))
        assert idx.min() >= offsets[t] and idx.max() < offsets[t] + sizes[t]


def test_compression_and_init():
    tables = make_tables(rows=(10_000, 20_000, 400))
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=100, block_size=4))
    assert ebc.memory_size == math.ceil(ebc.uncompressed_size / 100)
    assert ebc.compression_ratio == pytest.approx(100, rel=1e-3)
    bound = math.sqrt(1 / 20_000)
    assert ebc.weight.abs().max() <= bound and ebc.weight.abs().max() > 0.9 * bound
    custom = RobeEmbeddingBagCollection(tables, RobeConfig(compression=100, init_scale=0.5))
    assert 0.45 < custom.weight.abs().max() <= 0.5


def test_meta_device_allocates_nothing():
    ebc = RobeEmbeddingBagCollection(make_tables(), RobeConfig(compression=10), device="meta")
    assert ebc.weight.is_meta


def _train(ebc, kjts, optimizer_factory=None, fused=None):
    """A few steps of a fixed quadratic loss; returns the losses."""
    target = torch.linspace(-1, 1, ebc.layout.output_dim)
    if fused is not None:
        apply_optimizer_in_backward(fused[0], [ebc.weight], fused[1])
        opt = None
    else:
        opt = optimizer_factory([ebc.weight])
    losses = []
    for kjt in kjts:
        loss = ((ebc(kjt).values() - target) ** 2).sum()
        if opt:
            opt.zero_grad()
        loss.backward()
        if opt:
            opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.01}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-6, "initial_accumulator_value": 0.1}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.9), "weight_decay": 0.1}),
])
def test_fused_optimizer_equals_torch_optim_on_dense_gradient(cls, kwargs):
    tables = make_tables()
    dense = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=300, block_size=4))
    fused = copy.deepcopy(dense)
    kjts = [random_kjt(tables, seed=s) for s in range(4)]
    dense_losses = _train(dense, kjts, lambda p: cls(p, **kwargs))
    fused_losses = _train(fused, kjts, fused=(cls, kwargs))
    assert fused.weight.grad is None  # the update happened in backward, no gradient left
    torch.testing.assert_close(fused.weight, dense.weight, rtol=1e-5, atol=1e-6)
    assert fused_losses == pytest.approx(dense_losses, rel=1e-5)
    assert dense_losses[-1] < dense_losses[0]
    state = fused.fused_optimizer.state_dict()["state"]["weight"]
    if cls is torch.optim.Adam:
        assert float(state["step"]) == len(kjts)


def test_fused_learning_rate_change_takes_effect():
    tables = make_tables()
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=300, block_size=4))
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.1})
    kjt = random_kjt(tables, seed=0)
    # a scheduler drives the fused optimizer's lr: 0 in epoch 0, the base lr afterwards
    scheduler = torch.optim.lr_scheduler.LambdaLR(ebc.fused_optimizer, lambda e: float(e > 0))
    assert ebc.fused_optimizer.param_groups[0]["lr"] == 0.0
    before = ebc.weight.detach().clone()
    ebc(kjt).values().sum().backward()
    torch.testing.assert_close(ebc.weight.detach(), before)
    # as a training loop does: the optimizer's step (a no-op, the update ran in backward),
    # then the scheduler's; the other order makes torch warn that a step was skipped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ebc.fused_optimizer.step()
        scheduler.step()
    assert ebc.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    ebc(kjt).values().sum().backward()
    assert not torch.equal(ebc.weight.detach(), before)


def test_unsupported_fused_optimizer_is_refused():
    ebc = RobeEmbeddingBagCollection(make_tables(), RobeConfig(memory_size=300))
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="momentum"):
        ebc(random_kjt(make_tables()))


def test_a_second_in_backward_optimizer_is_refused_at_the_next_forward():
    tables = make_tables()
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=300))
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.1})
    ebc(random_kjt(tables)).values().sum().backward()  # the fused optimizer exists by now
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    with pytest.raises(ValueError, match="exactly one in-backward optimizer"):
        ebc(random_kjt(tables))


def test_weighted_gradients_flow_to_per_sample_weights():
    tables = make_tables()
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=300, block_size=4), is_weighted=True)
    kjt = random_kjt(tables, weighted=True, seed=5)
    w = kjt.weights().clone().requires_grad_()
    kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=w)
    ebc(kjt).values().square().sum().backward()
    ref_w = w.detach().clone().requires_grad_()
    ref_kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=ref_w)
    expected_output(ebc, ref_kjt, weighted=True).square().sum().backward()
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("psw_requires_grad", [False, True])
def test_weighted_module_with_fused_optimizer(psw_requires_grad):
    tables = make_tables()
    robe = RobeConfig(memory_size=300, block_size=4)
    fused = RobeEmbeddingBagCollection(tables, robe, is_weighted=True)
    dense = copy.deepcopy(fused)
    apply_optimizer_in_backward(torch.optim.Adagrad, [fused.weight], {"lr": 0.1})
    opt = torch.optim.Adagrad([dense.weight], lr=0.1)
    kjt = random_kjt(tables, weighted=True, seed=9)
    grads = []
    for module in (fused, dense):
        w = kjt.weights().clone().requires_grad_(psw_requires_grad)
        batch = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=w)
        module(batch).values().square().sum().backward()
        grads.append(w.grad)
    opt.step()
    torch.testing.assert_close(fused.weight, dense.weight, rtol=1e-5, atol=1e-6)
    if psw_requires_grad:
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    else:
        assert grads == [None, None]


def test_fused_array_steps_only_when_the_backward_reaches_it():
    """As a stock table's in-backward optimizer, which runs when its weight's gradient is
    accumulated: the gradient of the per-sample weights alone (``autograd.grad``,
    ``backward(inputs=...)``) leaves the array alone, and a plain backward steps it."""
    tables = make_tables()
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=300, block_size=4),
                                     is_weighted=True)
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.5})
    kjt = random_kjt(tables, weighted=True, seed=11)

    def weighted():
        w = kjt.weights().clone().requires_grad_()
        batch = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                  weights=w)
        return ebc(batch).values().square().sum(), w

    before = ebc.weight.detach().clone()
    loss, w = weighted()
    (alone,) = torch.autograd.grad(loss, [w])
    loss, w = weighted()
    loss.backward(inputs=[w])
    assert torch.equal(ebc.weight, before)
    torch.testing.assert_close(w.grad, alone)
    loss, w = weighted()
    loss.backward(inputs=[w, ebc.weight])  # names the array: it steps, as a stock table
    assert not torch.equal(ebc.weight, before)
    torch.testing.assert_close(w.grad, alone)  # the weights' gradient, before the update
    before = ebc.weight.detach().clone()
    loss, w = weighted()
    loss.backward()
    assert not torch.equal(ebc.weight, before)


@pytest.mark.parametrize("fused", [False, True])
def test_a_second_derivative_through_a_lookup_raises(fused):
    """The gradient ops have no derivative: differentiating a per-sample weights' gradient
    again raises (as TorchRec's embedding_bag does) instead of reading 0; a backward with
    create_graph=True whose result is not differentiated again still runs."""
    tables = make_tables()
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=300, block_size=4),
                                     is_weighted=True)
    if fused:
        apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.1})
    kjt = random_kjt(tables, weighted=True, seed=12)
    w = kjt.weights().clone().requires_grad_()
    batch = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                              weights=w)
    (grad,) = torch.autograd.grad(ebc(batch).values().square().sum(), [w], create_graph=True)
    with pytest.raises(NotImplementedError, match="cannot be differentiated again"):
        grad.sum().backward()


#: each feature's ids and bag lengths, and the keys of each case of the test below
_WEIGHTED_IDS = {"a": ([1, 2, 3], [2, 1]), "b": ([4, 5], [0, 2]), "x": ([9, 8], [1, 1])}
_WEIGHTED_KEYS = {"in order": ["a", "b"], "reordered": ["b", "a"], "extra key": ["x", "b", "a"],
                  "variable batch, reordered": ["b", "a"]}


def _weighted_inputs(case: str, weights: torch.Tensor) -> KeyedJaggedTensor:
    """The weighted KJT of ``case`` for the tables of :func:`_shared_feature_tables`: keys
    ``_WEIGHTED_KEYS[case]``, ids ``_WEIGHTED_IDS``, per-sample weights ``weights``."""
    keys = _WEIGHTED_KEYS[case]
    values = torch.tensor(sum((_WEIGHTED_IDS[k][0] for k in keys), []))
    lengths = torch.tensor(sum((_WEIGHTED_IDS[k][1] for k in keys), []))
    if case != "variable batch, reordered":
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)
    # b holds one bag for the 2 samples, a two
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.tensor([2, 2, 1]),
                             weights=weights, stride_per_key_per_rank=[[1], [2]],
                             inverse_indices=(keys, torch.tensor([[0, 0], [0, 1]])))


def _shared_feature_tables():
    # feature "a" feeds two tables (TorchRec names their outputs a@t0 and a@t1)
    return [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=20, feature_names=["a"]),
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=20,
                               feature_names=["a", "b"], pooling=PoolingType.MEAN)]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", ["in order", "reordered", "extra key",
                                  "variable batch, reordered"])
def test_per_sample_weight_gradients_whatever_the_keys(case, fused):
    """The per-sample weights' gradient for keys in another order, an extra key, a variable
    batch per feature and a feature that two tables look up: the output is linear in the
    weights, so weight p's gradient is the loss's slope along the output the one-hot weights
    e_p give (KeyedJaggedTensor.permute's own gradient gets these wrong, or crashes)."""
    ebc = RobeEmbeddingBagCollection(_shared_feature_tables(),
                                     RobeConfig(memory_size=256, block_size=4), is_weighted=True)
    if fused:  # the fused lookup's backward gives the weights' gradient and steps the array
        apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.0})
    count = sum(len(_WEIGHTED_IDS[k][0]) for k in _WEIGHTED_KEYS[case])
    weights = torch.rand(count, generator=torch.Generator().manual_seed(3)).requires_grad_()
    out = ebc(_weighted_inputs(case, weights)).values()
    slope = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * slope).sum().backward()
    with torch.no_grad():
        expected = torch.stack([(ebc(_weighted_inputs(case, one_hot)).values() * slope).sum()
                                for one_hot in torch.eye(count)])
    assert weights.grad is not None
    torch.testing.assert_close(weights.grad, expected, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_and_layout_check():
    tables = make_tables()
    robe = RobeConfig(memory_size=300, block_size=4)
    ebc = RobeEmbeddingBagCollection(tables, robe)
    sd = ebc.state_dict()
    assert set(sd) == {"weight", "robe_layout"}
    other = RobeEmbeddingBagCollection(tables, robe)
    other.load_state_dict(sd)
    kjt = random_kjt(tables)
    torch.testing.assert_close(other(kjt).values(), ebc(kjt).values())

    for changed, field in [
        (RobeConfig(memory_size=300, block_size=8), "block_size"),
        (RobeConfig(memory_size=300, block_size=4, seed=7), "seed"),
        (RobeConfig(memory_size=300, block_size=4, hash="mix"), "hash"),
        (RobeConfig(memory_size=301, block_size=4), "array_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            RobeEmbeddingBagCollection(tables, changed).load_state_dict(sd)
    with pytest.raises(ValueError, match="num_embeddings"):
        RobeEmbeddingBagCollection(make_tables(rows=(51, 300, 7)), robe).load_state_dict(sd)


def _equal_tables(names):
    return [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=100,
                               feature_names=[f"f_{n}"]) for n in names]


@pytest.mark.parametrize("shared", [True, False])
def test_a_checkpoint_of_tables_in_another_order_or_others_is_refused(shared):
    """Tables of one size in another order, or renamed, change no size in the layout, yet
    every table would read another's embeddings (its keys follow the tables before it): the
    load is refused, naming both orders. Stock TorchRec keys its state dict by table name."""
    robe = RobeConfig(memory_size=256, block_size=4, shared=shared)
    sd = RobeEmbeddingBagCollection(_equal_tables(["a", "b"]), robe).state_dict()
    with pytest.raises(ValueError, match=r"the same tables in another order: checkpoint "
                                         r"\['a', 'b'\] vs module \['b', 'a'\]"):
        RobeEmbeddingBagCollection(_equal_tables(["b", "a"]), robe).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"other tables: checkpoint \['a', '<a table this "
                                         r"module does not have>'\] vs module \['a', 'c'\]"):
        RobeEmbeddingBagCollection(_equal_tables(["a", "c"]), robe).load_state_dict(sd)


def test_a_checkpoint_without_table_names_loads_with_a_warning():
    """A ``robe_layout`` of format 1 (saved before names were recorded) loads when all else
    matches, warning that the order cannot be checked; another layout is still refused."""
    robe = RobeConfig(memory_size=256, block_size=4)
    saved = RobeEmbeddingBagCollection(_equal_tables(["a", "b"]), robe)
    with torch.no_grad():
        saved.weight.add_(1.0)  # trained, say
    sd = saved.state_dict()
    # format 1: the header, then (num_embeddings, embedding_dim, array_size) a table
    header, tables = sd["robe_layout"][:6].clone(), sd["robe_layout"][6:].view(-1, 4)
    header[0] = 1
    sd["robe_layout"] = torch.cat([header, tables[:, 1:].reshape(-1)])
    loaded = RobeEmbeddingBagCollection(_equal_tables(["a", "b"]), robe)
    with pytest.warns(UserWarning, match=r"format 1 holds no table names.*\['a', 'b'\]"):
        loaded.load_state_dict(sd)
    assert torch.equal(loaded.weight, saved.weight)
    assert torch.equal(loaded.robe_layout, saved.robe_layout)  # the current format
    with pytest.raises(ValueError, match="block_size: checkpoint 4 vs module 8"):
        RobeEmbeddingBagCollection(_equal_tables(["a", "b"]), RobeConfig(
            memory_size=256, block_size=8)).load_state_dict(sd)
    sd["robe_layout"] = torch.cat([torch.tensor([9]), sd["robe_layout"][1:]])
    with pytest.raises(ValueError, match="format 9, which this robe_torchrec does not know"):
        loaded.load_state_dict(sd)


def test_layout_is_one_immutable_object():
    tables = make_tables()  # t0 has features f0 and f_extra
    robe = RobeConfig(memory_size=300, block_size=4)
    ebc = RobeEmbeddingBagCollection(tables, robe)
    layout = ebc.layout
    assert layout == RobeLayout.build(tables, robe)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.array_sizes = (1,)  # type: ignore[misc]
    assert layout.feature_names == ["f0", "f_extra", "f1", "f2"]
    assert layout.array_sizes == (300,) and layout.memory_size == ebc.memory_size
    assert [f.row_offset for f in layout.features] == [0, 0, 50, 350]
    assert layout.feature("f1").pooling == m.Pooling.MEAN
    assert torch.equal(layout.table_meta(), ebc.table_meta)
    # the checkpoint format: a header, then (name's fingerprint, num_embeddings, dim, array
    # size) per table
    names = [name_fingerprint(t) for t in ("t0", "t1", "t2")]
    assert ebc.state_dict()["robe_layout"].tolist() == [
        2, 0, 1024, 4, 1, 3, names[0], 50, 8, 300, names[1], 300, 5, 300, names[2], 7, 16, 300]
    split = RobeLayout.build(tables, RobeConfig(memory_size=300, block_size=4, shared=False))
    assert split.array_offsets == (0, split.array_sizes[0], sum(split.array_sizes[:2]))
    assert [f.array for f in split.features] == [0, 0, 1, 2]


def test_dlrm_swap_trains():
    from torchrec.models.dlrm import DLRM

    from robe_torchrec.data.synthetic import NUM_DENSE, SyntheticCriteo

    data = SyntheticCriteo(batch_size=256, cardinality_scale=1e-3, seed=1, num_sparse=8)
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=n, feature_names=[k])
              for k, n in zip(data.keys, data.cardinalities)]
    model = DLRM(embedding_bag_collection=RobeEmbeddingBagCollection(tables, RobeConfig(compression=10, block_size=4)),
                 dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    losses = []
    for batch in data.batches(count=60):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(batch.dense_features, batch.sparse_features).squeeze(-1), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.02
