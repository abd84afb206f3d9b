"""Bad input to RobeEmbeddingBagCollection: a clear error naming the problem, for every
CPU backend; never a crash, never silent garbage."""

import math

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.ops import cpu_backend

#: "triton" (Triton's interpreter on CPU tensors) runs the checks a GPU runs: the data
#: summarised by one kernel, then checked one by one only when that finds a problem
BACKENDS = ["cpp", "reference", "triton"]


def tables():
    return [EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=100, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=50, feature_names=["item"])]


def module(**robe):
    robe.setdefault("memory_size", 200)
    robe.setdefault("block_size", 4)
    return RobeEmbeddingBagCollection(tables(), RobeConfig(**robe))


def kjt(values, lengths=(1, 1, 1, 1), keys=("user", "item"), weights=None, offsets=None):
    if offsets is not None:
        return KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values), offsets=torch.tensor(offsets),
                                 weights=weights)
    return KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values),
                             lengths=torch.tensor(lengths, dtype=torch.int32), weights=weights)


@pytest.fixture(params=BACKENDS)
def backend(request):
    with cpu_backend(request.param):
        yield request.param


@pytest.mark.parametrize("values,match", [
    ([1, 2, 3, 50], r"id 50 at position 3 of feature 1 \('item'\) is out of range \[0, 50\)"),
    ([1, 100, 3, 4], r"id 100 at position 1 of feature 0 \('user'\) is out of range \[0, 100\)"),
    ([1, -1, 3, 4], r"id -1 .* feature 0 \('user'\) is out of range"),
])
def test_out_of_range_ids(backend, values, match):
    with pytest.raises(ValueError, match=match):
        module()(kjt(values))


@pytest.mark.parametrize("deferred", [False, True])
def test_a_compiled_module_names_the_feature_too(deferred):
    """Inside a graph ``torch.compile`` made, the module's own ``try`` around the op is gone:
    the op names the feature, at the call or in the deferred check's message."""
    from robe_torchrec.ops import DeferredCheckError, defer_checks, raise_pending_checks

    compiled = torch.compile(module(), fullgraph=True, backend="aot_eager")
    match = r"id 50 at position 3 of feature 1 \('item'\) is out of range \[0, 50\)"
    with cpu_backend("triton" if deferred else "cpp"), defer_checks(deferred):
        compiled(kjt([1, 2, 3, 4]))
        with pytest.raises(DeferredCheckError if deferred else ValueError, match=match):
            compiled(kjt([1, 2, 3, 50]))
            raise_pending_checks()


def test_a_module_moved_off_the_meta_device_names_the_feature_when_compiled():
    """``to_empty`` gives the module a new ``table_meta``; the op names its features too."""
    moved = RobeEmbeddingBagCollection(tables(), RobeConfig(memory_size=200, block_size=4),
                                       device=torch.device("meta")).to_empty(device="cpu")
    moved.reset_parameters()
    compiled = torch.compile(moved, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=r"of feature 1 \('item'\) is out of range"):
        compiled(kjt([1, 2, 3, 50]))


def test_a_deferred_error_names_the_feature_of_the_module_that_took_it():
    """Checks deferred, another module's call may raise the problem: it names the feature
    of the module whose input was bad."""
    from robe_torchrec.ops import DeferredCheckError, defer_checks
    from robe_torchrec.ops.tuning import tuned

    bad, other = module(), RobeEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t_q", embedding_dim=4, num_embeddings=100,
                            feature_names=["query", "ad"])], RobeConfig(memory_size=200))
    # each answer copied on its own: the next call reads it
    with cpu_backend("triton"), defer_checks(True), tuned(answers_per_copy=1):
        bad(kjt([1, 2, 3, 50]))
        with pytest.raises(DeferredCheckError, match=r"of feature 1 \('item'\) is out"):
            other(kjt([1, 2, 3, 4], keys=("query", "ad")))


