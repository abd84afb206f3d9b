"""Bad input to RobeEmbeddingBagCollection: a clear error naming the problem, for every
CPU backend; never a crash, never silent garbage."""

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.ops import cpu_backend

BACKENDS = ["cpp", "reference"]


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
        RobeEmbeddingBagCollection(tables() + tables()[:1], RobeConfig(memory_size=10))


def test_tables_too_large_for_the_reference_hash():
    huge = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=2 * 10**10, feature_names=["f"])]
    with pytest.raises(ValueError, match=r"reference hash computes keys below .*hash='mix'"):
        RobeEmbeddingBagCollection(huge, RobeConfig(memory_size=1000), device="meta")
    RobeEmbeddingBagCollection(huge, RobeConfig(memory_size=1000, hash="mix"), device="meta")
