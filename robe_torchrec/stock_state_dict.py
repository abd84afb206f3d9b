"""A stock ``EmbeddingBagCollection`` (or ``EmbeddingCollection``) state dict loaded into a
ROBE module: the error says how to get there,
``RobeEmbeddingBagCollection.from_embedding_bag_collection`` (or
``RobeEmbeddingCollection.from_embedding_collection``).

A ROBE module stores one array, ``weight``; a stock EBC stores one table per name,
``embedding_bags.<table>.weight`` (an EC ``embeddings.<table>.weight``). ``load_state_dict``
(strict) would only list the missing and unexpected keys. :func:`register` adds a
load-state-dict pre-hook to a ROBE module that appends the way out to that error
(``strict=False``: a warning, and the load goes on).

Example::

    >>> robe_ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=100))
    >>> register(robe_ebc)
    >>> robe_ebc.load_state_dict(stock_ebc.state_dict())
    RuntimeError: ... from_embedding_bag_collection ...
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Dict, List, NamedTuple, Optional

import torch


class StockModule(NamedTuple):
    """Where a stock collection keeps its tables, and how its ROBE twin is built from it."""
    #: the stock class's name
    name: str
    #: the state dict key of each table, before ``<table>.weight``
    tables_key: str
    #: the call that fits a ROBE module to the trained stock module
    conversion: str


BAGS = StockModule(
    "EmbeddingBagCollection", "embedding_bags.",
    "RobeEmbeddingBagCollection.from_embedding_bag_collection(ebc, RobeConfig(...)) fits the "
    "array to the trained tables (docs/compress.md; robe_torchrec.compress."
    "fit_from_checkpoint reads a DCP checkpoint)")
SEQUENCES = StockModule(
    "EmbeddingCollection", "embeddings.",
    "RobeEmbeddingCollection.from_embedding_collection(ec, RobeConfig(...)) fits the array "
    "to the trained tables (docs/compress.md)")


def stock_tables(state_dict: Dict[str, Any], prefix: str, stock: StockModule = BAGS) -> List[str]:
    """The stock module's tables (``<prefix><tables_key><table>.weight``) of ``state_dict``."""
    start = prefix + stock.tables_key
    return [k[len(start):-len(".weight")] for k in state_dict
            if k.startswith(start) and k.endswith(".weight")]


def hint(module: torch.nn.Module, state_dict: Dict[str, Any], prefix: str,
         stock: StockModule = BAGS) -> str:
    tables = stock_tables(state_dict, prefix, stock)
    where = prefix.rstrip(".") or "the module"
    shown = ", ".join(tables[:3]) + (", ..." if len(tables) > 3 else "")
    return (f"{where} is a {type(module).__name__}, which stores one ROBE-Z array "
            f"({prefix}weight), and the state dict holds a stock {stock.name}'s "
            f"tables ({len(tables)}: {shown}). Load it into the {stock.name} it came "
            f"from, then build the ROBE module from that: {stock.conversion}")


def _load_is_strict() -> Optional[bool]:
    """``strict`` of the ``Module.load_state_dict`` call running now, if any (torch hands
    every module's hooks ``strict=True`` and filters the keys at the end)."""
    code = torch.nn.Module.load_state_dict.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return None


def _pre_hook(stock: StockModule, module: torch.nn.Module, state_dict: Dict[str, Any],
              prefix: str, local_metadata: Dict[str, Any], strict: bool,
              missing_keys: List[str], unexpected_keys: List[str],
              error_msgs: List[str]) -> None:
    if prefix + "weight" in state_dict or not stock_tables(state_dict, prefix, stock):
        return
    if _load_is_strict():  # part of the strict load's error
        error_msgs.append(hint(module, state_dict, prefix, stock))
    else:
        # a partial load (the dense layers of a stock model, say) goes on; the array is not
        # loaded, which is worth a word
        warnings.warn(hint(module, state_dict, prefix, stock), stacklevel=2)


def register(module: torch.nn.Module, stock: StockModule = BAGS) -> None:
    """Add the hint for ``stock``'s state dicts to ``module``'s strict ``load_state_dict``
    (once)."""
    if not getattr(module, "_robe_stock_state_dict_hint", False):
        module._register_load_state_dict_pre_hook(functools.partial(_pre_hook, stock),
                                                  with_module=True)
        module._robe_stock_state_dict_hint = True


__all__ = ["BAGS", "SEQUENCES", "StockModule", "hint", "register", "stock_tables"]
