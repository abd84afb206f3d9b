"""The fused optimizers' front end (robe_torchrec.optim): which optimizers are fused, row-wise
Adagrad through apply_optimizer_in_backward (torchrec's class and ours), and state that
follows module.to(dtype)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchrec.optim
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.fused_lookup import fused_lookup
from robe_torchrec.ops import reference
from robe_torchrec.ops.args import LookupArgs
from robe_torchrec.ops.meta import Optimizer, rowwise_state_size
from robe_torchrec.optim import RobeFusedOptimizer, RowWiseAdagrad, resolve_optimizer
from robe_torchrec.rowwise_install import install_rowwise_adagrad

BLOCK = 4


def _module() -> RobeEmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=1000,
                                 feature_names=["f1"]),
              EmbeddingBagConfig(name="t2", embedding_dim=6, num_embeddings=300,
                                 feature_names=["f2"])]
    return RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=1001, block_size=BLOCK))


def _kjt() -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (8,), generator=g)
    values = torch.randint(0, 300, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=values, lengths=lengths)


def _args(module, kjt) -> LookupArgs:
    offsets = kjt.offsets().to(kjt.values().dtype)
    return LookupArgs(kjt.values(), offsets, None, module.layout.op_args(module.table_meta))


def _grad_output(dtype, seed):
    return torch.randn(4, 14, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------------------------------
# which optimizers are fused
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [torchrec.optim.RowWiseAdagrad, RowWiseAdagrad])
def test_rowwise_adagrad_resolves(cls):
    kwargs = {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.01, "initial_accumulator_value": 0.1}
    assert resolve_optimizer(cls, kwargs) == Optimizer.ROWWISE_ADAGRAD
    with pytest.raises(ValueError, match="lr_decay=0 only"):
        resolve_optimizer(cls, {"lr": 0.1, "lr_decay": 0.5})


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.RMSprop, {"lr": 0.1}),
    (torch.optim.AdamW, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}),
    (torchrec.optim.Adagrad, {"lr": 0.1}),   # FBGEMM placeholders
    (torchrec.optim.PartialRowWiseAdam, {"lr": 0.1}),
    (torchrec.optim.LAMB, {"lr": 0.1}),
    (torchrec.optim.LarsSGD, {"lr": 0.1}),
])
def test_other_optimizers_are_refused_naming_the_supported_ones(cls, kwargs):
    with pytest.raises(ValueError) as err:
        resolve_optimizer(cls, kwargs)
    for name in ("torch.optim.SGD", "torch.optim.Adagrad", "torch.optim.Adam",
                 "torchrec.optim.RowWiseAdagrad"):
        assert name in str(err.value)


def test_rowwise_needs_the_block_size():
    with pytest.raises(ValueError, match="block_size"):
        RobeFusedOptimizer("weight", torch.zeros(10), RowWiseAdagrad, {"lr": 0.1})


def test_robe_rowwise_adagrad_class():
    """It can be applied in backward to a 1-D array (torchrec's raises IndexError there) and
    is torchrec's optimizer on 2-D parameters."""
    array = torch.nn.Parameter(torch.zeros(10))
    apply_optimizer_in_backward(RowWiseAdagrad, [array], {"lr": 0.1})
    table = torch.nn.Parameter(torch.ones(3, 4))
    ours, theirs = RowWiseAdagrad([table], lr=0.1), torchrec.optim.RowWiseAdagrad(
        [table], lr=0.1)
    assert ours.defaults == theirs.defaults
    assert ours.state[table]["sum"].shape == (3, 1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        RowWiseAdagrad([array], lr=-1.0)
    array.grad = torch.ones(10)
    with pytest.raises(RuntimeError, match="updated inside backward"):
        RowWiseAdagrad([array], lr=0.1).step()


# ---------------------------------------------------------------------------------------
# torchrec's own RowWiseAdagrad takes the array (robe_torchrec.rowwise_install)
# ---------------------------------------------------------------------------------------

def _remade(how: str) -> RobeEmbeddingBagCollection:
    """The module after each way its weight is re-created."""
    module = _module()
    if how == "meta":
        module = RobeEmbeddingBagCollection(module.embedding_bag_configs(),
                                            RobeConfig(memory_size=1001, block_size=BLOCK),
                                            device="meta")
        module.to_empty(device="cpu")
        module.reset_parameters()
    elif how == "float64":
        module.to(torch.float64)
    elif how == "deepcopy":
        module = copy.deepcopy(module)
    elif how == "assign":
        module.load_state_dict(_module().state_dict(), assign=True)
    return module


@pytest.mark.parametrize("how", ["built", "meta", "float64", "deepcopy", "assign"])
def test_torchrec_rowwise_adagrad_takes_the_array(how):
    module = _remade(how)
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, module.parameters(), {"lr": 0.1})
    in_backward = module.weight._in_backward_optimizers[0]
    assert module.weight not in in_backward.state   # the fused optimizer holds it
    assert module.fused_optimizer.kind == Optimizer.ROWWISE_ADAGRAD


def test_torchrec_rowwise_adagrad_is_unchanged_for_other_parameters(monkeypatch):
    """Next to a ROBE array, a table gets torchrec's state and update bitwise; a 1-D
    parameter that is no array fails as in torchrec; an array with a gradient is refused."""
    cls = torchrec.optim.RowWiseAdagrad
    module = _module()
    table = torch.nn.Parameter(torch.randn(5, 3))
    twin = torch.nn.Parameter(table.detach().clone())
    kwargs = {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.01, "initial_accumulator_value": 0.1}
    grads = [torch.randn(5, 3) for _ in range(2)]
    ours = cls([{"params": [module.weight, table]}], **kwargs)
    with monkeypatch.context() as m:  # torchrec as shipped
        m.setattr(cls, "__init__", cls.__init__.robe_wraps)
        m.setattr(cls, "step", cls.step.robe_wraps)
        stock = cls([twin], **kwargs)
        for g in grads:
            twin.grad = g.clone()
            stock.step()
        with pytest.raises(IndexError):
            cls([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(IndexError):
        cls([torch.nn.Parameter(torch.zeros(3))])
    assert ours.param_groups[0]["params"] == [module.weight, table]
    assert set(ours.state) == {table}
    for g in grads:
        table.grad = g.clone()
        ours.step()
    assert torch.equal(table, twin)
    for key in ("sum", "step"):
        assert torch.equal(ours.state[table][key], stock.state[twin][key])
    module.weight.grad = torch.ones_like(module.weight)
    with pytest.raises(RuntimeError, match="updated inside backward"):
        ours.step()


def test_install_is_idempotent():
    cls = torchrec.optim.RowWiseAdagrad
    assert hasattr(cls.__init__, "robe_wraps")  # installed by importing robe_torchrec
    install_rowwise_adagrad()
    install_rowwise_adagrad()
    for method in (cls.__init__, cls.step):
        assert not hasattr(method.robe_wraps, "robe_wraps")


# ---------------------------------------------------------------------------------------
# row-wise Adagrad through the fused lookup
# ---------------------------------------------------------------------------------------

def test_rowwise_adagrad_through_fused_lookup():
    module, kjt = _module(), _kjt()
    kwargs = {"lr": 0.1, "eps": 1e-8, "initial_accumulator_value": 0.1}
    apply_optimizer_in_backward(RowWiseAdagrad, [module.weight], kwargs)
    opt = RobeFusedOptimizer("weight", module.weight, RowWiseAdagrad, kwargs, block_size=BLOCK)
    rows = rowwise_state_size(module.weight.numel(), BLOCK)
    assert opt.param_state["sum"].shape == (rows,)
    expected_w = module.weight.detach().clone()
    expected_s = torch.full((rows,), 0.1)
    args = _args(module, kjt)
    for step in (1, 2):
        g = _grad_output(torch.float32, step)
        (fused_lookup(module.weight, opt, args) * g).sum().backward()
        reference.backward_fused_(g, expected_w, expected_s, torch.empty(0), *args.flat()[:3],
                                  args.layout.table_meta, BLOCK, args.layout.hash_mode,
                                  args.layout.hash_params, int(Optimizer.ROWWISE_ADAGRAD),
                                  opt.hparams(), step)
    torch.testing.assert_close(module.weight.detach(), expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.param_state["sum"], expected_s, rtol=1e-5, atol=1e-6)
    assert int(opt.param_state["step"]) == 2


# ---------------------------------------------------------------------------------------
# the state follows module.to(dtype)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [torch.optim.Adagrad, torch.optim.Adam])
def test_state_follows_module_to_float64(cls):
    module, kjt = _module(), _kjt()
    apply_optimizer_in_backward(cls, [module.weight], {"lr": 0.05})
    (module(kjt).values() * _grad_output(torch.float32, 1)).sum().backward()
    opt = module.fused_optimizer
    keys = [k for k in opt.param_state if k != "step"]
    before_w = module.weight.detach().double()
    before = {k: opt.param_state[k].double() for k in keys}

    module.to(torch.float64)
    g = _grad_output(torch.float64, 2)
    out = module(kjt).values()
    assert out.dtype == torch.float64
    (out * g).sum().backward()

    state1, state2 = before[keys[0]], before.get("exp_avg_sq", torch.empty(0, dtype=torch.float64))
    args = _args(module, kjt)
    reference.backward_fused_(g, before_w, state1, state2, *args.flat()[:3],
                              args.layout.table_meta, BLOCK, args.layout.hash_mode,
                              args.layout.hash_params, int(opt.kind), opt.hparams(), 2)
    assert module.weight.dtype == torch.float64
    torch.testing.assert_close(module.weight.detach(), before_w, rtol=1e-12, atol=1e-12)
    for key in keys:
        assert opt.param_state[key].dtype == torch.float64
    torch.testing.assert_close(opt.param_state[keys[0]], state1, rtol=1e-12, atol=1e-12)
    assert int(opt.param_state["step"]) == 2


# ---------------------------------------------------------------------------------------
# capturable=True through apply_optimizer_in_backward (the Triton path with its step on the
# device: tests/ops/test_capturable_adam.py)
# ---------------------------------------------------------------------------------------

CAPTURABLE_STEPS = 3


def _train(module: RobeEmbeddingBagCollection, steps: int, first_seed: int = 0) -> None:
    for seed in range(first_seed, first_seed + steps):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 4, (8,), generator=g)
        values = torch.randint(0, 300, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=values,
                                                  lengths=lengths)
        (module(kjt).values() - 0.5).square().sum().backward()


def _adam_module(capturable: bool) -> RobeEmbeddingBagCollection:
    module = _module()
    apply_optimizer_in_backward(torch.optim.Adam, [module.weight],
                                {"lr": 0.01, "capturable": capturable})
    return module


def test_module_trains_as_without_capturable():
    plain, capturable = _adam_module(False), _adam_module(True)
    _train(plain, CAPTURABLE_STEPS)
    _train(capturable, CAPTURABLE_STEPS)
    assert not torch.equal(plain.weight, _module().weight)
    assert torch.equal(capturable.weight, plain.weight)
    state, plain_state = capturable.fused_optimizer.param_state, plain.fused_optimizer.param_state
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key], plain_state[key])
    assert state["step"].device == capturable.weight.device and float(state["step"]) == CAPTURABLE_STEPS


@pytest.mark.parametrize("saved_capturable", [True, False])
def test_state_dict_round_trip(saved_capturable):
    """A capturable optimizer's state loads into a capturable or a plain one (and a plain
    one's into a capturable one): the step keeps the loading optimizer's place, and both
    then train alike."""
    saved = _adam_module(saved_capturable)
    _train(saved, 2)
    for capturable in (True, False):
        loaded = _adam_module(capturable)
        loaded.load_state_dict(saved.state_dict())
        loaded.fused_optimizer.load_state_dict(saved.fused_optimizer.state_dict())
        step = loaded.fused_optimizer.param_state["step"]
        assert float(step) == 2
        assert step.device == (loaded.weight.device if capturable else torch.device("cpu"))
        reference = _adam_module(saved_capturable)
        reference.load_state_dict(saved.state_dict())
        reference.fused_optimizer.load_state_dict(saved.fused_optimizer.state_dict())
        _train(loaded, 1, first_seed=2)
        _train(reference, 1, first_seed=2)
        assert torch.equal(loaded.weight, reference.weight)
        assert float(loaded.fused_optimizer.param_state["step"]) == 3
