"""RobeEmbeddingBagCollection as a first-class TorchRec module (unsharded): meta-device
construction and ``reset_parameters`` (of the module, and of a whole DLRM: its interaction's
buffer restored, also after DMP), ``torch.compile`` (inference, dense and fused
training, also under torch 2.11's AOTAutograd, emulated), extra input features ignored as
``EmbeddingBagCollection`` ignores them, and a TensorDict input taken as it takes one.

Export, save/load and fx tracing are in ``tests/test_export.py``."""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import io
import sys
import types

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig,
                      KeyedJaggedTensor, PoolingType)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.utils import init_parameters
from torchrec.models.dlrm import DLRM
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection, RobeEmbeddingCollection
from robe_torchrec.fused_lookup import autograd_anchor, fused_lookup
from robe_torchrec.ops.args import LookupArgs
from robe_torchrec.optim import RobeFusedOptimizer
from robe_torchrec.interaction import restore_interaction_buffers, use_fast_interaction
from tests.train.helpers import one_rank_group

BATCH = 4
NUM_DENSE = 5


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test compiles its own models; graphs left by earlier tests would count towards
    dynamo's recompile limit (a new learning rate, a new optimizer, recompile)."""
    torch.compiler.reset()


def make_tables():
    return [EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=100,
                               feature_names=["user", "user_hist"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=8, num_embeddings=40,
                               feature_names=["item"], pooling=PoolingType.MEAN)]


ROBE = RobeConfig(memory_size=120, block_size=4)


def make_kjt(seed=0, keys=("user", "user_hist", "item"), weighted=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * BATCH,), generator=g)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=weights)


def make_dlrm(ebc=None):
    ebc = ebc or RobeEmbeddingBagCollection(make_tables(), ROBE)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])


def dense_input(seed=0):
    return torch.rand(BATCH, NUM_DENSE, generator=torch.Generator().manual_seed(seed))


# --- meta device ---------------------------------------------------------------------------

def test_meta_then_reset_parameters_equals_direct_construction():
    torch.manual_seed(7)
    direct = RobeEmbeddingBagCollection(make_tables(), ROBE)
    module = RobeEmbeddingBagCollection(make_tables(), ROBE, device=torch.device("meta"))
    module.to_empty(device="cpu")
    torch.manual_seed(7)
    module.reset_parameters()
    assert torch.equal(module.weight, direct.weight)
    assert torch.equal(module.table_meta, direct.table_meta)
    assert torch.equal(module.state_dict()["robe_layout"], direct.state_dict()["robe_layout"])
    kjt = make_kjt()
    assert torch.equal(module(kjt).values(), direct(kjt).values())


def test_meta_then_load_state_dict():
    direct = RobeEmbeddingBagCollection(make_tables(), ROBE)
    module = RobeEmbeddingBagCollection(make_tables(), ROBE, device="meta")
    module.to_empty(device="cpu")
    module.load_state_dict(direct.state_dict())
    kjt = make_kjt()
    assert torch.equal(module(kjt).values(), direct(kjt).values())


@pytest.mark.parametrize("module_class", [RobeEmbeddingBagCollection, RobeEmbeddingCollection])
def test_meta_then_to_empty_alone_has_its_layout(module_class):
    """``to_empty`` alone leaves the array undrawn, as a stock module's tables, but the
    layout buffers (functions of the layout, not of any draw) are the module's own: the
    lookups run and read the array where a module built on CPU reads it."""
    tables = make_tables() if module_class is RobeEmbeddingBagCollection else [
        EmbeddingConfig(name=t.name, embedding_dim=t.embedding_dim,
                        num_embeddings=t.num_embeddings, feature_names=t.feature_names)
        for t in make_tables()]
    direct = module_class(copy.deepcopy(tables), ROBE)
    module = module_class(copy.deepcopy(tables), ROBE, device="meta")
    module.to_empty(device="cpu")
    assert torch.equal(module.table_meta, direct.table_meta)
    assert torch.equal(module.robe_layout, direct.robe_layout)
    if module_class is RobeEmbeddingCollection:  # its features as keys, for compiled graphs
        assert direct.keys_table_meta is not None
        assert torch.equal(module.keys_table_meta, direct.keys_table_meta)
    with torch.no_grad():
        module.weight.copy_(direct.weight)
    kjt = make_kjt()
    out, expected = module(kjt), direct(kjt)
    if module_class is RobeEmbeddingBagCollection:
        assert torch.equal(out.values(), expected.values())
    else:
        for key in expected:
            assert torch.equal(out[key].values(), expected[key].values()), key
    # a move between real devices leaves the buffers as they are
    module.table_meta.fill_(-1)
    module.to("cpu", torch.float32)
    assert (module.table_meta == -1).all()


