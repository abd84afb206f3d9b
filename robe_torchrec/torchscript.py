"""TorchScript is not supported: scripting a ROBE module fails at once, with the way out.

A ROBE module's forward calls Python helpers TorchScript cannot compile, so
``torch.jit.script`` would fail anyway, deep in its compiler and in its own words
(``Unknown type annotation: 'nn.Parameter'``, or ``Unknown type name '_KeyedJaggedTensor_'``
for a ``torchrec.fx`` graph), while a stock ``EmbeddingBagCollection`` scripts: a TorchRec user
cannot tell that this is by design. ROBE models are served through ``torch.export``
(:mod:`robe_torchrec.export`, docs/serving.md), so scripting is refused before it starts,
through the two hooks TorchScript offers:

* ``torch.jit.script`` calls ``__prepare_scriptable__`` on the module it is given and on every
  submodule before compiling anything: the ROBE modules' hook (:class:`NotScriptable`) raises,
  so scripting a ROBE module, or any model holding one, stops there;
* a ``torchrec.fx`` graph inlines the ROBE module (no submodule is left to ask), but
  TorchScript calls the same hook on each Python function it compiles: the helpers such a
  graph calls are marked with :func:`not_scriptable`.

Example::

    >>> torch.jit.script(model_with_robe_tables)
    Traceback (most recent call last):
    TorchScriptNotSupportedError: RobeEmbeddingBagCollection cannot be scripted ...
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class TorchScriptNotSupportedError(RuntimeError):
    """``torch.jit.script`` of a ROBE module (a ``RuntimeError``, as TorchScript's own errors
    are, so code that caught those still catches this)."""


def refuse_torchscript(what: str) -> NoReturn:
    """Raise :class:`TorchScriptNotSupportedError` for ``what`` (a module or helper name)."""
    raise TorchScriptNotSupportedError(
        f"{what} cannot be scripted: robe_torchrec does not support TorchScript "
        "(torch.jit.script, also of a torchrec.fx graph). Serve the model through "
        "torch.export instead: robe_torchrec.export.export_model(model, dense, kjt) for a "
        "model on (dense_features, KeyedJaggedTensor), or torch.export.export(module, "
        "(kjt,), strict=False) for a module alone; see docs/serving.md")


class NotScriptable:
    """Mixin of the ROBE modules: ``torch.jit.script`` of one, or of a model holding one,
    raises :class:`TorchScriptNotSupportedError` before compiling."""

    def __prepare_scriptable__(self) -> NoReturn:
        refuse_torchscript(type(self).__name__)


def not_scriptable(fn: F) -> F:
    """Mark ``fn`` (a helper that ``torchrec.fx`` graphs of ROBE modules call) so that
    TorchScript, compiling such a graph, raises :class:`TorchScriptNotSupportedError` when it
    reaches ``fn``. ``fn`` itself is unchanged: eager, fx, ``torch.compile`` and
    ``torch.export`` call it as before."""

    def refuse() -> NoReturn:
        refuse_torchscript(f"A graph calling {fn.__module__}.{fn.__qualname__} (a ROBE module "
                           "traced by torchrec.fx)")

    fn.__prepare_scriptable__ = refuse  # type: ignore[attr-defined]
    return fn
