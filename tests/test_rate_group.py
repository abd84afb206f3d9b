"""``RateGroup``: the fused optimizer's param group, whose ``"lr"`` the ops read from a tensor
kept in step with it however the rate is written: by a scheduler, by TorchRec's
``WarmupOptimizer`` and ``load_state_dict``, in a copy or a pickled optimizer."""

import copy
import doctest
import pickle

import pytest
import torch
from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

from robe_torchrec import rate_group
from robe_torchrec.optim import RobeFusedOptimizer
from robe_torchrec.rate_group import RateGroup


def _optimizer(lr=0.1):
    param = torch.nn.Parameter(torch.zeros(16))
    return RobeFusedOptimizer("weight", param, torch.optim.Adagrad, {"lr": lr})


def _rate(optimizer) -> float:
    rate, hparams = optimizer.rate_and_hparams()
    assert hparams[0] == 0.0  # the ops read the tensor, not this
    return float(rate)


def test_the_docstring_example_runs():
    result = doctest.testmod(rate_group, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("write", [
    lambda group: group.__setitem__("lr", 0.25),
    lambda group: group.update({"lr": 0.25}),
    lambda group: group.update(lr=0.25),
    lambda group: group.__ior__({"lr": 0.25}),
])
def test_every_write_of_the_rate_reaches_the_tensor(write):
    optimizer = _optimizer()
    write(optimizer.param_groups[0])
    assert _rate(optimizer) == 0.25


def test_a_scheduler_and_torchrecs_warmup_set_the_rate():
    optimizer = _optimizer(0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()
    scheduler.step()
    assert _rate(optimizer) == pytest.approx(0.05)
    warmup = WarmupOptimizer(optimizer, [WarmupStage(WarmupPolicy.LINEAR, max_iters=4,
                                                     value=0.5)], lr=0.2)
    assert _rate(optimizer) == pytest.approx(0.2 * 0.5)
    warmup.step()
    assert _rate(optimizer) == optimizer.param_groups[0]["lr"] != pytest.approx(0.1)


def test_a_tensor_rate_filled_in_place_is_read_at_each_step():
    """``torch.optim``'s recipe: a tensor ``lr`` that schedulers fill in place, which
    writes nothing into the group."""
    optimizer = _optimizer(torch.tensor(0.1))
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5).step()
    assert _rate(optimizer) == pytest.approx(0.05)
    optimizer.param_groups[0]["lr"].fill_(0.3)
    assert _rate(optimizer) == pytest.approx(0.3)
    optimizer.param_groups[0]["lr"] = 0.4  # back to a float
    assert _rate(optimizer) == pytest.approx(0.4)


def test_loading_a_state_dict_with_param_groups_sets_the_rate():
    source, target = _optimizer(0.3), _optimizer(0.1)
    for optimizer in (source, target):
        optimizer.save_param_groups(True)
    target.load_state_dict(source.state_dict())
    assert _rate(target) == pytest.approx(0.3)


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_a_copy_keeps_its_own_rate(duplicate):
    optimizer = _optimizer(0.1)
    optimizer.param_groups[0]["lr"] = 0.2
    twin = duplicate(optimizer)
    assert _rate(twin) == pytest.approx(0.2)
    twin.param_groups[0]["lr"] = 0.7
    assert _rate(twin) == pytest.approx(0.7) and _rate(optimizer) == pytest.approx(0.2)


def test_the_rate_follows_the_array_to_another_device():
    group = RateGroup({"lr": 0.5}, "cpu")
    assert group.rate("meta").device.type == "meta"
    assert group.rate("cpu").device.type == "cpu"


def test_a_tensor_rate_that_is_not_one_float_is_refused():
    with pytest.raises(ValueError, match="holds one float"):
        RateGroup({"lr": torch.tensor([0.1, 0.2])}, "cpu")
    with pytest.raises(ValueError, match="holds one float"):
        _optimizer().param_groups[0]["lr"] = torch.tensor(1)


def test_a_shallow_copy_gets_a_rate_of_its_own():
    group = RateGroup({"lr": 0.1}, "cpu")
    twin = copy.copy(group)
    twin["lr"] = 0.9
    assert float(twin.rate("cpu")) == 0.9 and float(group.rate("cpu")) == 0.1


@pytest.mark.parametrize("remove", [lambda g: g.pop("lr"), lambda g: g.__delitem__("lr"),
                                    lambda g: g.clear()])
def test_a_deleted_rate_is_missing_not_stale(remove):
    group = RateGroup({"lr": 0.1}, "cpu")
    remove(group)
    with pytest.raises(KeyError, match="lr"):
        group.rate("cpu")


def test_compiled_code_that_reads_the_param_groups_fails_inside_dynamo():
    """The documented limitation (docs/drop_in.md): Dynamo's handling of optimizers edits
    each of ``param_groups`` as a plain dict, which a dict subclass is not, and fails
    (torch 2.13). Eager steps of a scheduler, as every TorchRec train loop takes them, are
    unaffected. If this starts to compile, torch has fixed it: drop the limitation."""
    warmup = WarmupOptimizer(_optimizer(), [WarmupStage(WarmupPolicy.LINEAR, max_iters=4,
                                                        value=0.5)], lr=0.2)
    torch.compiler.reset()
    with pytest.raises(Exception, match="UserDefinedDictVariable"):
        torch.compile(warmup.step, backend="eager")()


def test_a_cpu_tensor_rate_reaches_another_device_without_a_pageable_copy():
    """A copy from pageable memory to a GPU makes the host wait for it: a CPU tensor rate
    is read on the host and filled in instead, and refused inside a capture, whose replays
    would repeat it. A device tensor is copied (queued on the stream)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert rate_group.read_on_host(cpu, cuda, capturing=False)
    assert not rate_group.read_on_host(cuda, cuda, capturing=True)
    assert not rate_group.read_on_host(cpu, cpu, capturing=False)
    with pytest.raises(RuntimeError, match="CPU tensor, which a CUDA graph's replays"):
        rate_group.read_on_host(cpu, cuda, capturing=True)
    # the fill carries the value: the meta device stands in for the GPU
    source = torch.tensor(0.25)
    group = RateGroup({"lr": source}, "cpu")
    source.fill_(0.125)  # as a scheduler writes it
    assert float(group.rate("cpu")) == 0.125 and group.rate("meta").device.type == "meta"