def test_unbounded_reference_hash_rejects_keys_it_cannot_hash(backend):
    m = module(bounds_check="unbounded")
    m(kjt([1, 10**6, 3, 4]))  # beyond num_embeddings, but hashable: accepted
    with pytest.raises(ValueError, match="cannot be hashed by the reference hash.*mix"):
        m(kjt([1, 2**40, 3, 4]))


def test_unbounded_mix_hash_takes_any_int64(backend):
    m = module(bounds_check="unbounded", hash="mix")
    out = m(kjt([-(2**63), 2**63 - 1, -5, 2**40]))
    assert torch.isfinite(out.values()).all()


def test_non_monotonic_offsets(backend):
    with pytest.raises(ValueError, match="offsets decrease at bag 1"):
        module()(kjt([1, 2, 3, 4], offsets=[0, 2, 1, 3, 4]))


def test_offsets_not_ending_at_values(backend):
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 3 but values has 4"):
        module()(kjt([1, 2, 3, 4], offsets=[0, 1, 2, 3, 3]))


def test_lengths_do_not_match_values(backend):
    with pytest.raises(ValueError, match="lengths sum to 5 but values has 4"):
        module()(kjt([1, 2, 3, 4], lengths=(2, 1, 1, 1)))


def test_float_ids(backend):
    with pytest.raises(ValueError, match="values \\(ids\\) must be int32 or int64, got torch.float32"):
        module()(KeyedJaggedTensor(keys=["user", "item"], values=torch.tensor([1.0, 2.0]),
                                   lengths=torch.tensor([1, 0, 1, 0], dtype=torch.int32)))


def test_missing_and_unknown_features(backend):
    with pytest.raises(ValueError, match=r"missing \['item'\], unknown \['itme'\]"):
        module()(kjt([1, 2, 3, 4], keys=("user", "itme")))
    with pytest.raises(ValueError, match=r"missing \['item'\]"):
        module()(kjt([1, 2], lengths=(1, 1), keys=("user",)))


def test_a_feature_given_twice(backend):
    with pytest.raises(ValueError, match=r"features \['user'\] more than once"):
        module()(kjt([1, 2, 3, 4, 5, 6], lengths=(1, 1, 1, 1, 1, 1),
                     keys=("user", "item", "user")))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_per_sample_weights(backend, bad):
    m = RobeEmbeddingBagCollection(tables(), RobeConfig(memory_size=200, block_size=4), is_weighted=True)
    weights = torch.tensor([1.0, 0.5, bad, 1.0])
    with pytest.raises(ValueError, match=r"per_sample_weights\[2\] is (nan|inf)"):
        m(kjt([1, 2, 3, 4], weights=weights))


def test_weighted_module_without_weights(backend):
    m = RobeEmbeddingBagCollection(tables(), RobeConfig(memory_size=200), is_weighted=True)
    with pytest.raises(ValueError, match="without weights"):
        m(kjt([1, 2, 3, 4]))


def test_bad_configs():
    with pytest.raises(ValueError, match="exactly one of memory_size or compression"):
        RobeConfig()
    with pytest.raises(ValueError, match="unknown ROBE hash"):
        RobeConfig(memory_size=10, hash="crc")
    with pytest.raises(ValueError, match="bounds_check"):
        RobeConfig(memory_size=10, bounds_check="warn")
    with pytest.raises(ValueError, match="duplicate table name"):
        RobeEmbeddingBagCollection(tables() + tables()[:1], RobeConfig(memory_size=200))


def test_tables_too_large_for_the_reference_hash():
    huge = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=2 * 10**10, feature_names=["f"])]
    with pytest.raises(ValueError, match=r"reference hash computes keys below .*hash='mix'"):
        RobeEmbeddingBagCollection(huge, RobeConfig(memory_size=1000), device="meta")
    RobeEmbeddingBagCollection(huge, RobeConfig(memory_size=1000, hash="mix"), device="meta")


