"""``torch.jit.script`` of a ROBE module fails at once with our error, which names
``torch.export`` and docs/serving.md: for the module itself (pooled and unpooled), a model
holding one, and a ``torchrec.fx`` graph of either (which inlines the module). A stock
``EmbeddingBagCollection`` still scripts, so the refusal is ours, not TorchScript's."""

from __future__ import annotations

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagCollection, EmbeddingConfig

from robe_torchrec import RobeConfig, RobeEmbeddingCollection
from robe_torchrec.torchscript import TorchScriptNotSupportedError
from tests.test_drop_in import ROBE, make_dlrm, make_tables


def _refused(obj) -> str:
    with pytest.raises(TorchScriptNotSupportedError) as info:
        torch.jit.script(obj)
    message = str(info.value)
    assert "TorchScript" in message and "torch.export" in message, message
    assert "docs/serving.md" in message, message
    return message


def _unpooled():
    tables = [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=100,
                              feature_names=["f"])]
    return RobeEmbeddingCollection(tables, RobeConfig(compression=10, block_size=4))


def test_scripting_a_module_names_it():
    from robe_torchrec import RobeEmbeddingBagCollection

    assert _refused(RobeEmbeddingBagCollection(make_tables(), ROBE)).startswith(
        "RobeEmbeddingBagCollection cannot be scripted")
    assert _refused(_unpooled()).startswith("RobeEmbeddingCollection cannot be scripted")


def test_scripting_a_model_holding_one():
    assert _refused(make_dlrm()).startswith("RobeEmbeddingBagCollection cannot be scripted")
    holder = torch.nn.Sequential(torch.nn.Identity(), torch.nn.ModuleDict({"ec": _unpooled()}))
    assert _refused(holder).startswith("RobeEmbeddingCollection cannot be scripted")


@pytest.mark.parametrize("root", ["module", "model"])
def test_scripting_a_torchrec_fx_graph(root):
    from robe_torchrec import RobeEmbeddingBagCollection

    torch.manual_seed(0)
    module = (RobeEmbeddingBagCollection(make_tables(), ROBE) if root == "module"
              else make_dlrm())
    graph = torchrec.fx.symbolic_trace(module)
    # the module is inlined: no submodule of the graph is a ROBE module to refuse
    assert not any("Robe" in type(m).__name__ for m in graph.modules())
    assert "torchrec.fx" in _refused(graph)


def test_stock_modules_still_script():
    """What the refusal must not touch: TorchRec's own module, traced or not."""
    stock = EmbeddingBagCollection(make_tables())
    torch.jit.script(torchrec.fx.symbolic_trace(stock))


def test_scripting_a_quantized_module():
    """The int8/int4 inference module is served through torch.export too."""
    from robe_torchrec.quant import QuantRobeEmbeddingBagCollection
    from tests.test_quant import trained_ebc

    quant = QuantRobeEmbeddingBagCollection.from_float(trained_ebc())
    assert _refused(quant).startswith("QuantRobeEmbeddingBagCollection cannot be scripted")
