"""Who reads which bytes: the intersection of a wanted block with the saved boxes, as runs of
contiguous bytes in the data files, in the row-major order of the intersection. Integer
arithmetic (numpy for the many runs of a strided region): no I/O, no framework."""

from __future__ import annotations

import math

import numpy as np

from .format import Box

__all__ = ["Piece", "pieces", "runs"]


class Piece:
    """The part of one saved box inside a wanted region: ``start``/``stop`` in global index,
    and the byte runs ``(file offset, length)`` that hold it, in its row-major order."""

    __slots__ = ("box", "runs", "start", "stop")

    def __init__(
        self, box: Box, start: tuple[int, ...], stop: tuple[int, ...], runs: list[tuple[int, int]]
    ) -> None:
        self.box = box
        self.start = start
        self.stop = stop
        self.runs = runs

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.runs)


def runs(
    box: Box, start: tuple[int, ...], stop: tuple[int, ...], itemsize: int
) -> list[tuple[int, int]]:
    """The byte runs of ``box`` (row-major in its file) that hold the region ``start:stop``
    (global index, inside the box), in the region's row-major order, adjacent runs merged."""
    ndim = len(box.size)
    if ndim == 0:
        return [(box.start, itemsize)]
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
        return [(first, length)]
    # one run per index of the dims before ``inner``; none are adjacent (``inner`` is partial)
    axes = np.ix_(*(np.arange(hi[d] - lo[d]) * strides[d] for d in range(inner)))
    return [(at, length) for at in np.asarray(first + sum(axes)).reshape(-1).tolist()]


def pieces(
    boxes: list[Box], start: tuple[int, ...], stop: tuple[int, ...], itemsize: int
) -> list[Piece]:
    """Every saved box's part of the region ``start:stop``, with its byte runs."""
    out = []
    for box in boxes:
        a = tuple(max(s, o) for s, o in zip(start, box.offset))
        b = tuple(min(e, o + n) for e, o, n in zip(stop, box.offset, box.size))
        if any(x >= y for x, y in zip(a, b)) or (box.size and math.prod(box.size) == 0):
            continue
        found = [(box.start, box.end - box.start)] if box.strides else runs(box, a, b, itemsize)
        out.append(Piece(box, a, b, found))
    return out
