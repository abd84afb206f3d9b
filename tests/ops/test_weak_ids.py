"""``WeakIdDict``, the identity-keyed cache of the ops' host path: it finds a value by its
key's identity only, and forgets an entry once the key is collected."""

import doctest
import gc

import torch

from robe_torchrec.ops import weak_ids
from robe_torchrec.ops.weak_ids import WeakIdDict


def test_values_are_found_by_identity_not_equality():
    cache = WeakIdDict()
    key, twin = torch.zeros(3), torch.zeros(3)
    cache[key] = "plan"
    assert cache.get(key) == "plan" and key in cache
    assert cache.get(twin) is None and twin not in cache
    assert cache.get(twin, "default") == "default"
    cache[key] = "newer"
    assert cache.get(key) == "newer" and len(cache) == 1


def test_an_entry_goes_with_its_key():
    cache = WeakIdDict()
    kept, dropped = torch.zeros(1), torch.zeros(1)
    cache[kept], cache[dropped] = "kept", "dropped"
    del dropped
    gc.collect()
    assert len(cache) == 1 and cache.get(kept) == "kept"


def test_a_reused_id_finds_nothing():
    """An object born where a collected key lived (CPython hands out its memory, so its
    id, again at once) is not that key: the key's entry is gone by then."""
    cache = WeakIdDict()
    for _ in range(100):
        key = torch.zeros(1)
        cache[key] = "old"
        ident = id(key)
        del key
        newcomer = torch.zeros(1)
        if id(newcomer) == ident:
            break
    assert cache.get(newcomer) is None and newcomer not in cache and len(cache) == 0


def test_a_key_may_outlive_its_dict():
    cache, key = WeakIdDict(), torch.zeros(1)
    cache[key] = "value"
    del cache
    del key  # its callback finds the entries alone; nothing raises
    gc.collect()


def test_the_docstring_example_runs():
    result = doctest.testmod(weak_ids, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0