def test_dlrm_with_meta_tables_materialised_as_torchrec_does():
    """TorchRec's pattern: the tables on meta, the dense arch on the device; the unsharded
    tables are then materialised with to_empty and reset_parameters."""
    torch.manual_seed(3)
    ebc = RobeEmbeddingBagCollection(make_tables(), ROBE)
    torch.manual_seed(4)
    direct = make_dlrm(ebc)

    ebc = RobeEmbeddingBagCollection(make_tables(), ROBE, device=torch.device("meta"))
    torch.manual_seed(4)
    model = make_dlrm(ebc)
    torch.manual_seed(3)
    init_parameters(ebc, torch.device("cpu"))  # to_empty, then reset_parameters
    assert model.state_dict().keys() == direct.state_dict().keys()
    for key, tensor in direct.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key
    kjt, dense = make_kjt(), dense_input()
    assert torch.equal(model(dense, kjt), direct(dense, kjt))


@pytest.mark.parametrize("embedding", ["robe", "robe_fast_interaction", "torchrec_ebc"])
def test_whole_dlrm_on_meta_with_its_interaction_buffers_restored(embedding):
    """The whole DLRM on meta, then TorchRec's init_parameters: the interaction's
    non-persistent triu_indices (stock EmbeddingBagCollection DLRM alike) is garbage until
    restore_interaction_buffers; then the model is the CPU-built one."""
    def build(device=None):
        ebc = (EmbeddingBagCollection(make_tables(), device=device) if embedding == "torchrec_ebc"
               else RobeEmbeddingBagCollection(make_tables(), ROBE, device=device))
        model = make_dlrm(ebc)
        return use_fast_interaction(model) if embedding == "robe_fast_interaction" else model

    torch.manual_seed(4)
    direct = build()
    with torch.device("meta"):
        model = build(torch.device("meta"))
    with pytest.raises(ValueError, match="still on the meta device"):
        restore_interaction_buffers(model)
    torch.manual_seed(4)
    init_parameters(model, torch.device("cpu"))  # to_empty, then reset_parameters
    assert restore_interaction_buffers(model) == 1
    buffers = dict(model.named_buffers())
    for name, buffer in direct.named_buffers():
        assert torch.equal(buffers[name], buffer), name
    if embedding == "torchrec_ebc":
        return  # its reset_parameters draws other values than its constructor
    for key, tensor in direct.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key
    kjt, dense = make_kjt(), dense_input()
    assert torch.equal(model(dense, kjt), direct(dense, kjt))


def test_whole_dlrm_on_meta_sharded_by_dmp():
    """DMP materialises a meta model's buffers as zeros: restored on the DMP, the model is
    the CPU-built one (one rank, in process)."""
    torch.manual_seed(4)
    direct = make_dlrm()
    with torch.device("meta"):
        model = make_dlrm(RobeEmbeddingBagCollection(make_tables(), ROBE,
                                                     device=torch.device("meta")))
    apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": 0.1})
    with one_rank_group():
        torch.manual_seed(4)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"))
        assert not dmp.module.inter_arch.triu_indices.any()  # zeros: every pair is (0, 0)
        assert restore_interaction_buffers(dmp) == 1
        assert torch.equal(dmp.module.inter_arch.triu_indices, direct.inter_arch.triu_indices)
        kjt, dense = make_kjt(), dense_input()
        assert torch.equal(dmp(dense, kjt), direct(dense, kjt))


# --- torch.compile -------------------------------------------------------------------------

