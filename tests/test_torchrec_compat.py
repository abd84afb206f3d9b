"""robe_torchrec.torchrec_compat: what differs between the supported torchrec releases.

`make test` runs this file under torchrec 1.8.0 (.venv) and 1.6.1 (.venv-tr16), so each
release-specific expectation below is checked on the release it is about."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from robe_torchrec import torchrec_compat as compat
from tests.distributed.multiprocess import run_ranks


def test_parse_version():
    assert compat.parse_version("1.8.0") == (1, 8, 0)
    assert compat.parse_version("1.6.1+cpu") == (1, 6, 1)
    assert compat.parse_version("1.9.0.dev20260101") == (1, 9, 0)
    assert compat.parse_version("2.0") == (2, 0, 0)
    with pytest.raises(ValueError, match="not a torchrec version"):
        compat.parse_version("nightly")


def test_installed_release_is_supported():
    installed = compat.parse_version(importlib.metadata.version("torchrec"))
    assert compat.TORCHREC_VERSION == installed
    assert compat.OLDEST_SUPPORTED <= installed <= compat.NEWEST_TESTED


def test_wrapping_detection_follows_the_hook():
    class WithHook:
        def init_data_parallel(self):
            pass

    class WithoutHook:
        pass

    assert not compat.sharded_modules_wrap_data_parallel((WithHook, WithHook))
    assert compat.sharded_modules_wrap_data_parallel((WithHook, WithoutHook))


def test_wrapping_detection_on_the_tested_releases():
    expected = {(1, 6, 1): True, (1, 8, 0): False}
    if compat.TORCHREC_VERSION not in expected:
        pytest.skip(f"no expectation recorded for torchrec {compat.TORCHREC_VERSION}")
    assert compat.sharded_modules_wrap_data_parallel() == expected[compat.TORCHREC_VERSION]


def test_pipeline_helpers_keep_their_signatures():
    # what pipelines/fused_sparse_dist.py and pipelines/semi_sync.py pass them
    lookup = inspect.signature(compat.start_embedding_lookup).parameters
    assert list(lookup)[:2] == ["module", "context"]
    assert {"source_stream", "target_stream", "stream_context"} <= set(lookup)
    assert list(inspect.signature(compat.wait_for_events).parameters) == [
        "batch", "context", "stream"]


def _unwrap_real_ddp(rank: int, world: int) -> list:
    inner = nn.Linear(2, 2)
    lookups = [nn.parallel.DistributedDataParallel(inner), nn.Linear(2, 2)]
    plain = lookups[1]
    compat.undo_data_parallel_wrapping(lookups)
    # the dropped wrapper never ran a forward, so its reducer's hooks stay inert
    inner(torch.ones(1, 2)).sum().backward()
    return [lookups[0] is inner, lookups[1] is plain, inner.weight.grad is not None]


def test_undo_data_parallel_wrapping_returns_the_wrapped_modules():
    assert run_ranks(_unwrap_real_ddp, 1) == [[True, True, True]]


def _data_parallel_lookups(rank: int, world: int) -> dict:
    from robe_torchrec import RobeConfig
    from robe_torchrec.distributed.lookup import RobeShardedLookup
    from tests.distributed.common import make_dmp, tables

    types = {t.name: "data_parallel" for t in tables()}
    dmp = make_dmp(RobeConfig(compression=4.0), types, world,
                   optimizer=(torch.optim.SGD, {"lr": 0.1}))
    sharded = dmp.module.ebc
    return {
        "lookups": [type(lk).__name__ for lk in sharded.robe_lookups],
        "robe": all(isinstance(lk, RobeShardedLookup) for lk in sharded.robe_lookups),
        "ddp": [name for name, m in dmp.named_modules()
                if isinstance(m, nn.parallel.DistributedDataParallel)],
        "weight": sharded.robe_lookups[0].weight.detach().clone().numpy(),
        "requires_grad": [lk.weight.requires_grad for lk in sharded.robe_lookups],
    }


@pytest.mark.slow
def test_data_parallel_lookups_are_not_under_ddp():
    """On torchrec 1.6 TorchRec's constructor wraps them; the sharded module unwraps them,
    then takes their arrays out of autograd (DDP would have refused them so)."""
    ranks = run_ranks(_data_parallel_lookups, 2)
    for found in ranks:
        assert found["robe"], found["lookups"]
        assert found["ddp"] == []
        assert found["requires_grad"] == [False] * len(found["lookups"])  # fused arrays
    assert (ranks[0]["weight"] == ranks[1]["weight"]).all()


def test_declared_releases_match_the_adapter_and_the_makefile():
    root = Path(__file__).resolve().parents[1]
    # read as text: tomllib is Python 3.11+, and the project supports 3.10
    declared = re.search(r'^\[tool\.robe_torchrec\]\ntorchrec = ">=([\d.]+),<=([\d.]+)"$',
                         (root / "pyproject.toml").read_text(), re.M)
    assert declared is not None, "pyproject.toml has no [tool.robe_torchrec] torchrec range"
    low, high = declared.groups()
    assert compat.parse_version(low) == compat.OLDEST_SUPPORTED
    assert compat.parse_version(high) == compat.NEWEST_TESTED
    # the two environments `make test` runs are the two ends of the range
    pins = re.findall(r"torchrec==([\d.]+)", (root / "Makefile").read_text())
    assert sorted(map(compat.parse_version, pins)) == [compat.OLDEST_SUPPORTED,
                                                       compat.NEWEST_TESTED]
