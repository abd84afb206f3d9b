"""How a ROBE array starts, from its tables' TorchRec initialisation.

TorchRec's ``EmbeddingBagConfig`` (and ``EmbeddingConfig``) says how a table starts:
``weight_init_min`` / ``weight_init_max`` (uniform in that range) or an ``init_fn`` that
``EmbeddingBagCollection.reset_parameters`` calls on the table's weight. A ROBE array holds
no table's rows, but it honours what the tables say where that is one thing:

* tables that set neither keep ROBE's default, uniform in ``[-s, s]`` with
  ``s = RobeConfig.init_scale`` (else ``sqrt(1 / max num_embeddings)``);
* an array whose tables all set the same range, or the same ``init_fn``, is drawn with it
  (``init_fn`` gets the array's 1-D slice of ``weight``);
* anything else raises, naming the tables: tables sharing an array that disagree, or a
  table's setting beside ``RobeConfig.init_scale``. Nothing a table says is dropped.

Example::

    >>> from functools import partial
    >>> tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=1000,
    ...                              feature_names=["f"], weight_init_min=-0.01, weight_init_max=0.01)]
    >>> ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=10))
    >>> float(ebc.weight.abs().max()) <= 0.01
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class TableInit:
    """A table's own initialisation: uniform in ``[low, high]``, or ``fn`` (its ``init_fn``)."""

    low: float = 0.0
    high: float = 0.0
    fn: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None

    def same_as(self, other: "TableInit") -> bool:
        if self.fn is None or other.fn is None:
            return self.fn is other.fn and (self.low, self.high) == (other.low, other.high)
        return _same_function(self.fn, other.fn)

    def describe(self) -> str:
        if self.fn is None:
            return f"uniform in [{self.low:g}, {self.high:g}]"
        return f"init_fn {_function_name(self.fn)}"

    def draw(self, array: torch.Tensor, tables: Sequence[str]) -> None:
        """Initialise ``array`` (a 1-D slice of the module's weight) in place."""
        if self.fn is None:
            array.uniform_(self.low, self.high)
            return
        try:
            out = self.fn(array)
        except Exception as exc:  # a table's own code: name whose it is
            raise ValueError(
                f"the init_fn of table(s) {list(tables)} failed on their ROBE array, a 1-D "
                f"tensor of {array.numel()} floats (a ROBE array holds no [rows, dim] table): "
                f"{type(exc).__name__}: {exc}. Give those tables an init_fn that takes any "
                "tensor, weight_init_min/weight_init_max, or RobeConfig(init_scale=...)") from exc
        if isinstance(out, torch.Tensor) and out.data_ptr() != array.data_ptr():
            array.copy_(out)  # an init_fn that returns its values instead of writing them


def _function_name(fn: Callable) -> str:
    """``normal_(std=0.01)`` for ``partial(torch.nn.init.normal_, std=0.01)``."""
    if isinstance(fn, functools.partial):
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{_function_name(fn.func)}({', '.join(args)})"
    return getattr(fn, "__qualname__", None) or repr(fn)


def _same_function(a: Callable, b: Callable) -> bool:
    """Whether two ``init_fn`` s are one: the same object, or partials of one function with
    equal arguments (tables built in a loop each get a partial of their own)."""
    if a is b:
        return True
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return (_same_function(a.func, b.func) and _equal(a.args, b.args)
                and _equal(a.keywords, b.keywords))
    return False


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  tensors among the arguments: not the same init then
        return False


def table_init(table: Any) -> Optional[TableInit]:
    """What ``table`` (an ``EmbeddingBagConfig`` or ``EmbeddingConfig``) says about its
    initialisation, or ``None`` when it says nothing: no ``weight_init_min`` /
    ``weight_init_max`` and the ``init_fn`` TorchRec fills in from them."""
    fn = getattr(table, "init_fn", None)
    bounds = None if fn is None else _uniform_partial(fn)
    if fn is not None and bounds is None:
        return TableInit(fn=fn)
    if bounds is None:  # no init_fn at all: TorchRec's range
        bounds = (table.get_weight_init_min(), table.get_weight_init_max())
    default = math.sqrt(1 / table.num_embeddings)
    said = (getattr(table, "weight_init_min", None), getattr(table, "weight_init_max", None))
    if said == (None, None) and bounds == (-default, default):
        return None  # the init_fn TorchRec fills in when the config gives no range
    return TableInit(low=bounds[0], high=bounds[1])


def _uniform_partial(fn: Callable) -> Optional[Tuple[float, float]]:
    """``(a, b)`` of ``partial(torch.nn.init.uniform_, a=a, b=b)``, else ``None``."""
    if (isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_
            and not fn.args and set(fn.keywords) == {"a", "b"}):
        return fn.keywords["a"], fn.keywords["b"]
    return None


def array_inits(tables: Sequence[Any], array_of_table: Sequence[int], num_arrays: int,
                init_scale_given: bool) -> Tuple[Optional[TableInit], ...]:
    """The initialisation of each ROBE array: its tables' own, or ``None`` for ROBE's default
    (uniform in ``[-init_scale, init_scale]``). Raises ``ValueError`` where the tables of an
    array disagree, or set one beside ``RobeConfig.init_scale``."""
    inits = [table_init(t) for t in tables]
    given = [t.name for t, init in zip(tables, inits) if init is not None]
    if given and init_scale_given:
        raise ValueError(
            f"RobeConfig(init_scale=...) and table(s) {given} (weight_init_min/weight_init_max "
            "or init_fn) both say how the ROBE array starts: keep one of them")
    out: List[Optional[TableInit]] = []
    for array in range(num_arrays):
        members = [(t.name, init) for t, a, init in zip(tables, array_of_table, inits)
                   if a == array]
        first = members[0][1]
        if all(init is None for _, init in members):
            out.append(None)
            continue
        if first is None or any(init is None or not init.same_as(first)
                                for _, init in members):
            found = "; ".join(f"{name!r}: {'default' if init is None else init.describe()}"
                              for name, init in members)
            raise ValueError(
                f"tables {[name for name, _ in members]} share one ROBE array but not one "
                f"initialisation ({found}): give them the same weight_init_min/weight_init_max "
                "or init_fn, or one array each (RobeConfig(shared=False)), or set "
                "RobeConfig(init_scale=...) and none of theirs")
        out.append(first)
    return tuple(out)


__all__ = ["TableInit", "array_inits", "table_init"]
