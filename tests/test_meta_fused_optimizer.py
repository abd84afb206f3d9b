"""An in-backward optimizer applied to a ROBE module stays with its array when the array is
replaced: ``to_empty`` from the meta device (then ``reset_parameters``, or TorchRec's
``init_parameters``), ``.to`` under torch's ``overwrite_module_params_on_conversion``, and
``load_state_dict(assign=True)``. Before, the new array had lost what
``apply_optimizer_in_backward`` recorded: it got a dense gradient that nothing applied, and
never changed, silently. Pooled and unpooled modules, every fused optimizer, outside DMP
(``tests/distributed/test_meta_init.py`` covers DMP)."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
import torchrec
from torch import nn
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.utils import init_parameters
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection, RobeEmbeddingCollection

ROBE = RobeConfig(memory_size=301, block_size=4)
STEPS = 3
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "rowwise_adagrad": (torchrec.optim.RowWiseAdagrad, {"lr": 0.1}),
}


def build(kind: str, device: Optional[str] = None) -> nn.Module:
    if kind == "pooled":
        tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=500,
                                     feature_names=["f0", "f1"])]
        return RobeEmbeddingBagCollection(tables, ROBE, device=device)
    tables = [EmbeddingConfig(name="t0", embedding_dim=8, num_embeddings=500,
                              feature_names=["f0", "f1"])]
    return RobeEmbeddingCollection(tables, ROBE, device=device)


def train(module: nn.Module, steps: int = STEPS) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (8,), generator=g)
        kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.randint(0, 500, (int(lengths.sum()),),
                                                                        generator=g),
                                lengths=lengths)
        out = module(kjt)
        values = (out.values() if isinstance(module, RobeEmbeddingBagCollection)
                  else torch.cat([jt.values() for jt in out.values()]))
        (values - 0.5).square().sum().backward()


def apply(module: nn.Module, optimizer: str) -> None:
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, module.parameters(), dict(kwargs))


def trained_on_cpu(kind: str, optimizer: str,
                   before: Callable[[nn.Module], None] = lambda m: None) -> nn.Module:
    torch.manual_seed(0)
    module = build(kind)
    apply(module, optimizer)
    before(module)
    train(module)
    return module


def materialise(module: nn.Module, how: str) -> None:
    """As the module's docs say: ``to_empty`` then ``reset_parameters`` after the seed, or
    TorchRec's ``init_parameters`` (both), here on a model holding the module."""
    torch.manual_seed(0)
    if how == "reset_parameters":
        module.to_empty(device="cpu")
        torch.manual_seed(0)
        module.reset_parameters()
    else:
        holder = nn.ModuleDict({"embeddings": module})
        init_parameters(holder, torch.device("cpu"))


def check_trained_alike(module: nn.Module, expected: nn.Module) -> None:
    assert module.weight.grad is None, "a dense gradient: the optimizer was not fused"
    assert module.fused_optimizer is not None and module.fused_optimizer.param is module.weight
    assert not module.fused_optimizer.param_state or all(
        not t.is_meta for t in module.fused_optimizer.param_state.values())
    assert torch.equal(module.weight, expected.weight)


@pytest.mark.parametrize("kind", ["pooled", "unpooled"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("how", ["reset_parameters", "init_parameters"])
def test_meta_built_trains_as_cpu_built(kind, optimizer, how):
    expected = trained_on_cpu(kind, optimizer)
    module = build(kind, device="meta")
    apply(module, optimizer)
    materialise(module, how)
    start = module.weight.detach().clone()
    train(module)
    assert not torch.equal(module.weight, start)
    check_trained_alike(module, expected)
    assert module.in_backward_optimizer() == OPTIMIZERS[optimizer]


@pytest.mark.parametrize("kind", ["pooled", "unpooled"])
def test_fused_optimizer_read_on_meta_keeps_its_settings(kind):
    """``fused_optimizer`` read (and its learning rate changed) before ``to_empty``: its
    state, made on the meta device, is made again on the new array; the settings stay."""
    def slower(module):
        module.fused_optimizer.param_groups[0]["lr"] = 0.02

    expected = trained_on_cpu(kind, "adagrad", before=slower)
    module = build(kind, device="meta")
    apply(module, "adagrad")
    slower(module)
    assert module.fused_optimizer.param_state["sum"].is_meta
    materialise(module, "reset_parameters")
    train(module)
    check_trained_alike(module, expected)
    assert module.fused_optimizer.param_groups[0]["lr"] == 0.02


def test_to_with_overwritten_parameters_keeps_the_state():
    """``.to(float64)`` under ``overwrite_module_params_on_conversion`` makes a new array
    halfway through training: the optimizer and its state (Adam's moments, the step) carry
    on as with the default ``.to``, which keeps the array object."""
    def half_then_float64(overwrite: bool) -> nn.Module:
        torch.manual_seed(0)
        module = build("pooled")
        apply(module, "adam")
        train(module, 2)
        before = module.weight
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        try:
            module.to(torch.float64)
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)
        assert (module.weight is before) != overwrite
        train(module, 2)
        return module

    module, expected = half_then_float64(True), half_then_float64(False)
    assert int(module.fused_optimizer.param_state["step"]) == 4
    check_trained_alike(module, expected)


def test_load_state_dict_assign_keeps_the_optimizer():
    expected = trained_on_cpu("pooled", "adagrad")
    torch.manual_seed(0)
    saved = build("pooled").state_dict()
    module = build("pooled")
    apply(module, "adagrad")
    module.load_state_dict(saved, assign=True)
    assert module.weight is saved["weight"] or module.weight.data_ptr() == saved["weight"].data_ptr()
    train(module)
    check_trained_alike(module, expected)
