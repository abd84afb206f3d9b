"""The unpooled lookup's two layouts (robe_torchrec/ops/unpooled.py): features sharing one
array looked up as one feature of keys, without padding, against a lookup of each feature on
its own; the ids checked in their own feature before they become keys, with the op's
messages; and the layouts the keys cannot serve, which stay padded."""

from __future__ import annotations

import copy
from typing import List

import pytest
import torch
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig, RobeEmbeddingCollection
from robe_torchrec.hashing import HashMode, reference_key_limit
from robe_torchrec.ops import (DeferredCheckError, checks_deferred, cpu_backend, defer_checks,
                               raise_pending_checks, robe_unpooled_lookup)
from robe_torchrec.ops import meta as m
from robe_torchrec.ops.args import LayoutArgs, LookupArgs
from robe_torchrec.ops import unpooled
from robe_torchrec.ops.unpooled import unpooled_args
from tests.test_embedding_collection import ec_tables, random_kjt

DIM, Z, ARRAY = 7, 4, 301
HASH_PARAMS = [1_000_003, 37, 11]


def shared_layout(num_rows: List[int], hash_mode: int, bounds_check: int,
                  row_offsets: List[int] = None) -> LayoutArgs:
    """Features of one dim on one array, each table's keys after the tables before it."""
    if row_offsets is None:
        row_offsets = [sum(num_rows[:t]) for t in range(len(num_rows))]
    meta = m.build_table_meta(dims=[DIM] * len(num_rows), weight_offsets=[0] * len(num_rows),
                              weight_sizes=[ARRAY] * len(num_rows), row_offsets=row_offsets,
                              num_rows=num_rows, poolings=[0] * len(num_rows))
    return LayoutArgs(meta, DIM * len(num_rows), Z, hash_mode, HASH_PARAMS, bounds_check)


def lookup_each_feature(weights, values, counts, layout: LayoutArgs) -> torch.Tensor:
    """The reference: feature ``t``'s ids looked up by the op with its own column of
    table_meta, one id a bag, concatenated."""
    rows = []
    for t, ids in enumerate(values.split(counts)):
        meta = layout.table_meta[:, t:t + 1].clone()
        meta[m.OUT_OFFSET] = 0
        one = layout._replace(table_meta=meta, output_dim=DIM)
        offsets = torch.arange(ids.numel() + 1, dtype=ids.dtype)
        rows.append(LookupArgs(ids, offsets, None, one).forward(weights))
    return torch.cat(rows)


def random_case(g: torch.Generator, dtype: torch.dtype):
    num_features = int(torch.randint(1, 6, (), generator=g))
    num_rows = torch.randint(1, 60, (num_features,), generator=g).tolist()
    # skewed: some features without ids, one with many
    counts = [int(torch.randint(0, 4, (), generator=g)) ** 3 for _ in num_rows]
    values = torch.cat([torch.randint(0, n, (c,), generator=g)
                        for n, c in zip(num_rows, counts)]).to(dtype)
    return num_rows, counts, values


