"""Who reads which bytes: the intersection of a wanted block with the saved boxes, as runs of
contiguous bytes in the data files, in the row-major order of the intersection. Integer
arithmetic (numpy for the many runs of a strided region): no I/O, no framework.

A load plans its reads with the live reshard's planner (:func:`planned`): the saved boxes are
the source side, held by the storage, and each piece of a target block is a part of one box.
:func:`pieces` intersects one region of any kind with the boxes (``Checkpoint.read``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import CheckpointError
from ..layout import Layout
from ..moves import Blocks, cells, plan
from .format import Box, Tensor

__all__ = ["Piece", "pieces", "planned", "runs"]


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
        out.append(_part(box, a, b, itemsize))
    return out


def _part(box: Box, a: tuple[int, ...], b: tuple[int, ...], itemsize: int) -> Piece:
    found = [(box.start, box.end - box.start)] if box.strides else runs(box, a, b, itemsize)
    return Piece(box, a, b, found)


def planned(t: Tensor, target: Layout, devices: Sequence[int]) -> dict[int, list[Piece]]:
    """The reads of ``devices`` (this process's devices of ``target``): per device, the pieces
    of its target block in row-major grid order, each a part of one saved box, from
    :func:`unimesh.moves.plan` with the saved boxes as the source side and the storage as the
    process holding them all (boxes that do not form a grid are cut into its cells first)."""
    ndim = len(t.shape)
    boxes = t.boxes
    lo = np.asarray([b.offset for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    hi = lo + np.asarray([b.size for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    try:
        c_lo, c_hi, parent = cells(lo, hi)
    except ValueError as exc:
        raise CheckpointError(
            f"tensor {t.name!r}: its saved boxes do not form a grid and {exc}: load it with "
            "Checkpoint.read, region by region"
        ) from None
    base = int(target.mesh.device_ids.max()) + 1
    process_of = np.ones(base + len(c_lo), dtype=np.int64)  # other processes' devices: 1
    process_of[np.asarray(list(devices), dtype=np.int64)] = 0  # this process: 0
    process_of[base:] = 2  # the storage
    ids = np.arange(base, base + len(c_lo), dtype=np.int64)
    the_plan = plan(Blocks(ids, c_lo, c_hi), target, t.shape, t.itemsize, process_of, 0)
    parts = {}
    for device in devices:
        parts[device] = [
            _part(boxes[int(parent[p.source - base])], p.start, p.stop, t.itemsize)
            for p in the_plan.blocks[device][1]
        ]
    return parts
