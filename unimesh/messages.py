"""Helpers for error messages, public for backends: every message that quotes a user's value
goes through :func:`short`, and a framework's error is quoted by its :func:`first_line`."""

from __future__ import annotations

import reprlib

__all__ = ["close_match", "first_line", "short"]

_REPR = reprlib.Repr()
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 12
_REPR.maxstring = _REPR.maxother = 100
_REPR.maxlevel = 4


def short(value: object, limit: int = 80) -> str:
    """``repr`` of a value, cut to ``limit`` characters so that messages stay readable; a huge
    or deep container costs no more than its first few items."""
    try:
        text = repr(value) if type(value) in (str, int, float, bool) else _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a repr that raises, or an int of > 4300 digits
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (framework errors run to pages), or
    its repr when the message is empty."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return repr(exc)


def close_match(name: object, choices: object) -> str:
    """`` (did you mean 'dp'?)`` when ``name`` is a string close to one of ``choices`` (an
    axis or backend name with a typo), else the empty string."""
    if not isinstance(name, str) or len(name) > 200:
        return ""
    from difflib import get_close_matches  # on the error path only

    options = (
        [c for c in choices if isinstance(c, str)] if isinstance(choices, (list, tuple)) else []
    )
    near = get_close_matches(name, options[:1000], n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""