@pytest.mark.parametrize("backend", ["cpp", "reference", "triton"])
def test_keys_layout_equals_a_lookup_of_each_feature(backend):
    """Fresh random cases (skewed counts, features without ids, int32 and int64 ids, both
    hashes, both bound checks): rows and the weights' gradient equal those of a lookup of
    each feature on its own, and the keys layout is the one taken (no gather)."""
    g = torch.Generator().manual_seed(11)
    with cpu_backend(backend):
        for case in range(12):
            dtype = (torch.int64, torch.int32)[case % 2]
            hash_mode = (HashMode.REFERENCE, HashMode.MIX)[case // 2 % 2]
            bounds = (m.BoundsCheck.ERROR, m.BoundsCheck.UNBOUNDED)[case // 4 % 2]
            num_rows, counts, values = random_case(g, dtype)
            layout = shared_layout(num_rows, int(hash_mode), int(bounds))
            args, index = unpooled_args(values, counts, layout)
            assert index is None and args.layout.table_meta.shape[1] == 1, counts
            weights = torch.randn(ARRAY, dtype=torch.float64, generator=g, requires_grad=True)
            rows = robe_unpooled_lookup(weights, values, counts, layout)
            want = lookup_each_feature(weights, values, counts, layout)
            assert rows.shape == (sum(counts), DIM)
            torch.testing.assert_close(rows, want, rtol=0, atol=1e-12)
            grad_rows = torch.randn(rows.shape, dtype=torch.float64, generator=g)
            got, = torch.autograd.grad(rows, weights, grad_rows)
            expected, = torch.autograd.grad(want, weights, grad_rows)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_module_lookups_take_the_keys_layout_and_match_the_padded_one():
    """``RobeEmbeddingCollection`` (two features on one table, so equal row offsets) gives
    what the padded layout gives: the same module on a separate array per table is padded,
    and with the arrays copied into one shared layout's places the rows agree."""
    shared = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4))
    kjt = random_kjt(seed=3)
    layout = shared.layout.op_args(shared.table_meta)
    args, index = unpooled_args(kjt.values(), kjt.length_per_key(), layout)
    assert index is None
    out = shared(kjt)
    rows = torch.cat([out[k].values() for k in kjt.keys()])
    # the padded layout of the same lookup: one array per feature, each a copy of the shared
    # one, so that every feature hashes into the same floats
    meta = shared.table_meta.clone()
    num_features = meta.shape[1]
    meta[m.W_OFFSET] = torch.arange(num_features) * shared.weight.numel()
    padded_layout = layout._replace(table_meta=meta)
    args, index = unpooled_args(kjt.values(), kjt.length_per_key(), padded_layout)
    assert index is not None, "features on arrays of their own cannot be one feature of keys"
    padded = robe_unpooled_lookup(shared.weight.detach().repeat(num_features), kjt.values(),
                                  kjt.length_per_key(), padded_layout)
    torch.testing.assert_close(rows, padded, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("min_max_from", [0, 10**9])
def test_an_id_outside_its_feature_is_refused_with_the_ops_message(backend, min_max_from,
                                                                   monkeypatch):
    """An id past its own feature's rows is a valid key of a later table: it must still be
    refused, at its position, in its feature, as the op refuses it (ranges checked by each
    feature's smallest and largest id, and id by id)."""
    monkeypatch.setattr(unpooled, "MIN_MAX_FROM_IDS_A_FEATURE", min_max_from)
    num_rows = [10, 20, 30]
    layout = shared_layout(num_rows, int(HashMode.REFERENCE), int(m.BoundsCheck.ERROR))
    weights = torch.randn(ARRAY, dtype=torch.float64)
    values = torch.tensor([1, 2, 5, 19, 20, 3, 29])  # id 20 of feature 1 (20 rows)
    with cpu_backend(backend):
        with pytest.raises(ValueError) as err:
            robe_unpooled_lookup(weights, values, [2, 3, 2], layout)
    assert str(err.value).startswith(
        "robe: id 20 at position 4 of feature 1 is out of range [0, 20); ids must lie in")
    # the reference hash with unbounded ids: a negative id whose key is not negative
    unbounded = shared_layout(num_rows, int(HashMode.REFERENCE), int(m.BoundsCheck.UNBOUNDED))
    with pytest.raises(ValueError, match=r"^robe: id -3 at position 5 of feature 2 cannot be "
                                         r"hashed by the reference hash"):
        robe_unpooled_lookup(weights, torch.tensor([1, 2, 5, 19, 20, -3, 29]), [2, 3, 2],
                             unbounded)
    # ... and an id below the key limit whose key (id + its table's row offset, 30) is not
    limit = reference_key_limit(-(-DIM // Z), HASH_PARAMS)
    fine = torch.tensor([1, 2, 5, 19, 20, 3, limit - 31])
    robe_unpooled_lookup(weights, fine, [2, 3, 2], unbounded)
    with pytest.raises(ValueError, match=rf"^robe: id {limit - 30} at position 6 of feature 2 "
                                         r"cannot be hashed by the reference hash"):
        robe_unpooled_lookup(weights, fine + torch.tensor([0] * 6 + [1]), [2, 3, 2], unbounded)


def test_the_module_names_the_feature_of_a_refused_id():
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4))
    kjt = random_kjt(seed=6)
    counts = kjt.length_per_key()
    values = kjt.values().clone()
    values[counts[0] + counts[1]] = 40  # f1's first id: t1 has 300 rows, t0 (f0's) 40
    values[0] = 40                      # f0's first id: one past t0's rows
    bad = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    with pytest.raises(ValueError, match=r"^robe: id 40 at position 0 of feature 0 \('f0'\) "
                                         r"is out of range \[0, 40\)"):
        ec(bad)


def test_layouts_the_keys_cannot_serve_stay_padded():
    num_rows = [10, 20]
    values, counts = torch.tensor([1, 2, 3]), [1, 2]
    layout = shared_layout(num_rows, int(HashMode.MIX), int(m.BoundsCheck.ERROR))
    assert unpooled_args(values, counts, layout)[1] is None
    for field, value in ((m.W_SIZE, ARRAY - 1), (m.W_OFFSET, 1), (m.DIM, DIM - 1),
                         (m.POOLING, int(m.Pooling.MEAN))):
        meta = layout.table_meta.clone()
        meta[field, 1] = value
        assert unpooled_args(values, counts, layout._replace(table_meta=meta))[1] is not None
    # a negative row offset (a key below 0 would fail the op's check of the keys)
    negative = shared_layout(num_rows, int(HashMode.MIX), int(m.BoundsCheck.ERROR), [0, -5])
    assert unpooled_args(values, counts, negative)[1] is not None
    # changed in place: derived again
    meta = layout.table_meta
    meta[m.W_OFFSET, 1] = 1
    assert unpooled_args(values, counts, layout)[1] is not None
    meta[m.W_OFFSET, 1] = 0
    assert unpooled_args(values, counts, layout)[1] is None


def test_which_ops_defer_their_checks():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert checks_deferred(cuda) and not checks_deferred(cpu)
    with defer_checks(False):
        assert not checks_deferred(cuda)
    with defer_checks(True):
        assert not checks_deferred(cpu)  # the C++ kernel reads its checks at the call
        with cpu_backend("triton"):
            assert checks_deferred(cpu)


def test_deferred_checks_turn_an_id_outside_its_feature_into_a_refused_key():
    """Where the op defers its checks (a GPU's default; here Triton on CPU tensors with
    checks deferred), nothing is read at the call: an id outside its feature becomes the key
    -1, the op's own check refuses it, and the problem is named from the ids: the message
    the op gives at the call, with the deferred note. Good ids still give the rows of a
    lookup of each feature on its own."""
    num_rows = [10, 20, 30]
    g = torch.Generator().manual_seed(2)
    weights = torch.randn(ARRAY, dtype=torch.float64, generator=g, requires_grad=True)
    good = torch.tensor([1, 2, 5, 19, 0, 3, 29])
    bad = torch.tensor([1, 2, 5, 19, 20, 3, 29])  # id 20 of feature 1 (20 rows)
    negative = torch.tensor([1, 2, 5, 19, 20, -3, 29])
    with cpu_backend("triton"), defer_checks(True):
        for hash_mode, bounds in ((HashMode.REFERENCE, m.BoundsCheck.ERROR),
                                  (HashMode.MIX, m.BoundsCheck.ERROR),
                                  (HashMode.REFERENCE, m.BoundsCheck.UNBOUNDED)):
            layout = shared_layout(num_rows, int(hash_mode), int(bounds))
            rows = robe_unpooled_lookup(weights, good, [2, 3, 2], layout)
            torch.testing.assert_close(
                rows, lookup_each_feature(weights, good, [2, 3, 2], layout), rtol=0, atol=1e-12)
            args, _ = unpooled_args(bad, [2, 3, 2], layout)
            refused = -1 if bounds == m.BoundsCheck.ERROR else 20 + 10  # unbounded: a key
            assert args.values.tolist() == [1, 2, 15, 29, refused, 33, 59]
            args, _ = unpooled_args(negative, [2, 3, 2], layout)
            assert args.values.tolist() == [1, 2, 15, 29, refused, -1, 59]
            raise_pending_checks()
        layout = shared_layout(num_rows, int(HashMode.REFERENCE), int(m.BoundsCheck.ERROR))
        robe_unpooled_lookup(weights, bad, [2, 3, 2], layout)   # returns
        with pytest.raises(DeferredCheckError) as err:
            raise_pending_checks()
        assert str(err.value).startswith(
            "robe: id 20 at position 4 of feature 1 is out of range [0, 20); ids must lie in")
        assert "deferred input check" in str(err.value)
        # the ids changed before the answer was read: told by the counts, not misnamed
        changed = bad.clone()
        robe_unpooled_lookup(weights, changed, [2, 3, 2], layout)
        changed[4] = 21  # still bad, but not what the op was given
        with pytest.raises(DeferredCheckError, match="had 1 ids that fail their check; it "
                                                     "changed before the problem could be named"):
            raise_pending_checks()


def test_a_refused_key_changes_no_weight():
    """A fused step on a batch with an id outside its feature, checks deferred: the
    backward writes nothing and the error names the id."""
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4))
    apply_optimizer_in_backward(torch.optim.SGD, [ec.weight], {"lr": 0.5})
    kjt = random_kjt(seed=6)
    values = kjt.values().clone()
    values[0] = 40  # f0's first id: one past t0's rows, a key of t1's
    bad = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    before = ec.weight.detach().clone()
    with cpu_backend("triton"), defer_checks(True):
        with pytest.raises(DeferredCheckError,
                           match=r"id 40 at position 0 of feature 0 \('f0'\) "):
            out = ec(bad)
            sum(jt.values().sum() for jt in out.values()).backward()
            raise_pending_checks()
    assert torch.equal(ec.weight.detach(), before)


