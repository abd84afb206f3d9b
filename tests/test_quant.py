"""QuantRobeEmbeddingBagCollection: error and memory against the float module, inference-only
behaviour, state dict, and TorchRec's quantize_inference_model swapping it in."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.inference.modules import quantize_inference_model as torchrec_quantize
from torchrec.models.dlrm import DLRM

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec import quant
from robe_torchrec.quant import QuantRobeEmbeddingBagCollection

KEYS = ["f0", "f1", "f2"]
ROWS = 5000
B = 64


def tables(dim: int = 16):
    return [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=ROWS,
                               feature_names=[k]) for k in KEYS]


def trained_ebc(seed: int = 0, **robe) -> RobeEmbeddingBagCollection:
    """A ROBE module whose array looks trained: wider than at init, a few large values."""
    torch.manual_seed(seed)
    ebc = RobeEmbeddingBagCollection(tables(), RobeConfig(compression=10, block_size=8, **robe))
    with torch.no_grad():
        ebc.weight.normal_(0, 0.05)
        ebc.weight[::997] *= 8
    return ebc


def batch(seed: int = 1, keys=KEYS) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (len(keys) * B,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error over the output scale (max abs output)."""
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("dtype, scale_dtype, bound, ratio", [
    (torch.int8, torch.float32, 1e-2, 0.29),     # measured: 2.5e-3, 0.281
    (torch.int8, torch.float16, 1e-2, 0.27),     # 2.7e-3, 0.266
    (torch.float16, torch.float32, 1e-3, 0.5),   # 1.8e-4, 0.5
], ids=["int8-fp32-scale", "int8-fp16-scale", "fp16"])
def test_error_and_memory_against_float(dtype, scale_dtype, bound, ratio):
    ebc = trained_ebc()
    kjt = batch()
    q = QuantRobeEmbeddingBagCollection.from_float(ebc, dtype=dtype, scale_dtype=scale_dtype)
    with torch.no_grad():
        ref, out = ebc(kjt), q(kjt)
    assert out.keys() == ref.keys() and out.length_per_key() == ref.length_per_key()
    err = relative_error(out.values(), ref.values())
    float_bytes = ebc.memory_size * 4
    print(f"{dtype} scale {scale_dtype}: max abs error / output scale {err:.2e}, "
          f"{q.memory_bytes:,} bytes vs float {float_bytes:,} ({q.memory_bytes / float_bytes:.3f})")
    assert 0 < err < bound
    assert q.memory_bytes <= ratio * float_bytes
    # the per-element error of the array itself is at most half a quantization step
    if dtype == torch.int8:
        step = (ebc.weight.detach().view(-1)[: 64].aminmax())
        assert (q.dequantize()[:64] - ebc.weight.detach()[:64]).abs().max() \
            <= (step.max - step.min) / 255 * 0.5 + 1e-6


def test_inference_only_and_no_grad():
    q = QuantRobeEmbeddingBagCollection.from_float(trained_ebc())
    assert list(q.parameters()) == []  # nothing an optimizer could train
    with torch.no_grad():
        out = q(batch()).values()
    assert torch.isfinite(out).all()
    with torch.inference_mode():
        q(batch())
    out = q(batch()).values()  # grad mode on: still no graph back to the array
    assert not out.requires_grad


def test_built_and_moved_under_inference_mode_its_layout_is_a_normal_tensor():
    """A serving process builds and moves its model under ``inference_mode``: the layout
    buffer stays a tensor with a version, by which the ops remember its check."""
    with torch.inference_mode():
        q = QuantRobeEmbeddingBagCollection(tables(), RobeConfig(compression=10, block_size=8))
        assert not q.table_meta.is_inference()
        q._apply(lambda t: t.clone())  # a move, as .to(device) makes new tensors
        assert not q.table_meta.is_inference()
        q(batch())


def test_state_dict_round_trip_and_layout_check():
    ebc = trained_ebc()
    q = QuantRobeEmbeddingBagCollection.from_float(ebc)
    assert {k: v.dtype for k, v in q.state_dict().items()} == {
        "robe_layout": torch.int64, "qweight": torch.int8, "scale": torch.float32,
        "bias": torch.float32}
    fresh = QuantRobeEmbeddingBagCollection(ebc.embedding_bag_configs(), ebc.layout.config)
    fresh.load_state_dict(q.state_dict())
    kjt = batch()
    with torch.no_grad():
        assert torch.equal(fresh(kjt).values(), q(kjt).values())
    other = QuantRobeEmbeddingBagCollection(tables(), RobeConfig(compression=10, block_size=8,
                                                                 seed=7))
    with pytest.raises(ValueError, match="another ROBE layout"):
        other.load_state_dict(q.state_dict())


def test_feature_order_and_constant_blocks():
    ebc = trained_ebc(shared=False)
    with torch.no_grad():
        ebc.weight[: ebc.memory_size // 2] = 0.25  # constant blocks: scale 0
    q = QuantRobeEmbeddingBagCollection.from_float(ebc)
    assert torch.equal(q.dequantize()[: ebc.memory_size // 2 - 64],
                       torch.full((ebc.memory_size // 2 - 64,), 0.25))
    shuffled = batch(keys=list(reversed(KEYS)))  # the float module reorders keys: so must we
    with torch.no_grad():
        assert relative_error(q(shuffled).values(), ebc(shuffled).values()) < 1e-2


def dlrm(ebc: nn.Module) -> DLRM:
    torch.manual_seed(0)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[16],
                over_arch_layer_sizes=[16, 1]).eval()


def predict(model: nn.Module, seed: int = 1) -> torch.Tensor:
    dense = torch.randn(B, 13, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(dense, batch(seed))


def test_torchrec_quantize_inference_model_swaps_robe_with_our_mapping():
    model = dlrm(trained_ebc())
    ref = predict(model)
    torchrec_quantize(model, quantization_mapping=quant.quantization_mapping())
    swapped = model.sparse_arch.embedding_bag_collection
    assert isinstance(swapped, QuantRobeEmbeddingBagCollection) and swapped.dtype == torch.int8
    quant.check_quantized(model)
    assert relative_error(predict(model), ref) < 1e-2


def test_without_our_mapping_robe_stays_float_and_check_says_so():
    model = torchrec_quantize(dlrm(trained_ebc()))
    assert quant.float_robe_modules(model) == ["sparse_arch.embedding_bag_collection"]
    with pytest.raises(ValueError, match="quantization_mapping"):
        quant.check_quantized(model)


def test_our_quantize_inference_model_swaps_stock_and_robe_and_reads_the_dtype():
    model = nn.ModuleDict({"robe": trained_ebc(),
                           "full": EmbeddingBagCollection(tables(8), device=torch.device("cpu"))})
    quant.quantize_inference_model(model, quantization_dtype=torch.float16)
    assert isinstance(model["robe"], QuantRobeEmbeddingBagCollection)
    assert model["robe"].dtype == torch.float16
    assert type(model["full"]).__module__ == "torchrec.quant.embedding_modules"