@pytest.mark.parametrize("weighted", [False, True])
def test_compiled_module_equals_eager(weighted):
    module = RobeEmbeddingBagCollection(make_tables(), ROBE, is_weighted=weighted)
    compiled = torch.compile(module, fullgraph=True)
    for seed in range(2):
        kjt = make_kjt(seed, weighted=weighted)
        out = compiled(kjt)
        assert out.keys() == module(kjt).keys()
        assert torch.equal(out.values(), module(kjt).values())


def test_compiled_dlrm_equals_eager():
    model = make_dlrm()
    compiled = torch.compile(model, fullgraph=True)
    kjt, dense = make_kjt(), dense_input()
    torch.testing.assert_close(compiled(dense, kjt), model(dense, kjt))


def _train(model, steps, compiled=False, fused=None, lrs=None, eager_first=0, schedule=None,
           backend="aot_eager"):
    """SGD steps of a fixed loss on a DLRM; the optimizer is dense unless ``fused`` is given
    (then it updates the ROBE array in backward, and SGD the rest); with ``compiled``, the
    first ``eager_first`` steps run eagerly. ``schedule(fused_optimizer)``: a scheduler
    stepped after each step."""
    ebc = model.sparse_arch.embedding_bag_collection
    if fused is not None:
        apply_optimizer_in_backward(fused[0], [ebc.weight], fused[1])
    params = [p for p in model.parameters() if fused is None or p is not ebc.weight]
    opt = torch.optim.SGD(params, lr=0.05)
    scheduler = schedule(ebc.fused_optimizer) if schedule is not None else None
    run = torch.compile(model, fullgraph=True, backend=backend) if compiled else model
    for step in range(steps):
        if lrs is not None:
            ebc.fused_optimizer.param_groups[0]["lr"] = lrs[step]
        logits = (model if step < eager_first else run)(dense_input(step), make_kjt(step))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits.squeeze(-1), torch.arange(BATCH, dtype=torch.float32) % 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return model


def test_compiled_dense_training_equals_eager():
    torch.manual_seed(0)
    eager = make_dlrm()
    compiled = copy.deepcopy(eager)
    _train(eager, 3)
    _train(compiled, 3, compiled=True)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(eager.sparse_arch.embedding_bag_collection.weight,
                           make_dlrm().sparse_arch.embedding_bag_collection.weight)


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "capturable": True}),  # the step on the array's device
])
def test_compiled_fused_training_equals_eager(cls, kwargs):
    """The in-backward optimizer applied before any eager step, then compiled."""
    compiled = _fused_training_compiled_and_eager(cls, kwargs)
    state = compiled.sparse_arch.embedding_bag_collection.fused_optimizer.param_state
    if "step" in state:
        assert float(state["step"]) == 3


def _fused_training_compiled_and_eager(cls, kwargs):
    """Three steps of a DLRM with ``cls`` fused into backward, compiled before any eager
    step; checked against eager. Returns the compiled one."""
    torch.manual_seed(0)
    eager = make_dlrm()
    compiled = copy.deepcopy(eager)
    _train(eager, 3, fused=(cls, kwargs))
    _train(compiled, 3, compiled=True, fused=(cls, kwargs))
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    return compiled


def test_compiled_fused_learning_rate_change_takes_effect():
    torch.manual_seed(0)
    eager = make_dlrm()
    compiled = copy.deepcopy(eager)
    lrs = [0.1, 0.0, 0.3]
    _train(eager, 3, fused=(torch.optim.Adagrad, {"lr": 0.1}), lrs=lrs)
    _train(compiled, 3, compiled=True, fused=(torch.optim.Adagrad, {"lr": 0.1}), lrs=lrs)
    torch.testing.assert_close(compiled.sparse_arch.embedding_bag_collection.weight,
                               eager.sparse_arch.embedding_bag_collection.weight,
                               rtol=0, atol=1e-6)


def _warmup(fused_optimizer):
    """TorchRec's warmup schedule: a new float rate written into the group every step."""
    return WarmupOptimizer(fused_optimizer, [WarmupStage(WarmupPolicy.LINEAR, max_iters=8,
                                                          value=0.2)], lr=0.1)


def _tensor_rate_decay(fused_optimizer):
    """``torch.optim``'s recipe for compiled steps: the rate a tensor, filled in place by
    the scheduler."""
    return torch.optim.lr_scheduler.LambdaLR(fused_optimizer, lambda step: 1.0 / (step + 1))


