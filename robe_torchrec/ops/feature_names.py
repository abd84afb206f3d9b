"""Feature names in the ops' messages.

An op knows a feature only by its column in ``table_meta``, so its messages say
``of feature 3``. A module names the columns of the ``table_meta`` it passes
(:func:`name_features`), and the ops' messages then say ``of feature 3 ('user_id')``
wherever they are raised: at the call, inside a graph ``torch.compile`` made (where the
module's own ``try`` around the op is gone), and by a deferred check at a later call, which
may be another module's (the name is that of the call whose input was bad).

Example::

    >>> meta = torch.zeros(8, 2, dtype=torch.int64)
    >>> name_features(meta, ["user", "item"])
    >>> with_names("robe: id 7 at position 3 of feature 1 is out of range", meta)
    "robe: id 7 at position 3 of feature 1 ('item') is out of range"
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

import torch

from robe_torchrec.ops.weak_ids import WeakIdDict

#: table_meta -> the names of its columns (weak keys: a module's buffer, while it lives)
_NAMES: WeakIdDict = WeakIdDict()
#: a feature the message does not name yet
_UNNAMED = re.compile(r"of feature (\d+)(?! \()")


def name_features(table_meta: torch.Tensor, names: Sequence[str]) -> None:
    """Have the ops' messages about ``table_meta``'s columns name them ``names``."""
    _NAMES[table_meta] = tuple(names)


def names_of(table_meta: Optional[torch.Tensor]) -> Optional[Tuple[str, ...]]:
    """The names given to ``table_meta``'s columns, or ``None``."""
    return None if table_meta is None else _NAMES.get(table_meta)


def with_names(message: str, table_meta: Optional[torch.Tensor],
               names: Optional[Tuple[str, ...]] = None) -> str:
    """``message`` with the first feature it gives by index only also given by name
    (``names``, else those of ``table_meta``); unchanged when the feature has none."""
    names = names if names is not None else names_of(table_meta)
    if not names:
        return message
    found = _UNNAMED.search(message)
    if found is None or int(found.group(1)) >= len(names):
        return message
    named = f"{found.group(0)} ('{names[int(found.group(1))]}')"
    return message[:found.start()] + named + message[found.end():]


def name_in_error(err: BaseException, table_meta: Optional[torch.Tensor],
                  names: Optional[Tuple[str, ...]] = None) -> None:
    """Name the feature in ``err``'s message (its first argument) as :func:`with_names`
    does, in place: the caller re-raises the same exception, with its type and
    traceback."""
    if err.args and isinstance(err.args[0], str):
        named = with_names(err.args[0], table_meta, names)
        if named is not err.args[0]:
            err.args = (named, *err.args[1:])