@pytest.mark.parametrize("shared", [True, False])
def test_compiled_module_equals_eager(shared):
    """``torch.compile(fullgraph=True)`` of a TorchRec user's sequence lookup, as
    ``EmbeddingCollection`` compiles: traced whole, its loss and gradient equal eager's on
    batches of new lengths and on a variable batch per feature."""
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4,
                                                         shared=shared))

    def loss(kjt):
        return sum((jt.values() ** 2).sum() for jt in ec(kjt).values())

    compiled = torch.compile(loss, fullgraph=True)
    for seed, strides in [(0, None), (1, None), (2, [5, 3, 5, 2])]:
        kjt = random_kjt(seed=seed, strides=strides)
        want = loss(kjt)
        want_grad, = torch.autograd.grad(want, ec.weight)
        got = compiled(kjt)
        got_grad, = torch.autograd.grad(got, ec.weight)
        torch.testing.assert_close(got, want)
        assert torch.equal(got_grad, want_grad)


def _ops_traced(ec, kjt):
    """The ops a ``fullgraph=True`` trace of ``ec(kjt)`` calls."""
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes
                    if node.op in ("call_function", "call_method"))
        return gm.forward

    torch.compile(ec, fullgraph=True, backend=backend)(kjt)
    return seen


@pytest.mark.parametrize("shared", [True, False])
def test_a_compiled_graph_takes_the_keys_when_they_serve(shared):
    """Traced, features on one array are keys too (the module hands the trace its
    table_meta's rows): no padding, and no gather; features on arrays of their own stay
    padded."""
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4,
                                                         shared=shared))
    ops = _ops_traced(ec, random_kjt(seed=1))
    assert any("unpooled_keys" in op for op in ops) == shared, ops
    assert any("index_select" in op for op in ops) == (not shared), ops


