"""Sharding a 26-table ROBE DLRM prints none of TorchRec's known noise (two warnings per
data-parallel table and rank, and its FutureWarnings about its own defaults), and
``ROBE_TORCHREC_ALL_WARNINGS=1`` shows it again; nothing else is filtered."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from robe_torchrec import RobeConfig
    from robe_torchrec.dlrm import DLRMSpec, build_dlrm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    keys = [f"cat_{i}" for i in range(26)]
    model, _ = build_dlrm(DLRMSpec(robe=RobeConfig(compression=10), embedding_dim=8,
                                   dense_arch=(16, 8), over_arch=(8, 1)), keys, [100] * 26)
    if sys.argv[1] == "app":   # the app's sharding helper
        from omegaconf import OmegaConf
        from robe_torchrec.train.model import shard
        import torch
        cfg = OmegaConf.create({"sharding": {"types": None},
                                "embedding": {"kind": "robe", "shared": True}})
        shard(model, cfg, torch.device("cpu"))
    else:
        from robe_torchrec import quiet
        quiet.install()
        DistributedModelParallel(model)
    print("sharded")
    dist.destroy_process_group()
""")


def _run(mode: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


NOISE = ("Sharding spec not found", "caching params will be ignored",
         "HeuristicalStorageReservation", "broadcast_buffers")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dmp", "app"])
def test_sharding_prints_no_known_noise(mode):
    out = _run(mode)
    assert not [n for n in NOISE if n in out], out
    assert len(out.strip().splitlines()) <= 3, out
    shown = _run(mode, ROBE_TORCHREC_ALL_WARNINGS="1")
    assert shown.count("Sharding spec not found") == 26, shown
    assert shown.count("caching params will be ignored") == 26, shown


def test_only_the_known_messages_are_filtered():
    from robe_torchrec import quiet

    quiet.install()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    utils = logging.getLogger("torchrec.distributed.utils")
    # another test in this process may have configured logging (Hydra disables the loggers
    # that exist when it sets up its own): this test is about our filter alone
    was_disabled, level = utils.disabled, utils.level
    utils.disabled = False
    utils.setLevel(logging.WARNING)
    utils.addHandler(handler)
    try:
        utils.warning("Sharding Type is data_parallel, caching params will be ignored")
        utils.warning("something else torchrec says")
    finally:
        utils.removeHandler(handler)
        utils.disabled, utils.level = was_disabled, level
    assert seen == ["something else torchrec says"]


LOOKUP = textwrap.dedent("""
    import torch
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection

    ebc = RobeEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
        RobeConfig(memory_size=16, block_size=2))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 2]),
                                              lengths=torch.tensor([2]))
    print(ebc(kjt).values().shape)
""")


def test_a_lookup_prints_nothing_but_its_output():
    """A newcomer's first lookup: torch's once-per-run notice about ``is_fx_tracing``, which
    TorchRec's KeyedJaggedTensor triggers, is filtered; ``ROBE_TORCHREC_ALL_WARNINGS=1``
    shows it again."""
    run = functools.partial(subprocess.run, [sys.executable, "-c", LOOKUP], cwd=ROOT,
                            text=True, capture_output=True, timeout=120)
    quiet = run(env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert (quiet.stdout, quiet.stderr) == ("torch.Size([1, 4])\n", ""), quiet.stderr
    shown = run(env={**os.environ, "PYTHONPATH": str(ROOT), "ROBE_TORCHREC_ALL_WARNINGS": "1"})
    assert "is_fx_tracing" in shown.stderr, shown.stderr

