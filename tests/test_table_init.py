"""A ROBE array starts as its tables' TorchRec configs say (``weight_init_min`` /
``weight_init_max``, ``init_fn``), or with ROBE's default when they say nothing; tables that
disagree about one array, or that disagree with ``RobeConfig.init_scale``, are refused."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection, RobeEmbeddingCollection
from robe_torchrec.table_init import TableInit, table_init
from tests.train.helpers import one_rank_group


def make_tables(*inits, rows=(400, 900, 100)):
    """Three tables; ``inits[i]``: keyword arguments of table ``i``'s config."""
    inits = inits + ({},) * (3 - len(inits))
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=n,
                               feature_names=[f"f{i}"], **init)
            for i, (n, init) in enumerate(zip(rows, inits))]


def arrays(ebc):
    """Each array's slice of the module's weight."""
    layout = ebc.layout
    return [ebc.weight.detach()[o: o + n] for o, n in zip(layout.array_offsets,
                                                          layout.array_sizes)]


RANGE = dict(weight_init_min=-0.002, weight_init_max=0.003)


def test_tables_that_say_nothing_keep_the_default_draw():
    torch.manual_seed(0)
    ebc = RobeEmbeddingBagCollection(make_tables(), RobeConfig(compression=10))
    torch.manual_seed(0)
    scale = math.sqrt(1 / 900)
    expected = torch.empty(ebc.memory_size).uniform_(-scale, scale)
    assert torch.equal(ebc.weight.detach(), expected)
    assert ebc.layout.array_inits == (None,)


def test_a_shared_array_takes_the_range_all_its_tables_give():
    torch.manual_seed(1)
    ebc = RobeEmbeddingBagCollection(make_tables(RANGE, RANGE, RANGE), RobeConfig(compression=10))
    torch.manual_seed(1)
    assert torch.equal(ebc.weight.detach(), torch.empty(ebc.memory_size).uniform_(-0.002, 0.003))


def test_one_array_a_table_each_starts_as_its_table_says():
    constant = partial(torch.nn.init.constant_, val=0.25)
    ebc = RobeEmbeddingBagCollection(make_tables({}, RANGE, dict(init_fn=constant)),
                                     RobeConfig(compression=10, shared=False))
    default, ranged, custom = arrays(ebc)
    assert 0 < default.abs().max() <= math.sqrt(1 / 900)
    assert ranged.min() >= -0.002 and ranged.max() <= 0.003 and ranged.min() < -0.0015
    assert (custom == 0.25).all()
    ebc.weight.data.zero_()
    ebc.reset_parameters()  # the same rules when drawn again
    assert (arrays(ebc)[2] == 0.25).all() and arrays(ebc)[1].abs().max() > 0


def test_init_fns_made_alike_count_as_one_and_are_named_by_what_they_do():
    """Tables built in a loop each get a partial of their own: equal partials are one init."""
    tables = make_tables(*[dict(init_fn=partial(torch.nn.init.normal_, std=0.5))
                           for _ in range(3)])
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=10))
    assert ebc.weight.std() > 0.4
    assert table_init(tables[0]).describe() == "init_fn normal_(std=0.5)"


def test_an_init_fn_that_returns_its_values_is_used():
    ebc = RobeEmbeddingBagCollection(make_tables(*[dict(init_fn=torch.ones_like)] * 3),
                                     RobeConfig(compression=10))
    assert (ebc.weight == 1).all()


@pytest.mark.parametrize("inits, shared, message", [
    ((RANGE,), True, r"tables \['t0', 't1', 't2'\] share one ROBE array but not one "
                     r"initialisation \('t0': uniform in \[-0.002, 0.003\]; 't1': default"),
    ((RANGE, dict(weight_init_min=-0.1, weight_init_max=0.1), RANGE), True,
     r"'t1': uniform in \[-0.1, 0.1\]"),
    ((dict(init_fn=torch.nn.init.zeros_),) * 2 + (dict(init_fn=torch.nn.init.ones_),), True,
     r"'t0': init_fn zeros_; 't1': init_fn zeros_; 't2': init_fn ones_"),
])
def test_tables_that_disagree_about_one_array_are_refused(inits, shared, message):
    with pytest.raises(ValueError, match=message):
        RobeEmbeddingBagCollection(make_tables(*inits), RobeConfig(compression=10, shared=shared))
    # one array each, every table is drawn its own way
    RobeEmbeddingBagCollection(make_tables(*inits), RobeConfig(compression=10, shared=False))


def test_a_table_init_beside_init_scale_is_refused():
    with pytest.raises(ValueError, match=r"init_scale=...\) and table\(s\) \['t1'\] .* keep one"):
        RobeEmbeddingBagCollection(make_tables({}, RANGE),
                                   RobeConfig(compression=10, init_scale=0.1, shared=False))


def test_an_init_fn_that_needs_a_table_shape_names_the_table():
    tables = make_tables(*[dict(init_fn=torch.nn.init.xavier_uniform_)] * 3)
    with pytest.raises(ValueError, match=r"the init_fn of table\(s\) \['t0', 't1', 't2'\] failed "
                                         r"on their ROBE array, a 1-D tensor"):
        RobeEmbeddingBagCollection(tables, RobeConfig(compression=10))
    # built on meta, the error comes where the array is drawn
    module = RobeEmbeddingBagCollection(tables, RobeConfig(compression=10), device="meta")
    module.to_empty(device="cpu")
    with pytest.raises(ValueError, match="the init_fn of table"):
        module.reset_parameters()


def test_what_a_config_says():
    plain, = make_tables()[:1]
    assert table_init(plain) is None  # TorchRec filled in its init_fn from the default range
    assert table_init(make_tables(dict(weight_init_max=0.5))[0]) == TableInit(
        low=-math.sqrt(1 / 400), high=0.5)
    assert table_init(make_tables(dict(init_fn=torch.nn.init.zeros_))[0]).fn is \
        torch.nn.init.zeros_
    # a uniform init_fn of its own range, as TorchRec's reset_parameters would call it
    wide = partial(torch.nn.init.uniform_, a=-0.5, b=0.5)
    assert table_init(make_tables(dict(init_fn=wide))[0]) == TableInit(low=-0.5, high=0.5)


def test_the_unpooled_module_follows_the_same_rules():
    from torchrec import EmbeddingConfig

    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=4, num_embeddings=100,
                              feature_names=[f"f{i}"], init_fn=torch.nn.init.zeros_)
              for i in range(2)]
    assert (RobeEmbeddingCollection(tables, RobeConfig(compression=10)).weight == 0).all()


def test_sharded_from_meta_starts_where_the_cpu_module_starts():
    """DMP draws a meta-device module's arrays with the same rules (one rank, in process)."""
    tables = make_tables({}, RANGE, dict(init_fn=partial(torch.nn.init.constant_, val=0.5)))
    robe = RobeConfig(compression=10, shared=False)
    torch.manual_seed(5)
    direct = RobeEmbeddingBagCollection(tables, robe)
    meta = RobeEmbeddingBagCollection(tables, robe, device="meta")
    apply_optimizer_in_backward(torch.optim.SGD, meta.parameters(), {"lr": 0.1})
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"],
                                              values=torch.tensor([1, 2, 3, 4, 5, 6]),
                                              lengths=torch.tensor([1, 1, 1, 1, 1, 1]))
    with one_rank_group():
        torch.manual_seed(5)
        dmp = DistributedModelParallel(meta, device=torch.device("cpu"))
        assert torch.equal(dmp(kjt).wait().values(), direct(kjt).values())