@pytest.mark.parametrize("schedule,lr", [(_warmup, 0.1), (_tensor_rate_decay, "tensor")])
def test_compiled_fused_training_takes_a_new_rate_every_step_without_recompiling(schedule, lr):
    """The fused step reads its rate from a tensor the group keeps in step with ``"lr"``: a
    compiled model compiles once, not once per rate (Dynamo's limit is 8: the eager fallback,
    or with ``fullgraph=True`` an error), and trains as the eager one, each step with its
    own rate."""
    torch.manual_seed(0)
    eager, constant = make_dlrm(), make_dlrm()
    constant.load_state_dict(eager.state_dict())
    compiled = copy.deepcopy(eager)
    fused = lambda: (torch.optim.Adagrad, {"lr": torch.tensor(0.1) if lr == "tensor" else lr})
    counters = [CompileCounterWithBackend("aot_eager") for _ in range(2)]
    _train(eager, 10, fused=fused(), schedule=schedule)
    _train(compiled, 10, compiled=True, fused=fused(), schedule=schedule, backend=counters[0])
    torch.compiler.reset()
    _train(constant, 10, compiled=True, fused=fused(), backend=counters[1])
    # a new number of ids recompiles once (dynamic shapes), whatever the rates
    assert counters[0].frame_count == counters[1].frame_count <= 3
    weights = [m.sparse_arch.embedding_bag_collection.weight for m in (eager, compiled, constant)]
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-6)
    assert (weights[0] - weights[2]).abs().max() > 1e-4  # the schedule did change the steps


# --- torch 2.11's AOTAutograd: a write in backward to an input that requires grad ------------

@pytest.fixture
def aot_autograd_of_torch_211(monkeypatch):
    """AOTAutograd as torch 2.11 has it: a forward input written in the backward (the fused
    optimizer's array) is copied back with grad mode on, so an input that requires grad
    fails to compile ("a leaf Variable that requires grad is being used in an in-place
    operation"; the fix, pytorch/pytorch#178622, wraps that copy in no_grad). The GPU
    machine's torch 2.11 fails a compiled DLRM with exactly this message. Emulated here by
    taking no_grad away from that one function."""
    wrappers = importlib.import_module("torch._functorch._aot_autograd.graph_capture_wrappers")
    helper = "_functionalized_f_helper"
    source = inspect.getsource(wrappers)
    # if torch restructures this, the emulation must be rewritten, not silently pass
    assert f"def {helper}(" in source and "before.copy_(after)" in source

    class Torch211(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        def no_grad(self):
            if sys._getframe(1).f_code.co_name == helper:
                return contextlib.nullcontext()
            return torch.no_grad()

    monkeypatch.setattr(wrappers, "torch", Torch211("torch"))


def _train_compiled_fused_lookup(requires_grad):
    """One step of a compiled lookup whose backward writes the array (fused SGD); returns
    whether the array changed."""
    module = RobeEmbeddingBagCollection(make_tables(), ROBE)
    weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=requires_grad)
    kjt = make_kjt()
    args = LookupArgs(kjt.values(), kjt.offsets(), None, module.layout.op_args(module.table_meta))
    optimizer = RobeFusedOptimizer("weight", weight, torch.optim.SGD, {"lr": 0.1},
                                   block_size=module.layout.block_size)
    anchor = autograd_anchor("cpu")
    run = torch.compile(lambda: fused_lookup(weight, optimizer, args, anchor).sum(),
                        fullgraph=True, backend="aot_eager")
    run().backward()
    return not torch.equal(weight, module.weight)


def test_torch_211_emulation_fails_an_array_that_requires_grad(aot_autograd_of_torch_211):
    """The control: the emulation reproduces the failure; the same graph on an array that
    does not require grad compiles and trains."""
    with pytest.raises(Exception, match="leaf Variable that requires grad"):
        _train_compiled_fused_lookup(requires_grad=True)
    torch.compiler.reset()
    assert _train_compiled_fused_lookup(requires_grad=False)


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "capturable": True}),  # the step written in backward too
])
def test_compiled_fused_training_with_torch_211_aot_autograd(aot_autograd_of_torch_211, cls,
                                                             kwargs):
    """A model compiled before any eager step trains as eager does: the array leaves
    autograd when the optimizer is found, before the graph takes it as an input."""
    _fused_training_compiled_and_eager(cls, kwargs)