@pytest.mark.parametrize("robe,error,match", [
    (dict(memory_size=16, block_size=64), ValueError, "memory_size=16 holds less than one block"),
    (dict(memory_size=10), ValueError, "block_size=32"),  # the default block size
    (dict(memory_size=200, block_size=2.5), TypeError, "block_size must be an integer, got 2.5"),
    (dict(memory_size=200.0), TypeError, "memory_size must be an integer"),
    (dict(memory_size=200, seed=1.5), TypeError, "seed must be an integer"),
    (dict(memory_size=200, block_size=True), TypeError, "block_size must be an integer"),
    (dict(memory_size=200, init_scale=-1), ValueError, "init_scale must be a finite number >= 0"),
    (dict(memory_size=200, init_scale=math.nan), ValueError, "init_scale must be a finite"),
    (dict(memory_size=200, init_scale=math.inf), ValueError, "init_scale must be a finite"),
])
def test_config_refused_at_construction(robe, error, match):
    with pytest.raises(error, match=match):
        RobeConfig(**robe)


def test_memory_size_is_never_exceeded():
    # one array per table: the largest table gives up floats so that each gets a block, but
    # 24 floats cannot hold two blocks of 16
    with pytest.raises(ValueError, match=r"memory_size=24 cannot give each of the 2 tables "
                                         r"\(shared=False\) an array of at least block_size=16"):
        module(memory_size=24, block_size=16, shared=False)
    assert module(memory_size=200, shared=False).weight.numel() == 200
    # compression asks for a ratio, not a size: an array is rounded up to one block
    tiny = RobeConfig(compression=10**6, block_size=4)
    assert RobeEmbeddingBagCollection(tables(), tiny).weight.numel() == 4


def test_num_embeddings_zero_refused_with_the_table_name():
    # TorchRec's own EmbeddingBagConfig divides by num_embeddings unless the init range is given
    empty = EmbeddingBagConfig(name="t_empty", embedding_dim=8, num_embeddings=0,
                               feature_names=["e"], weight_init_min=-0.1, weight_init_max=0.1)
    with pytest.raises(ValueError, match="table 't_empty': .* got num_embeddings=0"):
        RobeEmbeddingBagCollection([empty], RobeConfig(memory_size=200))


@pytest.mark.parametrize("strict", [True, False])
def test_state_dict_without_layout_is_refused_before_any_copy(strict):
    source, target = module(), module()
    before = target.weight.detach().clone()
    only_weight = {"weight": source.weight.detach().clone()}
    with pytest.raises(ValueError, match=r"has weight but no robe_layout.*robe_layout'\] = "):
        target.load_state_dict(only_weight, strict=strict)
    assert torch.equal(target.weight.detach(), before)  # untouched
    # nested in a parent module: the same, with the key's prefix
    parent = torch.nn.ModuleDict({"ebc": target})
    with pytest.raises(ValueError, match="has ebc.weight but no ebc.robe_layout"):
        parent.load_state_dict({"ebc.weight": only_weight["weight"]}, strict=strict)
    assert torch.equal(target.weight.detach(), before)
    # the explicit opt-out: vouch for the layout by handing the module's own
    target.load_state_dict({**only_weight, "robe_layout": target.robe_layout}, strict=strict)
    assert torch.equal(target.weight.detach(), source.weight.detach())


def test_meta_input_to_a_real_module_is_refused(backend):
    meta_kjt = kjt([1, 2, 3, 4]).to(torch.device("meta"))
    with pytest.raises(ValueError, match="values is on meta but weights are on cpu"):
        module()(meta_kjt)


def test_meta_input_to_a_meta_module_gives_meta_output():
    m = RobeEmbeddingBagCollection(tables(), RobeConfig(memory_size=200, block_size=4),
                                   device="meta")
    out = m(kjt([1, 2, 3, 4]).to(torch.device("meta")))
    assert out.values().device.type == "meta" and out.values().shape == (2, 12)
