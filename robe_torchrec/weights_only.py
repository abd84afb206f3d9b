"""What ``torch.load(weights_only=True)`` refused, in one line.

Its error runs over a dozen lines of advice about ``weights_only``; the line that says what
the file asked for (``Unsupported global: GLOBAL posix.system ...``) is the one an error of
ours quotes.

Example::

    >>> try:
    ...     torch.load(io.BytesIO(payload), weights_only=True)
    ... except pickle.UnpicklingError as e:
    ...     print(refusal(e))
    Unsupported global: GLOBAL posix.system was not an allowed global by default. ...
"""

from __future__ import annotations


def refusal(exc: BaseException) -> str:
    """The line of ``exc`` (a weights-only unpickler's error) naming what it refused, else
    its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported" in line or "GLOBAL" in line]
    return (named or lines or [repr(exc)])[0]
