"""Python ``re`` patterns with Python's meaning, matched by RE2 in linear time.

LayoutMap keys are written in Python's regex syntax (Keras matches them with ``re.fullmatch``),
but Python's engine backtracks exponentially on keys like ``(a+)+$``, so unimesh matches them
with RE2. The two dialects share a syntax and differ in meaning: Python's ``\\w``, ``\\d`` and
``\\s`` are Unicode classes where RE2's are ASCII; Python spells the end of text ``\\Z``, RE2
``\\z``. This module parses a key with Python's own parser (so a key Python refuses is refused
with Python's message) and writes the parse tree back out in RE2's syntax with Python's
meaning: every class spelled out as code point ranges taken from Python's own ``str`` methods.
What RE2 cannot mean the same way is refused, naming the construct: lookaround,
backreferences, conditionals, possessive repeats and atomic groups, case-insensitive
matching, and ``\\b``/``\\B`` outside ASCII mode.

Paths are single lines (no line break: :func:`check_path`), so ``^``, ``$``, ``\\A``, ``\\Z``
and their multi-line forms all mean the start or the end of the path.
"""

from __future__ import annotations

import functools
import re
import sys
import threading
from typing import Any

try:  # Python 3.11+
    from re import _constants as _c  # type: ignore[attr-defined]
    from re import _parser as _p  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c
    import sre_parse as _p

__all__ = ["RegexRefused", "check_path", "to_re2"]

_MAX = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
#: the longest RE2 pattern a key may become (a class such as \w is ~10 KB spelled out)
MAX_TRANSLATED = 1 << 20


class RegexRefused(Exception):
    """A key this dialect cannot match with Python's meaning; ``args[0]`` says why."""


Ranges = tuple[tuple[int, int], ...]


@functools.cache
def _unicode_class(test: str) -> Ranges:
    """The code points (surrogates aside) for which ``str.<test>`` holds, as ranges: what
    Python's ``re`` uses for ``\\w`` (isalnum or ``_``), ``\\d`` (isdecimal), ``\\s``
    (isspace) in a str pattern."""
    out: list[tuple[int, int]] = []
    start = -1
    for cp in range(_MAX + 1):
        if _SURROGATES[0] <= cp <= _SURROGATES[1]:
            hit = False
        else:
            ch = chr(cp)
            if test == "word":
                hit = ch.isalnum() or ch == "_"
            elif test == "digit":
                hit = ch.isdecimal()
            else:
                hit = ch.isspace()
        if hit and start < 0:
            start = cp
        elif not hit and start >= 0:
            out.append((start, cp - 1))
            start = -1
    if start >= 0:
        out.append((start, _MAX))
    return tuple(out)