def test_compiled_after_eager_steps_with_torch_211_aot_autograd(aot_autograd_of_torch_211):
    """Eager steps keep the array's requires_grad (the user's: off means frozen); the trace
    that follows takes it out of autograd before reading it, and the training goes on as
    eager's."""
    torch.manual_seed(0)
    eager = make_dlrm()
    mixed = copy.deepcopy(eager)
    fused = (torch.optim.Adagrad, {"lr": 0.1})
    _train(eager, 3, fused=fused)
    _train(mixed, 3, compiled=True, fused=fused, eager_first=1)
    for (name, a), b in zip(eager.named_parameters(), mixed.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


def test_fused_array_gets_no_gradient():
    """As FBGEMM's fused tables: once an optimizer is applied in backward, the fused
    backward updates the array, no gradient reaches it, and a dense optimizer given every
    parameter leaves it alone; its requires_grad stays the user's (off: frozen, below). A
    move that replaces the array keeps the optimizer applied to it."""
    model = make_dlrm()
    ebc = model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.1})
    dense = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        before = ebc.weight.detach().clone()
        model(dense_input(step), make_kjt(step)).sum().backward()
        assert ebc.weight.requires_grad and ebc.weight.grad is None
        assert not torch.equal(ebc.weight, before)  # updated by the fused SGD
        dense.step()
    old = ebc.weight
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        ebc.double()  # a new array object
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert ebc.weight is not old and ebc.in_backward_optimizer() is not None
    before = ebc.weight.detach().clone()
    ebc(make_kjt()).values().sum().backward()
    assert ebc.weight.grad is None and not torch.equal(ebc.weight, before)


@pytest.mark.parametrize("trained_first", [False, True])
def test_a_frozen_array_is_left_alone_by_its_in_backward_optimizer(trained_first):
    """``model.requires_grad_(False)`` freezes the ROBE array as it freezes a stock table
    with an optimizer applied in backward (whose optimizer then gets no gradient): the
    dense layers still train, the array does not, and it trains again once unfrozen. The
    freeze survives a move that replaces the array."""
    model = make_dlrm()
    ebc = model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    if trained_first:
        model(dense_input(0), make_kjt(0)).sum().backward()
    ebc.requires_grad_(False)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        ebc.float()  # a new array object
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    before = ebc.weight.detach().clone()
    model(dense_input(1), make_kjt(1)).sum().backward()
    assert torch.equal(ebc.weight, before)
    assert next(model.over_arch.parameters()).grad is not None  # the dense part trains on
    ebc.requires_grad_(True)
    model(dense_input(2), make_kjt(2)).sum().backward()
    assert not torch.equal(ebc.weight, before)


def test_a_frozen_copy_as_teacher_is_not_trained_by_the_student_loss():
    """Distillation: a deep copy of the student, frozen, whose output enters the loss
    without no_grad. The student trains; the teacher does not (its copy of the fused
    optimizer stays idle), eager and compiled."""
    student = RobeEmbeddingBagCollection(make_tables(), ROBE)
    apply_optimizer_in_backward(torch.optim.Adagrad, [student.weight], {"lr": 0.1})
    student(make_kjt(0)).values().sum().backward()
    teacher = copy.deepcopy(student).requires_grad_(False)
    compiled = torch.compile(teacher, fullgraph=True, backend="aot_eager")
    for run in (teacher, compiled):
        kept, trained = teacher.weight.detach().clone(), student.weight.detach().clone()
        kjt = make_kjt(1)
        (student(kjt).values() * run(kjt).values()).sum().backward()
        assert torch.equal(teacher.weight, kept)
        assert not torch.equal(student.weight, trained)