def test_a_compiled_lookup_checks_its_layout_once(monkeypatch):
    """The traced keys layout's table_meta is the module's buffer, the same tensor every
    call, so the Triton ops (a GPU's) check and plan it once, as in eager: a new tensor a
    call would cost a read of it on the host every step (a wait for the GPU, refused inside
    a CUDA graph capture)."""
    from robe_torchrec.ops import validation

    reads = []
    check = validation.check_table_meta
    monkeypatch.setattr(validation, "check_table_meta",
                        lambda *args: reads.append(args[0].shape) or check(*args))
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4))
    apply_optimizer_in_backward(torch.optim.SGD, [ec.weight], {"lr": 0.1})
    compiled = torch.compile(ec, fullgraph=True, backend="aot_eager")
    with cpu_backend("triton"), defer_checks(True):
        for seed in range(4):
            if seed == 2:
                first_calls = len(reads)
            sum(jt.values().sum() for jt in compiled(random_kjt(seed=seed)).values()).backward()
        raise_pending_checks()
    assert first_calls > 0 and len(reads) == first_calls, reads


def test_unpooled_keys_op_passes_opcheck_and_refuses_rows_of_another_layout():
    """``robe::unpooled_keys`` (the ids made keys for a traced graph): schema, fake kernel
    and no aliasing by ``torch.library.opcheck``; the keys are the ids shifted by their
    features' row offsets; a table_meta whose features are no keys is refused."""
    layout = shared_layout([10, 20, 30], int(HashMode.REFERENCE), int(m.BoundsCheck.ERROR))
    values = torch.tensor([1, 2, 5, 19, 3, 29])
    torch.library.opcheck(torch.ops.robe.unpooled_keys, (values, [2, 2, 2], *layout))
    keys = torch.ops.robe.unpooled_keys(values, [2, 2, 2], *layout)
    assert keys.tolist() == [1, 2, 15, 29, 33, 59]
    # it copies the counts to the device each call: Inductor must not capture it
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda v: torch.ops.robe.unpooled_keys(v, [2, 2, 2], *layout))(values)
    unsafe = torch._inductor.utils.get_first_incompatible_cudagraph_node(graph)
    assert unsafe is not None and "unpooled_keys" in str(unsafe.target)
    per_feature = layout._replace(table_meta=layout.table_meta.clone())
    per_feature.table_meta[m.W_OFFSET, 1] = 7  # feature 1 on an array of its own
    with pytest.raises(ValueError, match="not one feature of keys"):
        torch.ops.robe.unpooled_keys(values, [2, 2, 2], *per_feature)