_ASCII_CLASSES: dict[str, Ranges] = {
    "word": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "digit": ((0x30, 0x39),),
    "space": ((0x09, 0x0D), (0x20, 0x20)),  # Python's ASCII \s includes \v (0x0b)
}


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in _merge(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX:
        out.append((nxt, _MAX))
    return out


def _char(cp: int) -> str:
    ch = chr(cp)
    return ch if ch.isascii() and ch.isalnum() else f"\\x{{{cp:X}}}"


def _class(ranges: list[tuple[int, int]]) -> str:
    """An RE2 class of exactly these code points (surrogates left out: no path holds one)."""
    parts = []
    for lo, hi in _merge(ranges):
        for a, b in ((lo, min(hi, _SURROGATES[0] - 1)), (max(lo, _SURROGATES[1] + 1), hi)):
            if a <= b:
                parts.append(_char(a) if a == b else f"{_char(a)}-{_char(b)}")
    if not parts:
        return "[^\\x{0}-\\x{10FFFF}]"  # matches nothing, as an empty Python set would
    return "[" + "".join(parts) + "]"


_CATEGORIES = {
    _c.CATEGORY_WORD: ("word", False),
    _c.CATEGORY_NOT_WORD: ("word", True),
    _c.CATEGORY_DIGIT: ("digit", False),
    _c.CATEGORY_NOT_DIGIT: ("digit", True),
    _c.CATEGORY_SPACE: ("space", False),
    _c.CATEGORY_NOT_SPACE: ("space", True),
}

_REFUSED = {
    _c.ASSERT: "a lookahead or lookbehind ((?=...), (?!...), (?<=...), (?<!...))",
    _c.ASSERT_NOT: "a lookahead or lookbehind ((?=...), (?!...), (?<=...), (?<!...))",
    _c.GROUPREF: "a backreference (\\1, (?P=name))",
    _c.GROUPREF_EXISTS: "a conditional group ((?(1)...|...))",
}
for _name, _what in (
    ("POSSESSIVE_REPEAT", "a possessive repeat (*+, ++, ?+, {m,n}+)"),
    ("ATOMIC_GROUP", "an atomic group ((?>...))"),
):
    if hasattr(_c, _name):
        _REFUSED[getattr(_c, _name)] = _what

_STARTS = {_c.AT_BEGINNING, _c.AT_BEGINNING_LINE, _c.AT_BEGINNING_STRING}
_ENDS = {_c.AT_END, _c.AT_END_LINE, _c.AT_END_STRING}


class _Writer:
    def __init__(self) -> None:
        self.out: list[str] = []
        self.size = 0

    def put(self, text: str) -> None:
        self.size += len(text)
        if self.size > MAX_TRANSLATED:
            raise RegexRefused(
                f"it spells out to more than {MAX_TRANSLATED} characters in RE2 (Unicode "
                "classes such as \\w are large): use fewer classes, or ASCII ones with (?a)"
            )
        self.out.append(text)

    def category(self, code: Any, ascii_only: bool) -> list[tuple[int, int]]:
        name, negated = _CATEGORIES[code]
        ranges = list(_ASCII_CLASSES[name] if ascii_only else _unicode_class(name))
        return _complement(ranges) if negated else ranges

    def items(self, items: Any, flags: int) -> None:
        for op, av in items:
            self.item(op, av, flags)

    def item(self, op: Any, av: Any, flags: int) -> None:
        ascii_only = bool(flags & _c.SRE_FLAG_ASCII)
        if op in _REFUSED:
            raise RegexRefused(f"it uses {_REFUSED[op]}, which RE2 cannot match")
        if op is _c.LITERAL:
            self.put(_char(av))
        elif op is _c.NOT_LITERAL:
            self.put(_class(_complement([(av, av)])))
        elif op is _c.ANY:
            self.put("(?s:.)" if flags & _c.SRE_FLAG_DOTALL else "[^\\n]")
        elif op is _c.IN:
            self.put(self.charset(av, ascii_only))
        elif op is _c.BRANCH:
            self.put("(?:")
            for i, branch in enumerate(av[1]):
                if i:
                    self.put("|")
                self.items(branch, flags)
            self.put(")")
        elif op is _c.SUBPATTERN:
            _group, add, remove, sub = av
            self.check_flags(add)
            inner = (flags | add) & ~remove
            self.put("(?:")
            self.items(sub, inner)
            self.put(")")
        elif op in (_c.MAX_REPEAT, _c.MIN_REPEAT):  # laziness does not change a full match
            lo, hi, sub = av
            self.put("(?:")
            self.items(sub, flags)
            self.put(")")
            if hi == _c.MAXREPEAT:
                self.put(f"{{{lo},}}")
            else:
                self.put(f"{{{lo},{hi}}}")
        elif op is _c.AT:
            if av in _STARTS:
                self.put("\\A")
            elif av in _ENDS:
                self.put("\\z")
            elif av in (_c.AT_BOUNDARY, _c.AT_NON_BOUNDARY) and ascii_only:
                self.put("\\b" if av is _c.AT_BOUNDARY else "\\B")
            else:
                raise RegexRefused(
                    "it uses \\b or \\B, a Unicode word boundary in Python, which RE2 matches "
                    "for ASCII only: add (?a) to mean ASCII, or spell the separator ([./_])"
                )
        else:
            raise RegexRefused(f"it uses {str(op).lower()}, which unimesh cannot match")

    def charset(self, items: Any, ascii_only: bool) -> str:
        negate = False
        ranges: list[tuple[int, int]] = []
        for op, av in items:
            if op is _c.NEGATE:
                negate = True
            elif op is _c.LITERAL:
                ranges.append((av, av))
            elif op is _c.RANGE:
                ranges.append((av[0], av[1]))
            elif op is _c.CATEGORY:
                ranges.extend(self.category(av, ascii_only))
            else:
                raise RegexRefused(
                    f"it uses {str(op).lower()} in a character class, which unimesh cannot match"
                )
        return _class(_complement(ranges) if negate else ranges)

    @staticmethod
    def check_flags(flags: int) -> None:
        if flags & _c.SRE_FLAG_IGNORECASE:
            raise RegexRefused(
                "it matches ignoring case ((?i)), whose Unicode case folding differs between "
                "Python and RE2: spell both cases, e.g. [Dd]ense"
            )


#: Python 3.11+ runs pure-Python recursion (Python's regex parser, the writer) on the heap,
#: so a deeply nested key may raise the recursion limit for its own parse; 3.10 may not
_HEAP_FRAMES = sys.version_info >= (3, 11)
_LIMIT_LOCK = threading.Lock()


def to_re2(pattern: str) -> str:
    """``pattern`` (Python's syntax) in RE2's syntax with Python's meaning for a one-line
    path, or :class:`RegexRefused` saying why it cannot be."""
    need = 4 * len(pattern) + 200
    if not _HEAP_FRAMES or need <= 800:
        return _translate(pattern)
    with _LIMIT_LOCK:  # the recursion limit is per interpreter: raised for this parse only
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, min(need + old, 10_000_000)))
        try:
            return _translate(pattern)
        finally:
            sys.setrecursionlimit(old)


def _translate(pattern: str) -> str:
    try:
        parsed = _p.parse(pattern, 0)
    except re.error as exc:
        raise RegexRefused(f"Python's re refuses it: {exc.msg} at position {exc.pos}") from None
    except (RecursionError, OverflowError, MemoryError):
        raise RegexRefused("it nests too deep or repeats too often to parse") from None
    flags = int(parsed.state.flags)
    _Writer.check_flags(flags)
    writer = _Writer()
    try:
        writer.items(parsed, flags)
    except RecursionError:
        raise RegexRefused("it nests too deep to translate") from None
    return "".join(writer.out)


def check_path(path: str) -> str | None:
    """Why ``path`` cannot be matched against regex keys (a line break), or None."""
    if "\n" in path:
        return "it holds a line break; variable paths are one line"
    return None
