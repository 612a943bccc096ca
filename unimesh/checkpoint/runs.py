"""Who reads which bytes: the intersection of a wanted block with the saved boxes, as runs of
contiguous bytes in the data files, in the row-major order of the intersection. Integer
arithmetic (numpy for the many runs of a strided region): no I/O, no framework.

A load plans its reads with the live reshard's planner (:func:`planned`): the saved boxes are
the source side, held by the storage, and each piece of a target block is a part of one box.
:func:`pieces` intersects one region of any kind with the boxes (``Checkpoint.read``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from ..errors import LayoutError
from ..layout import Layout
from ..moves import Boxes, cells, plan
from .format import Box, Tensor

__all__ = ["BoxPart", "Part", "Runs", "overlaps", "part", "pieces", "planned", "runs"]


class Runs(Sequence[tuple[int, int]]):
    """Byte runs ``(file offset, length)`` held as one ``(k, 2)`` int64 table: a column block
    of a row-major box has a run per row, thousands of them, which readers take as arrays
    (a strided copy, a byte count) and iterate as pairs of ints only where they must."""

    __slots__ = ("table",)

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]]) -> Runs:
        """The runs of a list of ``(offset, length)`` pairs."""
        return cls(np.asarray(pairs, dtype=np.int64).reshape(-1, 2))

    @property
    def nbytes(self) -> int:
        return int(self.table[:, 1].sum())

    def __len__(self) -> int:
        return len(self.table)

    @overload
    def __getitem__(self, i: int) -> tuple[int, int]: ...
    @overload
    def __getitem__(self, i: slice) -> Runs: ...
    def __getitem__(self, i: int | slice) -> tuple[int, int] | Runs:
        if isinstance(i, slice):
            return Runs(self.table[i])
        offset, length = self.table[i].tolist()
        return offset, length

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(a, n) for a, n in self.table.tolist()])

    def __repr__(self) -> str:
        return f"Runs({list(self)!r})"


class Part:
    """The part of one saved box inside a wanted region (the planner's pieces of one box in one
    block, joined): ``start``/``stop`` in global index,
    and the byte runs ``(file offset, length)`` that hold it, in its row-major order."""

    __slots__ = ("box", "runs", "start", "stop")

    def __init__(self, box: Box, start: tuple[int, ...], stop: tuple[int, ...], runs: Runs) -> None:
        self.box = box
        self.start = start
        self.stop = stop
        self.runs = runs

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def nbytes(self) -> int:
        return self.runs.nbytes


def runs(box: Box, start: tuple[int, ...], stop: tuple[int, ...], itemsize: int) -> Runs:
    """The byte runs of ``box`` (row-major in its file) that hold the region ``start:stop``
    (global index, inside the box), in the region's row-major order, adjacent runs merged."""
    ndim = len(box.size)
    if ndim == 0:
        return Runs.of([(box.start, itemsize)])
    lo = [a - o for a, o in zip(start, box.offset)]
    hi = [b - o for b, o in zip(stop, box.offset)]
    # the trailing dims the region covers whole are one run with the dim before them
    inner = ndim - 1
    while inner > 0 and lo[inner] == 0 and hi[inner] == box.size[inner]:
        inner -= 1
    strides = [itemsize * math.prod(box.size[d + 1 :]) for d in range(ndim)]
    length = (hi[inner] - lo[inner]) * strides[inner]
    first = box.start + sum(a * s for a, s in zip(lo, strides))
    if inner == 0:
        return Runs.of([(first, length)])
    # one run per index of the dims before ``inner``; none are adjacent (``inner`` is partial)
    axes = np.ix_(*(np.arange(hi[d] - lo[d]) * strides[d] for d in range(inner)))
    starts = np.asarray(first + sum(axes), dtype=np.int64).reshape(-1)
    return Runs(np.stack([starts, np.full_like(starts, length)], axis=1))


def part(box: Box, a: tuple[int, ...], b: tuple[int, ...], itemsize: int) -> Part:
    """The part ``a:b`` of ``box`` with its byte runs (a strided box: its whole range)."""
    found = (
        Runs.of([(box.start, box.end - box.start)]) if box.strides else runs(box, a, b, itemsize)
    )
    return Part(box, a, b, found)


#: a part of a saved box inside a wanted region: the box, and the part's start and stop
BoxPart = tuple[Box, tuple[int, ...], tuple[int, ...]]


def overlaps(boxes: list[Box], start: tuple[int, ...], stop: tuple[int, ...]) -> list[BoxPart]:
    """Every saved box's part of the region ``start:stop`` (none for an empty box)."""
    out = []
    for box in boxes:
        a = tuple(max(s, o) for s, o in zip(start, box.offset))
        b = tuple(min(e, o + n) for e, o, n in zip(stop, box.offset, box.size))
        if any(x >= y for x, y in zip(a, b)) or (box.size and math.prod(box.size) == 0):
            continue
        out.append((box, a, b))
    return out


def planned(t: Tensor, target: Layout, devices: Sequence[int]) -> dict[int, list[BoxPart]] | None:
    """The reads of ``devices`` (this process's devices of ``target``), from the live reshard's
    planner: :func:`unimesh.moves.plan` with the saved boxes as the source side, held by the
    storage (a process of its own; boxes that do not form a grid cut into one grid's cells
    first). Per device, the saved boxes its block needs, each as its one part in the block
    (the plan's pieces of one box joined: a box is read once per block, whole where strided).
    None where the boxes would make too many cells: the caller intersects directly."""
    ndim = len(t.shape)
    boxes = t.boxes
    if math.prod(t.shape) == 0:
        return {d: [] for d in devices}
    lo = np.asarray([b.offset for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    hi = lo + np.asarray([b.size for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    try:
        c_lo, c_hi, parent = cells(lo, hi)
    except LayoutError:  # too many cells: the caller intersects directly
        return None
    base = int(target.mesh.device_ids.max()) + 1
    process_of = np.ones(base + len(c_lo), dtype=np.int64)  # other processes' devices: 1
    process_of[np.asarray(list(devices), dtype=np.int64)] = 0  # this process: 0
    process_of[base:] = 2  # the storage
    ids = np.arange(base, base + len(c_lo), dtype=np.int64)
    sources = Boxes(ids, c_lo, c_hi)
    the_plan = plan(sources, target, t.shape, t.itemsize, process_of, 0, cache=False)
    parts: dict[int, list[BoxPart]] = {}
    for device in devices:
        # the plan's pieces of each box, in the order they name the boxes, joined: together
        # they tile the box's part of the block
        joined: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for p in the_plan.blocks[device][1]:
            i = int(parent[p.source - base])
            first, after = joined.get(i, (p.start, p.stop))
            joined[i] = (
                tuple(map(min, first, p.start)),
                tuple(map(max, after, p.stop)),
            )
        parts[device] = [(boxes[i], a, b) for i, (a, b) in joined.items()]
    return parts


def pieces(
    boxes: list[Box], start: tuple[int, ...], stop: tuple[int, ...], itemsize: int
) -> list[Part]:
    """Every saved box's part of the region ``start:stop``, with its byte runs."""
    return [part(box, a, b, itemsize) for box, a, b in overlaps(boxes, start, stop)]
