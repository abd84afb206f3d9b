"""A dict keyed by the identity of its keys that forgets an entry once its key is collected:
``torch.utils.weak.WeakIdKeyDictionary``'s job, for the lookups on an op call's host path.

That class builds a ``WeakIdRef`` object for every ``get`` and every ``[]=``, about 1 us
each on the project's 2-vCPU host, and a Triton forward makes two such calls (its plan, the
record of what it checked). This one keys a plain dict by ``id(key)`` and keeps a weak
reference beside the value: a lookup is a dict lookup and a call of that reference, 0.1 us.

Example::

    >>> cache = WeakIdDict()
    >>> key = torch.zeros(1)
    >>> cache[key] = "plan"
    >>> cache.get(key), cache.get(torch.zeros(1))
    ('plan', None)
    >>> del key; len(cache)
    0
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Generic, Optional, Tuple, TypeVar

V = TypeVar("V")


class WeakIdDict(Generic[V]):
    """Values by the identity of their keys (which must accept weak references); an entry
    goes when its key is collected. Not a full mapping: ``get``, ``[]=``, ``in`` and
    ``len``, what the ops' caches need."""

    __slots__ = ("_entries", "_forget")

    def __init__(self) -> None:
        #: id(key) -> (weak reference to the key, value)
        self._entries: Dict[int, Tuple[weakref.KeyedRef, V]] = {}
        self._forget = _forgetter(self._entries)

    def get(self, key: Any, default: Optional[V] = None) -> Optional[V]:
        entry = self._entries.get(id(key))
        # a collected key's entry goes in its reference's callback, before CPython can hand
        # its id to another object; should one ever stay, it must not answer for a newcomer
        # (a plan of another layout would launch a kernel out of its tensors)
        if entry is None or entry[0]() is not key:
            return default
        return entry[1]

    def __setitem__(self, key: Any, value: V) -> None:
        ident = id(key)
        self._entries[ident] = (weakref.KeyedRef(key, self._forget, ident), value)

    def __contains__(self, key: Any) -> bool:
        entry = self._entries.get(id(key))
        return entry is not None and entry[0]() is key

    def __len__(self) -> int:
        return len(self._entries)


def _forgetter(entries: Dict[int, Tuple[weakref.KeyedRef, Any]]):
    """The callback that drops a collected key's entry, unless a newer key of the same id
    has replaced it already. It holds the entries, not the :class:`WeakIdDict`: a key that
    outlives its dict keeps no more than that alive."""

    def forget(ref: weakref.KeyedRef) -> None:
        entry = entries.get(ref.key)
        if entry is not None and entry[0] is ref:
            # pop, not del: another thread may have dropped or replaced it meanwhile (the
            # worst a race can do is drop a newer entry: a cache miss)
            entries.pop(ref.key, None)

    return forget