@pytest.mark.parametrize("tied_after_training", [False, True])
def test_modules_sharing_an_array_share_its_fused_optimizer(tied_after_training):
    """``b.weight = a.weight``: one array, one in-backward optimizer state, as one parameter
    has one; each call steps it, as one module called twice in a forward does. Tied after
    ``b`` trained on an array of its own, ``b`` drops that array's optimizer."""
    tables = make_tables()
    torch.manual_seed(0)
    a, b = (RobeEmbeddingBagCollection(tables, ROBE) for _ in range(2))
    torch.manual_seed(0)
    once = RobeEmbeddingBagCollection(tables, ROBE)
    if tied_after_training:
        apply_optimizer_in_backward(torch.optim.Adagrad, [b.weight], {"lr": 0.1})
        b(make_kjt(0)).values().sum().backward()
    b.weight = a.weight
    for module in (a, once):
        apply_optimizer_in_backward(torch.optim.Adagrad, [module.weight], {"lr": 0.1})
    for step in range(3):
        kjt = make_kjt(step)
        (a(kjt).values().sum() + 2 * b(kjt).values().sum()).backward()
        (once(kjt).values().sum() + 2 * once(kjt).values().sum()).backward()
    assert a.fused_optimizer is b.fused_optimizer
    torch.testing.assert_close(a.weight, once.weight, rtol=0, atol=1e-6)


