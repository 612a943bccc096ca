"""What a tensor is made of when its name or shape differs from what was sent or saved: a
rename, :class:`Concat` (q, k and v into one fused qkv) or :class:`Slice` (one part of a fused
tensor). :func:`segments` turns a target's source into the runs of the target it fills, each
the box of one sent tensor shifted along one dim, so that a move plans each run as its own
piece of the target and nothing is assembled whole. Pure arithmetic; no framework."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ._validate import check_int
from .errors import UnimeshError
from .messages import short

__all__ = ["Concat", "Segment", "Slice", "check_sources", "segments"]


class Concat:
    """A target made of sent tensors ``names`` joined along ``dim``, in order (a fused qkv
    from q, k, v; a gate_up from gate and up). Their other dims must agree."""

    __slots__ = ("dim", "names")

    def __init__(self, names: Sequence[str], dim: int = 0) -> None:
        if isinstance(names, str) or not isinstance(names, Sequence) or not names:
            raise UnimeshError(
                f"Concat(names, dim) takes a non-empty list of sent names, got {short(names)}"
            )
        for n in names:
            if not isinstance(n, str) or not n:
                raise UnimeshError(f"Concat names must be non-empty strings, got {short(n)}")
        self.names = tuple(names)
        self.dim = check_int(dim, "Concat dim", minimum=0, maximum=63, cls=UnimeshError)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Concat) and (self.names, self.dim) == (other.names, other.dim)

    def __hash__(self) -> int:
        return hash(("Concat", self.names, self.dim))

    def __repr__(self) -> str:
        return f"Concat({list(self.names)!r}, dim={self.dim})"


class Slice:
    """A target that is ``name[start:stop]`` along ``dim`` of a sent tensor (q out of a fused
    qkv)."""

    __slots__ = ("dim", "name", "start", "stop")

    def __init__(self, name: str, dim: int, start: int, stop: int) -> None:
        if not isinstance(name, str) or not name:
            raise UnimeshError(f"Slice takes the sent tensor's name first, got {short(name)}")
        self.name = name
        self.dim = check_int(dim, "Slice dim", minimum=0, maximum=63, cls=UnimeshError)
        self.start = check_int(start, "Slice start", minimum=0, maximum=2**62, cls=UnimeshError)
        self.stop = check_int(stop, "Slice stop", minimum=0, maximum=2**62, cls=UnimeshError)
        if self.stop < self.start:
            raise UnimeshError(
                f"Slice({name!r}, {dim}, {start}, {stop}): stop must be >= start; give the "
                "first and one past the last index of the part"
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Slice) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[str, str, int, int, int]:
        return ("Slice", self.name, self.dim, self.start, self.stop)

    def __repr__(self) -> str:
        return f"Slice({self.name!r}, dim={self.dim}, start={self.start}, stop={self.stop})"


Source = str | Concat | Slice


class Segment(NamedTuple):
    """One run of a target: sent tensor ``name`` fills the target where, along ``dim``, the
    target's index is ``at`` .. ``at + (stop - start)`` and the sent one's ``start`` ..
    ``stop``; the other dims match. ``dim`` None: the whole tensor, as it is."""

    name: str
    dim: int | None
    start: int
    stop: int
    at: int


def check_sources(sources: object) -> dict[str, Source]:
    """``sources`` as a dict target name -> sent name, :class:`Concat` or :class:`Slice`."""
    if sources is None:
        return {}
    if not isinstance(sources, Mapping):
        raise UnimeshError(
            f"sources must map target names to a sent name, unimesh.Concat or unimesh.Slice, "
            f"got {short(sources)}"
        )
    out: dict[str, Source] = {}
    for key, value in sources.items():
        if not isinstance(key, str):
            raise UnimeshError(f"sources keys are target names (str), got {short(key)}")
        if not isinstance(value, (str, Concat, Slice)) or value == "":
            raise UnimeshError(
                f"sources[{key!r}] is {short(value)}: give a sent name, "
                "unimesh.Concat(names, dim) or unimesh.Slice(name, dim, start, stop)"
            )
        out[key] = value
    return out


def segments(
    target: str, source: Source, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[tuple[int, ...], list[Segment]]:
    """The shape a target's ``source`` gives it, and its runs, from the sent ``shapes``.
    A name nothing sent, dims that do not line up or a slice past the end is an
    :class:`~unimesh.UnimeshError` naming the target and the sizes."""

    def shape_of(name: str) -> tuple[int, ...]:
        if name not in shapes:
            close = sorted(shapes, key=lambda n: (n.split(".")[-1] != name.split(".")[-1], n))
            raise UnimeshError(
                f"target {target!r}: nothing sent provides {name!r} (sent: "
                f"{short(close, 200)}); map it with sources={{...}} to a sent name, Concat or "
                "Slice"
            )
        return shapes[name]

    if isinstance(source, str):
        return shape_of(source), [Segment(source, None, 0, 0, 0)]
    if isinstance(source, Slice):
        got = shape_of(source.name)
        if source.dim >= len(got) or source.stop > got[source.dim]:
            raise UnimeshError(
                f"target {target!r}: {source!r} reaches past {source.name!r}, of shape {got}; "
                "give a dim and a range inside it"
            )
        shape = (*got[: source.dim], source.stop - source.start, *got[source.dim + 1 :])
        return shape, [Segment(source.name, source.dim, source.start, source.stop, 0)]
    parts = [shape_of(n) for n in source.names]
    dim = source.dim
    first = parts[0]
    for got in parts:
        if (
            dim >= len(got)
            or len(got) != len(first)
            or any(a != b for d, (a, b) in enumerate(zip(got, first)) if d != dim)
        ):
            raise UnimeshError(
                f"target {target!r}: {source!r} joins tensors of shapes "
                f"{dict(zip(source.names, parts))}, which differ outside dim {dim} (or have "
                f"no dim {dim}); join along the dim where only they differ"
            )
    runs, at = [], 0
    for name, got in zip(source.names, parts):
        runs.append(Segment(name, dim, 0, got[dim], at))
        at += got[dim]
    return (*first[:dim], at, *first[dim + 1 :]), runs
