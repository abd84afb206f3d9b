"""A stock EmbeddingBagCollection's state dict loaded into a ROBE model: the error points
to ``RobeEmbeddingBagCollection.from_embedding_bag_collection``."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec import stock_state_dict

TABLES = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50,
                             feature_names=[f"f{i}"]) for i in range(2)]


class Model(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = torch.nn.Linear(4, 4)


def test_stock_state_dict_into_robe_model_names_the_conversion():
    stock = Model(EmbeddingBagCollection(tables=TABLES))
    robe = Model(RobeEmbeddingBagCollection(TABLES, RobeConfig(compression=10, block_size=4)))
    stock_state_dict.register(robe.ebc)
    with pytest.raises(RuntimeError, match=r"ebc is a RobeEmbeddingBagCollection.*tables \(2: "
                                           r"t0, t1\).*from_embedding_bag_collection"):
        robe.load_state_dict(stock.state_dict())
    # a non-strict load (the dense layers, say) goes on, with the hint as a warning
    with pytest.warns(UserWarning, match="from_embedding_bag_collection"):
        result = robe.load_state_dict(stock.state_dict(), strict=False)
    assert "ebc.embedding_bags.t0.weight" in result.unexpected_keys
    assert torch.equal(robe.dense.weight, stock.dense.weight)
    robe.load_state_dict(robe.state_dict())
    # and the way out works
    converted = RobeEmbeddingBagCollection.from_embedding_bag_collection(
        stock.ebc, RobeConfig(compression=10, block_size=4))
    assert converted.weight.numel() == robe.ebc.weight.numel()


def test_every_robe_module_gets_the_hint():
    """Registered by the module itself (RobeEmbeddingBagCollection.__init__)."""
    stock = EmbeddingBagCollection(tables=TABLES)
    robe = RobeEmbeddingBagCollection(TABLES, RobeConfig(compression=10, block_size=4))
    with pytest.raises(RuntimeError, match="from_embedding_bag_collection"):
        robe.load_state_dict(stock.state_dict())


def test_a_stock_embedding_collection_state_dict_names_its_conversion():
    """The sequence module's twin: a stock ``EmbeddingCollection``'s state dict gets the
    hint, and ``from_embedding_collection`` fits the array as the bag conversion fits the
    same trained tables (the two modules' arrays are interchangeable)."""
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from robe_torchrec import RobeEmbeddingCollection

    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50,
                              feature_names=[f"f{i}"]) for i in range(2)]
    stock = EmbeddingCollection(tables=tables, need_indices=True)
    robe = RobeEmbeddingCollection(tables, RobeConfig(compression=10, block_size=4))
    with pytest.raises(RuntimeError, match=r"RobeEmbeddingCollection.*stock "
                                           r"EmbeddingCollection's tables \(2: t0, t1\).*"
                                           r"from_embedding_collection"):
        robe.load_state_dict(stock.state_dict())
    converted = RobeEmbeddingCollection.from_embedding_collection(
        stock, RobeConfig(compression=10, block_size=4))
    assert converted.need_indices() and [t.name for t in converted.embedding_configs()] == \
        ["t0", "t1"]
    bags = EmbeddingBagCollection(tables=TABLES)
    bags.load_state_dict({f"embedding_bags.{k[len('embeddings.'):]}": v
                          for k, v in stock.state_dict().items()})
    from_bags = RobeEmbeddingBagCollection.from_embedding_bag_collection(
        bags, RobeConfig(compression=10, block_size=4))
    assert torch.equal(converted.weight, from_bags.weight)
    assert not torch.equal(converted.weight, robe.weight)