def test_a_deep_copy_keeps_the_fused_optimizer():
    """``Parameter.__deepcopy__`` drops what ``apply_optimizer_in_backward`` recorded (a
    stock EmbeddingBagCollection's copy loses it too). A ROBE module's copy records it again
    on its array, with its copy of the fused optimizer's state, and trains as the original
    does from there; without that it would not train at all."""
    ebc = RobeEmbeddingBagCollection(make_tables(), ROBE)
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    ebc(make_kjt(0)).values().sum().backward()
    twin = copy.deepcopy(ebc)
    assert twin.weight is not ebc.weight and twin.fused_optimizer is not ebc.fused_optimizer
    before = twin.weight.detach().clone()
    for module in (ebc, twin):
        module(make_kjt(1)).values().sum().backward()
    assert not torch.equal(twin.weight, before)
    torch.testing.assert_close(twin.weight, ebc.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(twin.fused_optimizer.param_state["sum"],
                               ebc.fused_optimizer.param_state["sum"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_made_before_any_forward_keeps_the_optimizer_applied(how):
    """The fused optimizer is made at the first forward; a copy (or a pickle) made between
    ``apply_optimizer_in_backward`` and that forward still trains with it."""
    ebc = RobeEmbeddingBagCollection(make_tables(), ROBE)
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    if how == "deepcopy":
        twin = copy.deepcopy(ebc)
    else:
        buffer = io.BytesIO()
        torch.save(ebc, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)  # a module the test itself made
    for module in (ebc, twin):
        module(make_kjt(1)).values().sum().backward()
    assert twin.weight.grad is None
    torch.testing.assert_close(twin.weight, ebc.weight, rtol=0, atol=0)


@pytest.mark.parametrize("copied", [False, True])
def test_pytorchs_in_backward_optimizer_list_holds_the_fused_optimizer(copied):
    """``torch.distributed.optim._get_in_backward_optimizers`` (what checkpoints and
    schedulers of in-backward training read) finds the fused optimizer once the module has
    made it, as TorchRec's sharded tables put theirs there, also in a copy: a learning rate
    set through it takes effect."""
    from torch.distributed.optim import _get_in_backward_optimizers

    ebc = RobeEmbeddingBagCollection(make_tables(), ROBE)
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    ebc(make_kjt(0)).values().sum().backward()
    if copied:
        ebc = copy.deepcopy(ebc)
    (found,) = _get_in_backward_optimizers(ebc)
    assert found is ebc.fused_optimizer
    found.param_groups[0]["lr"] = 0.0
    before = ebc.weight.detach().clone()
    ebc(make_kjt(1)).values().sum().backward()
    assert torch.equal(ebc.weight, before)


def test_the_fused_optimizer_takes_over_pytorchs_rate():
    """A rate set before the first forward on the optimizer PyTorch made (a scheduler built
    on ``_get_in_backward_optimizers`` sets one) is the fused optimizer's when it is made."""
    from torch.distributed.optim import _get_in_backward_optimizers

    ebc = RobeEmbeddingBagCollection(make_tables(), ROBE)
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    (pytorchs,) = _get_in_backward_optimizers(ebc)
    pytorchs.param_groups[0]["lr"] = 0.0
    before = ebc.weight.detach().clone()
    ebc(make_kjt(1)).values().sum().backward()
    assert ebc.fused_optimizer.param_groups[0]["lr"] == 0.0
    assert torch.equal(ebc.weight, before)


def test_a_gradient_on_the_array_from_elsewhere_is_applied_too():
    """A penalty on the array itself sends it a gradient outside the fused lookup; PyTorch's
    in-backward hook then steps the fused optimizer, which applies it with the same state,
    as a stock table's in-backward optimizer applies whatever its weight accumulates. With
    SGD the two updates add up to one step on the summed gradient."""
    torch.manual_seed(0)
    ebc = RobeEmbeddingBagCollection(make_tables(), ROBE)
    torch.manual_seed(0)
    dense = RobeEmbeddingBagCollection(make_tables(), ROBE)
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.1})
    kjt = make_kjt(2)
    (ebc(kjt).values().sum() + ebc.weight.square().sum()).backward()
    (dense(kjt).values().sum() + dense.weight.square().sum()).backward()
    with torch.no_grad():
        expected = dense.weight - 0.1 * dense.weight.grad
    assert ebc.weight.grad is None
    torch.testing.assert_close(ebc.weight, expected, rtol=1e-5, atol=1e-6)


# --- input features ------------------------------------------------------------------------

def test_extra_features_are_ignored():
    module = RobeEmbeddingBagCollection(make_tables(), ROBE)
    kjt = make_kjt(keys=("user", "user_hist", "item"))
    g = torch.Generator().manual_seed(1)
    extra_lengths = torch.randint(0, 3, (BATCH,), generator=g)
    # an unknown feature first, the known ones in another order
    order = ["item", "user", "user_hist"]
    lengths = torch.cat([extra_lengths] + [kjt[k].lengths() for k in order])
    values = torch.cat([torch.randint(0, 10**6, (int(extra_lengths.sum()),), generator=g)]
                       + [kjt[k].values() for k in order])
    wider = KeyedJaggedTensor(keys=["fx"] + order, values=values, lengths=lengths)
    out = module(wider)
    assert out.keys() == ["user", "user_hist", "item"]
    assert torch.equal(out.values(), module(kjt).values())


def test_missing_features_are_named():
    module = RobeEmbeddingBagCollection(make_tables(), ROBE)
    with pytest.raises(ValueError, match=r"missing \['user_hist'\]"):
        module(make_kjt(keys=("user", "item", "fx")))


def _as_tensor_dict(kjt: KeyedJaggedTensor):
    """``kjt`` as the TensorDict of jagged (nested) tensors TorchRec's modules also take."""
    from tensordict import TensorDict

    return TensorDict(source={key: torch.nested.nested_tensor_from_jagged(
        values=jt.values(), lengths=jt.lengths()) for key, jt in kjt.to_dict().items()})


@pytest.mark.parametrize("pooled", [True, False])
def test_a_tensor_dict_input_is_taken_as_torchrec_takes_it(pooled):
    """``EmbeddingBagCollection`` and ``EmbeddingCollection`` take a TensorDict of jagged
    tensors in place of a KJT (``maybe_td_to_kjt``); ours do too, unsharded and sharded by
    DMP, with the output the KJT gives."""
    tables = make_tables()
    if pooled:
        module = RobeEmbeddingBagCollection(tables, ROBE)
    else:
        module = RobeEmbeddingCollection(
            [EmbeddingConfig(name=t.name, embedding_dim=t.embedding_dim,
                             num_embeddings=t.num_embeddings, feature_names=t.feature_names)
             for t in tables], ROBE)

    def same(a, b):
        if pooled:
            return a.keys() == b.keys() and torch.equal(a.values(), b.values())
        return a.keys() == b.keys() and all(torch.equal(a[k].values(), b[k].values())
                                            for k in a)

    want = module(make_kjt())
    assert same(module(_as_tensor_dict(make_kjt())), want)
    apply_optimizer_in_backward(torch.optim.SGD, [module.weight], {"lr": 0.1})
    with one_rank_group():
        dmp = DistributedModelParallel(torch.nn.ModuleDict({"m": module}),
                                       device=torch.device("cpu"))
        out = dmp.module["m"](_as_tensor_dict(make_kjt()))
        assert same(out.wait() if hasattr(out, "wait") else out, want)
