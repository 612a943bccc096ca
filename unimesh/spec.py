"""Partition specs: for each tensor dim, the mesh axes that split it (``jax.sharding.
PartitionSpec``'s meaning), plus pending reductions."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn, Union

from ._validate import fail
from .errors import LayoutError
from .messages import short

__all__ = ["REDUCE_OPS", "Entry", "P", "PartitionSpec"]

#: Reduce ops a pending (partial) value may carry.
REDUCE_OPS = ("sum", "avg", "max", "min")

Entry = Union[None, str, tuple[str, ...]]  # noqa: UP007 - a runtime alias on Python 3.10


def layout_fail(message: str) -> NoReturn:
    fail(message, LayoutError)


def parse_entry(value: object, where: str) -> Entry:
    """Normalise one spec entry: None, an axis name, or a tuple of names (``()`` -> None,
    ``("x",)`` -> ``"x"``)."""
    if value is None or isinstance(value, str):
        if isinstance(value, str) and not value:
            layout_fail(f"{where}: an axis name cannot be empty; use None for a replicated dim")
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if not isinstance(v, str) or not v:
                layout_fail(
                    f"{where}: {short(value)} must hold axis names (non-empty str), "
                    f"found {short(v)}"
                )
        t = tuple(value)
        if not t:
            return None
        return t[0] if len(t) == 1 else t
    layout_fail(
        f"{where}: {short(value)} ({type(value).__name__}) is not a spec entry; use None, "
        "an axis name, or a tuple of axis names"
    )


class PartitionSpec:
    """How each tensor dim is split over mesh axes (JAX's ``PartitionSpec``).

    ``P("dp", None, ("tp", "cp"))``: dim 0 over ``dp``, dim 1 replicated, dim 2 over ``tp`` then
    ``cp`` (major to minor). ``partial={"tp": "sum"}`` marks a pending reduction over ``tp``
    (torch ``Partial``). Each axis may appear once in the whole spec. Trailing dims not covered
    by the spec are replicated.
    """

    __slots__ = ("_entries", "_partial")

    _entries: tuple[Entry, ...]
    _partial: tuple[tuple[str, str], ...]

    def __init__(self, *entries: object, partial: Mapping[str, str] | None = None) -> None:
        ents = tuple(parse_entry(e, f"spec entry {i}") for i, e in enumerate(entries))
        pend: list[tuple[str, str]] = []
        if partial is not None:
            if not isinstance(partial, Mapping):
                layout_fail(f"partial must be a mapping axis -> reduce op, got {short(partial)}")
            for ax, op in partial.items():
                if not isinstance(ax, str) or not ax:
                    layout_fail(f"partial axis {short(ax)} must be a non-empty axis name")
                if op not in REDUCE_OPS:
                    layout_fail(
                        f"reduce op {short(op)} for partial axis {ax!r} is not one of {REDUCE_OPS}"
                    )
                pend.append((ax, op))
        seen: set[str] = set()
        for ax in [a for e in ents for a in entry_axes(e)] + [a for a, _ in pend]:
            if ax in seen:
                layout_fail(
                    f"axis {ax!r} appears more than once in the spec {_spec_repr(ents, pend)}; "
                    "a mesh axis can split one tensor dim (or be partial) only once"
                )
            seen.add(ax)
        object.__setattr__(self, "_entries", ents)
        object.__setattr__(self, "_partial", tuple(pend))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PartitionSpec is immutable")

    @property
    def partial(self) -> dict[str, str]:
        """Axis -> reduce op of pending reductions."""
        return dict(self._partial)

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self._entries

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec shards over (not the partial ones), in order of appearance."""
        return tuple(a for e in self._entries for a in entry_axes(e))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __getitem__(self, i: int) -> Entry:
        return self._entries[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartitionSpec):
            return self._entries == other._entries and dict(self._partial) == dict(other._partial)
        if isinstance(other, tuple) and not self._partial:
            try:
                return self == PartitionSpec(*other)
            except LayoutError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._entries, frozenset(self._partial)))

    @classmethod
    def from_string(cls, text: str) -> PartitionSpec:
        """A spec from text, as config files and the command line write it: entries split by
        ``,``; an entry is an axis name, ``a+b`` for several axes on one dim, or ``None`` /
        ``_`` / nothing for a replicated dim (``"dp+fsdp,None"`` is ``P(("dp", "fsdp"),
        None)``). Names are checked later, against a mesh."""
        from ._text import parse_spec_text

        if not isinstance(text, str):
            layout_fail(f"a spec string must be a str like 'dp,None', got {short(text)}")
        return cls(*parse_spec_text(text))

    def __repr__(self) -> str:
        return _spec_repr(self._entries, self._partial)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_spec, (self._entries, dict(self._partial) or None))


def _rebuild_spec(entries: tuple[Entry, ...], partial: dict[str, str] | None) -> PartitionSpec:
    return PartitionSpec(*entries, partial=partial)


P = PartitionSpec


def entry_axes(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry


def _spec_repr(entries: Sequence[Entry], partial: Sequence[tuple[str, str]]) -> str:
    body = ", ".join(repr(e) for e in entries)
    if partial:
        body += (", " if body else "") + f"partial={dict(partial)!r}"
    return f"P({body})"
