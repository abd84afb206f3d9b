"""FastInteractionArch against TorchRec's InteractionArch: output, gradients, model swap."""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN, InteractionArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec.interaction import FastInteractionArch, use_fast_interaction


def _inputs(batch, features, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, dim, generator=g, dtype=dtype, requires_grad=True)
    sparse = torch.randn(batch, features, dim, generator=g, dtype=dtype, requires_grad=True)
    return dense, sparse


@pytest.mark.parametrize("features,dim", [(0, 4), (1, 3), (5, 8), (26, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_output_and_gradients_match_torchrec(features, dim, dtype):
    ref, fast = InteractionArch(features), FastInteractionArch(features)
    dense, sparse = _inputs(7, features, dim, dtype, seed=features * 31 + dim)
    out_ref, out_fast = ref(dense, sparse), fast(dense, sparse)
    assert torch.equal(out_fast, out_ref)  # the same products, gathered the same way
    # a random upstream gradient, so that every output column carries its own weight
    upstream = torch.randn_like(out_ref)
    if not out_ref.requires_grad:
        return
    grads_ref = torch.autograd.grad(out_ref, (dense, sparse), upstream, allow_unused=True)
    grads_fast = torch.autograd.grad(out_fast, (dense, sparse), upstream, allow_unused=True)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for got, want in zip(grads_fast, grads_ref):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, **tol)


def test_gradcheck():
    fast = FastInteractionArch(4)
    dense, sparse = _inputs(3, 4, 5, torch.float64, seed=1)
    assert torch.autograd.gradcheck(fast, (dense, sparse))
    assert torch.autograd.gradgradcheck(fast, (dense, sparse))


def _dlrm(dim=8, seed=0):
    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=50,
                                 feature_names=[f"f{i}"]) for i in range(3)]
    return DLRM(embedding_bag_collection=EmbeddingBagCollection(tables), dense_in_features=4,
                dense_arch_layer_sizes=[8, dim], over_arch_layer_sizes=[8, 1])


def test_use_fast_interaction_keeps_model_and_state_dict():
    model = _dlrm()
    keys = list(model.state_dict())
    dense = torch.randn(5, 4)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=torch.randint(0, 50, (20,)),
        lengths=torch.tensor([1, 2, 0, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 3, 2]))
    before = model(dense, kjt)
    assert use_fast_interaction(model) is model
    assert isinstance(model.inter_arch, FastInteractionArch)
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(dense, kjt), before, rtol=0, atol=0)


def test_refuses_other_interactions():
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10,
                                 feature_names=["f0"])]
    dcn = DLRM_DCN(embedding_bag_collection=EmbeddingBagCollection(tables), dense_in_features=4,
                   dense_arch_layer_sizes=[8, 8], over_arch_layer_sizes=[8, 1],
                   dcn_num_layers=1, dcn_low_rank_dim=4)
    with pytest.raises(TypeError, match="InteractionDCNArch"):
        use_fast_interaction(dcn)
    model = _dlrm()
    use_fast_interaction(model)
    with pytest.raises(TypeError, match="FastInteractionArch"):
        use_fast_interaction(model)  # already swapped: a second call is a caller's mistake