def test_compiled_fused_training_equals_eager():
    """Adagrad fused into backward, compiled with ``fullgraph=True``: the array after four
    steps is eager's, bit for bit."""
    eager = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4))
    compiled_ec = copy.deepcopy(eager)
    for ec in (eager, compiled_ec):
        apply_optimizer_in_backward(torch.optim.Adagrad, [ec.weight], {"lr": 0.1})

    def loss_of(ec):
        return lambda kjt: sum((jt.values() ** 2).sum() for jt in ec(kjt).values())

    compiled = torch.compile(loss_of(compiled_ec), fullgraph=True, backend="aot_eager")
    for seed in range(4):
        kjt = random_kjt(seed=10 + seed)
        loss_of(eager)(kjt).backward()
        compiled(kjt).backward()
    assert not torch.equal(eager.weight, RobeEmbeddingCollection(
        ec_tables(), RobeConfig(memory_size=400, block_size=4)).weight)  # it trained
    assert torch.equal(compiled_ec.weight, eager.weight)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("deferred", [False, True])
def test_compiled_lookup_names_a_bad_id_in_its_feature(shared, deferred):
    """The compiled lookup checks each id in its own feature, as eager does, at the call or
    deferred: an id one past its table's rows (a key of the next table's, were it made a key
    unchecked) is refused with its feature's index and name and its position."""
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=400, block_size=4,
                                                         shared=shared))
    compiled = torch.compile(ec, fullgraph=True, backend="aot_eager")
    kjt = random_kjt(seed=6)
    values = kjt.values().clone()
    values[0] = 40  # f0's first id: one past t0's rows
    bad = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    message = r"id 40 at position 0 of feature 0 \('f0'\) .*\[0, 40\)"
    with cpu_backend("triton" if deferred else "cpp"), defer_checks(deferred):
        compiled(kjt)
        if deferred:
            compiled(bad)
            with pytest.raises(DeferredCheckError, match=message):
                raise_pending_checks()
        else:
            with pytest.raises(ValueError, match=message):
                compiled(bad)


def test_deferred_problems_of_inference_tensors_are_named_from_the_ids():
    """Serving under ``torch.inference_mode()``: the ids carry no version, and a deferred
    problem is still named from them, not from the key -1."""
    layout = shared_layout([10, 20, 30], int(HashMode.REFERENCE), int(m.BoundsCheck.ERROR))
    weights = torch.randn(ARRAY, dtype=torch.float64)
    with cpu_backend("triton"), defer_checks(True), torch.inference_mode():
        robe_unpooled_lookup(weights, torch.tensor([1, 2, 5, 19, 20, 3, 29]), [2, 3, 2],
                             layout)
        with pytest.raises(DeferredCheckError, match=r"^robe: id 20 at position 4 of feature 1 "):
            raise_pending_checks()


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_an_evaluation_under_inference_mode_leaves_training_working(backend):
    """The keys layout is derived once and kept: first derived inside
    ``torch.inference_mode()`` (an evaluation), it must still hold normal tensors for the
    training steps after it, which save its table_meta for backward."""
    ec = RobeEmbeddingCollection(ec_tables(), RobeConfig(memory_size=ARRAY, block_size=Z))
    with cpu_backend(backend), defer_checks(backend == "triton"):
        with torch.inference_mode():
            evaluated = ec(random_kjt(seed=3))
        trained = ec(random_kjt(seed=3))
        sum(jt.values().sum() for jt in trained.values()).backward()
        raise_pending_checks()
    assert ec.weight.grad is not None and ec.weight.grad.abs().sum() > 0
    for name, jt in trained.items():
        torch.testing.assert_close(jt.values().detach(), evaluated[name].values())
