"""Every option of TorchRec's ``quantize_inference_model`` either takes effect on a ROBE module
or is refused with an error that says why (issue 31, item 6): ``output_dtype``,
``quantization_dtype``, ``per_table_weight_dtype``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.inference.modules import quantize_inference_model as torchrec_quantize

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec import quant
from robe_torchrec.quant import QuantRobeEmbeddingBagCollection
from tests.test_quant import batch, tables, trained_ebc


class Mixed(nn.Module):
    """A stock EBC (feature ``s``) next to a ROBE one (``f0``..``f2``)."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        self.stock = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="s", embedding_dim=16, num_embeddings=100,
                                feature_names=["s"])])
        self.robe = trained_ebc(shared=shared)

    def forward(self, kjt):
        return self.stock(kjt).values(), self.robe(kjt).values()


def _kjt():
    from torchrec import KeyedJaggedTensor

    kjt = batch()
    n = kjt.stride()
    return KeyedJaggedTensor(keys=["s", *kjt.keys()],
                             values=torch.cat([torch.arange(n) % 100, kjt.values()]),
                             lengths=torch.cat([torch.ones(n, dtype=torch.int64), kjt.lengths()]))


@pytest.mark.parametrize("quantize", [torchrec_quantize, quant.quantize_inference_model],
                         ids=["torchrec", "robe_torchrec"])
@pytest.mark.parametrize("output_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_output_dtype_takes_effect_as_for_stock(quantize, output_dtype):
    model = Mixed()
    kjt = _kjt()
    with torch.no_grad():
        _, ref = model(kjt)
    quantize(model, quantization_mapping=quant.quantization_mapping(), output_dtype=output_dtype)
    assert isinstance(model.robe, QuantRobeEmbeddingBagCollection)
    with torch.no_grad():
        stock, robe = model(kjt)
    assert stock.dtype == output_dtype  # what TorchRec does for its own tables
    assert robe.dtype == output_dtype  # was float32 whatever output_dtype said
    assert float((robe.float() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_per_table_weight_dtype_takes_effect():
    model = Mixed()
    names = [t.name for t in tables()]
    quant.quantize_inference_model(  # int8 by default; the ROBE tables asked for float16
        model, per_table_weight_dtype={name: torch.float16 for name in names})
    assert model.robe.dtype == torch.float16 and model.robe.qweight.dtype == torch.float16
    model = Mixed(shared=False)
    torchrec_quantize(model, quantization_mapping=quant.quantization_mapping(),
                      quantization_dtype=torch.float16,
                      per_table_weight_dtype={name: torch.int8 for name in names})
    assert model.robe.dtype == torch.int8


def test_per_table_weight_dtype_that_splits_an_array_is_refused():
    model = Mixed()
    with pytest.raises(ValueError, match=r"one dtype.*'t_f0': torch.float16.*'t_f1': torch.int8"):
        quant.quantize_inference_model(model, per_table_weight_dtype={"t_f0": torch.float16})


def test_unknown_table_in_per_table_weight_dtype_is_refused():
    with pytest.raises(ValueError, match=r"per_table_weight_dtype names tables.*\['t_typo'\]"):
        quant.quantize_inference_model(Mixed(), per_table_weight_dtype={"t_typo": torch.float16})


@pytest.mark.parametrize("option, value, match", [
    ("output_dtype", torch.int8, r"output_dtype torch.int8.*float32, float16 or bfloat16"),
    ("quantization_dtype", torch.quint4x2, r"cannot store a ROBE array as torch.quint4x2"),
    ("per_table_weight_dtype", {"t_f0": torch.float64, "t_f1": torch.float64,
                                "t_f2": torch.float64},
     r"cannot store a ROBE array as torch.float64"),
])
def test_unsupported_values_are_refused(option, value, match):
    model = nn.ModuleDict({"robe": trained_ebc()})
    with pytest.raises(ValueError, match=match):
        torchrec_quantize(model, quantization_mapping=quant.quantization_mapping(),
                          **{option: value})


def test_from_float_arguments():
    ebc = trained_ebc()
    q = QuantRobeEmbeddingBagCollection.from_float(ebc, dtype=torch.float16,
                                                   output_dtype=torch.bfloat16)
    with torch.no_grad():
        assert q(batch()).values().dtype == torch.bfloat16
    with pytest.raises(TypeError):  # was swallowed by **kwargs
        QuantRobeEmbeddingBagCollection.from_float(ebc, quant_blocksize=32)
