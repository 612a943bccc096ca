"""Who moves which piece of an array from one layout to another: the plan of a live reshard.

Pure integer arithmetic over two :class:`~unimesh.Layout` s, a global shape and where each device
lives (its process); no framework, no I/O. Along each dim the source blocks and the target
blocks are partitions of ``[0, size)``; the cut points of both together split the dim into
segments, and a *piece* is one segment per dim. Every piece lies in exactly one source block and
in exactly one target block, so the pieces of a target block tile it, and each piece is whole
where it is held. A process receives each piece of its target blocks that none of its devices
holds, once however many of its devices need it, from one process that holds it: the holders
of a source block take turns (round robin over every piece that block sends, in the order all
processes list them), so the load spreads evenly over them.

Either side may also be :class:`Boxes`: boxes held by any ids, as a checkpoint's saved boxes
are held by its storage. The checkpoint loader plans its reads with this same :func:`plan` (the
storage a process of its own that holds every box, :func:`cells` making any tiling a grid), so
a load and a live reshard read and move the same pieces.

A :class:`Plan` carries everything the move needs, asked for once: the pieces, who sends which
to whom, the exchange's rounds under :data:`IN_FLIGHT` (:attr:`Plan.schedule`: per round and
peer the runs of rows moved, each at its element offset in the one buffer of that pair), and
whether anything crosses between processes at all (:attr:`Plan.crosses`). Plans are cached for
a repeated (source, target, shape, itemsize, process map, process, in-flight budget).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .errors import LayoutError
from .layout import Layout

__all__ = [
    "IN_FLIGHT",
    "Boxes",
    "Piece",
    "Plan",
    "Round",
    "Unit",
    "cells",
    "clear_cache",
    "crosses",
    "plan",
    "units",
]

#: bytes a process has in flight in one round of a reshard's exchange, over all its peers
#: (each pair gets an equal share; a piece larger than its share goes alone)
IN_FLIGHT = 64 << 20


class Piece:
    """A box of the global array (``start``/``stop``) on its way to this process's devices."""

    __slots__ = ("devices", "source", "start", "stop")

    def __init__(
        self,
        start: tuple[int, ...],
        stop: tuple[int, ...],
        source: int,
        devices: tuple[int, ...],
    ) -> None:
        self.start = start
        self.stop = stop
        #: a device id holding it: one of this process's for a local piece, else the sender's
        self.source = source
        #: this process's target devices it goes to
        self.devices = devices

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        box = ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop))
        return f"Piece([{box}] from device {self.source} to {list(self.devices)})"


class Boxes:
    """One side of a move given as boxes: id ``ids[i]`` holds the box ``lo[i]:hi[i]`` (global
    index). An id may appear once; one box may be held by many ids. Along each dim two boxes'
    intervals are equal or disjoint (a grid, as a layout's blocks always are: :func:`cells`
    makes one of any tiling). Hashable by content, so plans over it are cached."""

    __slots__ = ("_hash", "hi", "ids", "lo")

    def __init__(self, ids: Any, lo: Any, hi: Any) -> None:
        self.ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.lo = np.asarray(lo, dtype=np.int64)
        self.hi = np.asarray(hi, dtype=np.int64)
        n = len(self.ids)
        if self.lo.ndim != 2 or self.lo.shape[0] != n or self.hi.shape != self.lo.shape:
            raise LayoutError(
                f"Boxes takes one id per box and lo, hi of shape (boxes, dims): got {n} ids, "
                f"lo {self.lo.shape}, hi {self.hi.shape}"
            )
        if len(np.unique(self.ids)) != n or (self.hi < self.lo).any():
            raise LayoutError("Boxes takes each id once, and boxes with lo <= hi in every dim")
        for d in range(self.lo.shape[1]):  # along each dim, two intervals equal or disjoint
            pairs = np.unique(np.stack([self.lo[:, d], self.hi[:, d]], 1), axis=0)
            full = pairs[pairs[:, 1] > pairs[:, 0]]
            if len(full) > 1 and (full[1:, 0] < full[:-1, 1]).any():
                raise LayoutError(
                    f"Boxes' boxes are no grid: along dim {d} two of their intervals overlap "
                    "and differ; cut them into a grid's cells first (unimesh.moves.cells)"
                )
        self._hash = hash((self.lo.shape, self.ids.tobytes(), self.lo.tobytes(), self.hi.tobytes()))

    @classmethod
    def of(cls, layout: Layout, shape: Sequence[int]) -> Boxes:
        """Each device's block of ``layout`` for an array of ``shape``."""
        lo, hi = layout.shard_bounds(tuple(shape))
        return cls(layout.mesh.device_ids.ravel(), lo, hi)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Boxes)
            and self._hash == other._hash
            and np.array_equal(self.ids, other.ids)
            and np.array_equal(self.lo, other.lo)
            and np.array_equal(self.hi, other.hi)
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Boxes({len(self.ids)} boxes of {self.lo.shape[1]} dims)"


def cells(
    lo: np.ndarray, hi: np.ndarray, limit: int = 1 << 22
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boxes that tile an array (``lo``/``hi``: (boxes, ndim)) as a grid: each box cut at every
    other box's bounds along each dim. Returns the cells' ``lo``, ``hi`` and the box each lies
    in; boxes that already form a grid come back as they are (each its one cell), empty boxes
    are left out. ``LayoutError`` for boxes of another shape, or where that makes more than
    ``limit`` cells."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    if lo.ndim != 2 or hi.shape != lo.shape:
        raise LayoutError(
            f"cells() takes lo and hi of one shape (boxes, dims): got {lo.shape} and {hi.shape}"
        )
    ndim = lo.shape[1]
    keep = np.nonzero((hi > lo).all(axis=1))[0]
    lo, hi = lo[keep], hi[keep]
    cuts = [np.unique(np.concatenate([lo[:, d], hi[:, d]])) for d in range(ndim)]
    first = [np.searchsorted(cuts[d], lo[:, d]) for d in range(ndim)]
    count = [np.searchsorted(cuts[d], hi[:, d]) - first[d] for d in range(ndim)]
    per_box = np.prod(np.stack(count, 1), axis=1) if ndim else np.ones(len(lo), np.int64)
    if (per_box == 1).all():
        return lo, hi, keep
    total = int(per_box.sum())
    if total > limit:
        raise LayoutError(
            f"{len(lo)} boxes make {total} cells of one grid (at most {limit}): intersect a "
            "region with the boxes directly instead"
        )
    out_lo, out_hi, parent = [], [], []
    for i in range(len(lo)):
        grid = np.indices([int(c[i]) for c in count]).reshape(ndim, -1).T
        seg = grid + np.asarray([int(f[i]) for f in first])
        out_lo.append(np.stack([cuts[d][seg[:, d]] for d in range(ndim)], 1))
        out_hi.append(np.stack([cuts[d][seg[:, d] + 1] for d in range(ndim)], 1))
        parent.append(np.full(len(seg), keep[i], dtype=np.int64))
    return np.concatenate(out_lo), np.concatenate(out_hi), np.concatenate(parent)


class Unit(NamedTuple):
    """One run of rows of a piece in one round's buffer between two processes: ``piece`` the
    whole piece, ``run`` the rows moved (a :class:`Piece` itself), ``offset`` the element at
    which they start in the buffer (both sides list the pair's units alike)."""

    piece: Piece
    run: Piece
    offset: int


class Round(NamedTuple):
    """One round of the exchange: per peer process, the units sent to it and those received
    from it, in buffer order, and the element count of each buffer received."""

    sends: dict[int, list[Unit]]
    receives: dict[int, list[Unit]]
    counts: dict[int, int]


class Plan:
    """One process's part of a reshard, everything its move needs.

    - ``blocks[d]``: this process's target devices' pieces, per target device, with per dim
      the segment bounds inside the block, so that a block is the pieces put together in order;
    - ``local``: pieces one of this process's devices already holds, one per target device
      (``source`` is that device itself where it holds the piece);
    - ``receive[q]``: pieces process ``q`` sends here, in the order both sides list them;
    - ``send[q]``: pieces this process sends to process ``q``, same order as ``q``'s receive;
    - ``kept``: target devices whose block is their source block already (nothing moves);
    - :attr:`schedule`: the exchange, round by round (made on first use, then kept);
    - :attr:`crosses`: whether any process sends to another (every process's same answer).
    """

    __slots__ = (
        "_crosses",
        "_key",
        "_schedule",
        "blocks",
        "budget",
        "itemsize",
        "kept",
        "local",
        "receive",
        "send",
    )

    def __init__(self, itemsize: int, key: tuple[Any, ...] = (), budget: int = IN_FLIGHT) -> None:
        self.itemsize = itemsize
        #: target device -> (per-dim segment bounds inside its block, pieces in row-major order)
        self.blocks: dict[int, tuple[tuple[tuple[int, ...], ...], list[Piece]]] = {}
        self.local: list[Piece] = []
        self.receive: dict[int, list[Piece]] = {}
        self.send: dict[int, list[Piece]] = {}
        self.kept: tuple[int, ...] = ()
        #: bytes in flight per process per round (``IN_FLIGHT`` when the plan was made)
        self.budget = budget
        self._key = key  # (source, target, shape, process_of): for the whole move's answers
        self._schedule: tuple[Round, ...] | None = None
        self._crosses: bool | None = None

    @property
    def schedule(self) -> tuple[Round, ...]:
        """The exchange in rounds every process of the move counts alike (enough for the most
        bytes any process receives, ``budget`` shared by the pairs), each piece cut into runs
        of rows (:func:`units`) and each run at its offset in its pair's buffer of the round."""
        if self._schedule is None:
            source, target, shape, process_of = self._key
            processes, most = _demand(source, target, shape, self.itemsize, process_of)
            pair = max(self.budget // (2 * processes), 1)  # what a process sends and receives
            out = [Round({}, {}, {}) for _ in range(max(1, -(-most // pair)))]
            for lists, receiving in ((self.send, False), (self.receive, True)):
                for q, pieces in lists.items():
                    at = -1, 0  # (round, elements in the pair's buffer of that round)
                    for p, lo, hi, r, row in _units(pieces, self.itemsize, pair):
                        run = p if hi - lo == (p.stop[0] - p.start[0] if p.start else 1) else (
                            _rows(p, lo, hi))  # fmt: skip
                        offset = at[1] if at[0] == r else 0
                        step = out[r]
                        (step.receives if receiving else step.sends).setdefault(q, []).append(
                            Unit(p, run, offset)
                        )
                        at = r, offset + (hi - lo) * row
                        if receiving:
                            step.counts[q] = at[1]
            self._schedule = tuple(out)
        return self._schedule

    @property
    def crosses(self) -> bool:
        """Whether the move sends any element from one process to another, on any process
        (this plan is one process's part; a lazy framework settles before such a move)."""
        if self._crosses is None:
            self._crosses = _crosses(*self._key)
        return self._crosses

    @property
    def bytes_received(self) -> int:
        """Payload this process receives from other processes."""
        return sum(p.size for ps in self.receive.values() for p in ps) * self.itemsize

    @property
    def bytes_sent(self) -> int:
        """Payload this process sends to other processes."""
        return sum(p.size for ps in self.send.values() for p in ps) * self.itemsize

    @property
    def bytes_copied(self) -> int:
        """Payload moved between this process's own devices: a held piece to each other device
        of this process that needs it, and a received piece to each device after the first."""
        held = sum(p.size for p in self.local if p.devices != (p.source,))
        fanned = sum(p.size * (len(p.devices) - 1) for ps in self.receive.values() for p in ps)
        return (held + fanned) * self.itemsize

    def stats(self) -> dict[str, int]:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes_copied": self.bytes_copied,
        }


def _rows(piece: Piece, lo: int, hi: int) -> Piece:
    """Rows ``lo:hi`` of ``piece`` (along its first dim; a 0-d piece whole)."""
    if not piece.start or (lo == 0 and hi == piece.shape[0]):
        return piece
    start = (piece.start[0] + lo, *piece.start[1:])
    stop = (piece.start[0] + hi, *piece.stop[1:])
    return Piece(start, stop, piece.source, piece.devices)


def plan(
    source: Layout | Boxes,
    target: Layout | Boxes,
    shape: Sequence[int],
    itemsize: int,
    process_of: Sequence[int] | np.ndarray,
    me: int,
    *,
    cache: bool = True,
) -> Plan:
    """This process's plan to move an array of global ``shape`` from ``source`` to ``target``.

    ``process_of[id]`` is the process of each device (or id of a :class:`Boxes`) of either
    side; ``me`` is this process. Pure, and cached unless ``cache`` is False (a checkpoint
    load's plans, used once): every process computes the same sends and receives for a pair.
    The plan's :attr:`~Plan.schedule` shares :data:`IN_FLIGHT` as it is at this call.
    """
    key = (source, target, tuple(shape), itemsize, tuple(int(p) for p in process_of), me)
    return _plan(*key, IN_FLIGHT) if cache else _plan.__wrapped__(*key, IN_FLIGHT)


@functools.lru_cache(maxsize=1024)
def _demand(
    source: Layout | Boxes,
    target: Layout | Boxes,
    shape: tuple[int, ...],
    itemsize: int,
    process_of: tuple[int, ...],
) -> tuple[int, int]:
    """(processes taking part, the most target-block bytes one of them holds)."""
    where = np.asarray(process_of, dtype=np.int64)
    s_ids = _bounds(source, shape)[0]
    t_ids, t_lo, t_hi = _bounds(target, shape)
    ids = np.unique(np.concatenate([s_ids, t_ids]))
    sizes = np.prod(np.maximum(t_hi - t_lo, 0), axis=1)
    per_process = np.bincount(where[t_ids], weights=sizes * itemsize)
    return len(np.unique(where[ids])), int(per_process.max()) if per_process.size else 0


def _bounds(side: Layout | Boxes, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """A side's ids and their boxes' ``lo``, ``hi`` (a layout's without checking them as a
    :class:`Boxes` would: they are a grid)."""
    if isinstance(side, Boxes):
        return side.ids, side.lo, side.hi
    lo, hi = side.shard_bounds(shape)
    return side.mesh.device_ids.ravel(), lo, hi


def crosses(
    source: Layout | Boxes,
    target: Layout | Boxes,
    shape: Sequence[int],
    process_of: Sequence[int] | np.ndarray,
) -> bool:
    """Whether a move from ``source`` to ``target`` sends any element from one process to
    another: the same answer on every process (a :class:`Plan` is one process's part)."""
    key = (source, target, tuple(shape), tuple(int(p) for p in process_of))
    return _crosses(*key)


@functools.lru_cache(maxsize=1024)
def _crosses(
    source: Layout | Boxes,
    target: Layout | Boxes,
    shape: tuple[int, ...],
    process_of: tuple[int, ...],
) -> bool:
    where = np.asarray(process_of, dtype=np.int64)
    s_ids, s_lo, s_hi = _bounds(source, shape)
    t_ids, t_lo, t_hi = _bounds(target, shape)
    row = {int(d): i for i, d in enumerate(s_ids.tolist())}
    # each non-empty target block inside its own device's source block: nothing moves
    inside = True
    for i, d in enumerate(t_ids.tolist()):
        if (t_hi[i] <= t_lo[i]).any():
            continue
        j = row.get(int(d))
        if j is None or (t_lo[i] < s_lo[j]).any() or (t_hi[i] > s_hi[j]).any():
            inside = False
            break
    if inside:
        return False
    ids = np.unique(np.concatenate([s_ids, t_ids]))
    processes = np.unique(where[ids])
    if len(processes) == len(ids):  # one device per process: that block must receive
        return True
    return any(
        _plan(source, target, shape, 1, process_of, int(p), IN_FLIGHT).receive for p in processes
    )


def units(pieces: Sequence[Piece], itemsize: int, budget: int) -> list[tuple[int, int, int, int]]:
    """The pieces of one pair of processes as the units the exchange moves, in order:
    ``(piece index, first row, end row, round)``, a piece cut along its first dim into runs of
    rows of at most ``budget`` bytes (a row is never cut), each unit in the round where its
    first byte falls in the pair's stream. The sender's and the receiver's piece lists are
    the same, so both sides cut and count alike."""
    index = {id(p): i for i, p in enumerate(pieces)}
    return [(index[id(p)], lo, hi, r) for p, lo, hi, r, _ in _units(pieces, itemsize, budget)]


def _units(
    pieces: Sequence[Piece], itemsize: int, budget: int
) -> Iterator[tuple[Piece, int, int, int, int]]:
    """:func:`units`, each with its piece and the elements in one of its rows."""
    offset = 0
    for p in pieces:
        start, stop = p.start, p.stop
        rows = stop[0] - start[0] if start else 1
        row = math.prod([b - a for a, b in zip(start[1:], stop[1:])])
        row_bytes = row * itemsize
        step = max(1, budget // max(row_bytes, 1))
        for lo in range(0, max(rows, 1), step):
            hi = min(lo + step, rows)
            yield p, lo, hi, offset // budget, row
            offset += (hi - lo) * row_bytes


class _Side:
    """One layout's blocks in segment terms: along each dim its distinct intervals (first
    segment, length), each device's interval per dim, and each device's block number (the
    intervals' row-major index; -1 for an empty block)."""

    def __init__(self, blocks: Boxes, shape: tuple[int, ...], cuts: list[np.ndarray]) -> None:
        lo, hi = blocks.lo, blocks.hi
        self.ids = blocks.ids
        self.lo, self.hi = lo, hi
        ndim = len(shape)
        first = [np.searchsorted(cuts[d], lo[:, d]) for d in range(ndim)]
        last = [np.searchsorted(cuts[d], hi[:, d]) for d in range(ndim)]
        full = np.ones(len(self.ids), bool)
        for d in range(ndim):
            full &= first[d] < last[d]
        self.first: list[np.ndarray] = []  # per dim: each interval's first segment
        self.length: list[np.ndarray] = []  # per dim: each interval's segment count
        self.owner: list[np.ndarray] = []  # per dim: each segment's interval
        index = []
        for d in range(ndim):
            f, at = np.unique(first[d][full], return_index=True)
            n = (last[d][full] - first[d][full])[at]
            self.first.append(f)
            self.length.append(n)
            owner = np.full(len(cuts[d]) - 1, -1, dtype=np.int64)
            owner[np.concatenate([np.arange(a, a + b) for a, b in zip(f, n)]) if len(f) else []] = (
                np.repeat(np.arange(len(f)), n)
            )
            self.owner.append(owner)
            index.append(np.searchsorted(f, first[d]))
        self.counts = tuple(len(f) for f in self.first)
        self.block = np.full(len(self.ids), -1, dtype=np.int64)
        if full.any():
            self.block[full] = (
                np.ravel_multi_index([i[full] for i in index], self.counts) if ndim else 0
            )
        self.seg_first = first
        self.seg_last = last

    def segments(self, block: int) -> np.ndarray:
        """The segments of a block, (pieces, ndim), row-major."""
        at = np.unravel_index(block, self.counts) if self.counts else ()
        firsts = [int(self.first[d][a]) for d, a in enumerate(at)]
        lengths = [int(self.length[d][a]) for d, a in enumerate(at)]
        if not lengths:  # a 0-d array: one piece, no segments
            return np.zeros((1, 0), dtype=np.int64)
        grid = np.indices(lengths, dtype=np.int64).reshape(len(lengths), -1).T
        return grid + np.asarray(firsts, dtype=np.int64)

    def locate(self, segs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For pieces ``segs``: their block, and their row-major position in it."""
        ndim = segs.shape[1]
        if ndim == 0:
            return np.zeros(len(segs), np.int64), np.zeros(len(segs), np.int64)
        own = [self.owner[d][segs[:, d]] for d in range(ndim)]
        block = np.ravel_multi_index(own, self.counts)
        pos = np.zeros(len(segs), np.int64)
        for d in range(ndim):
            pos = pos * self.length[d][own[d]] + (segs[:, d] - self.first[d][own[d]])
        return block, pos


def _csr(
    keys: np.ndarray, procs: np.ndarray, devices: np.ndarray, n: int
) -> tuple[np.ndarray, ...]:
    """(key, process) pairs, sorted and once, with a device of each; and per key its slice."""
    if not len(keys):
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(n, np.int64), np.zeros(n, np.int64)
    width = int(procs.max()) + 1
    pair = keys * width + procs
    order = np.argsort(pair, kind="stable")
    unique, at = np.unique(pair[order], return_index=True)
    proc, device = unique % width, devices[order][at]
    key = unique // width
    start = np.searchsorted(key, np.arange(n))
    end = np.searchsorted(key, np.arange(n), side="right")
    return proc, device, start, end


def clear_cache() -> None:
    """Forget the plans made so far (they are cached per layouts, shape and process map)."""
    _plan.cache_clear()
    _crosses.cache_clear()
    _demand.cache_clear()


@functools.lru_cache(maxsize=256)
def _plan(
    source: Layout | Boxes,
    target: Layout | Boxes,
    shape: tuple[int, ...],
    itemsize: int,
    process_of: tuple[int, ...],
    me: int,
    budget: int,
) -> Plan:
    procs = np.asarray(process_of, dtype=np.int64)
    ndim = len(shape)
    sources = source if isinstance(source, Boxes) else Boxes.of(source, shape)
    targets = target if isinstance(target, Boxes) else Boxes.of(target, shape)
    s_lo, s_hi, t_lo, t_hi = sources.lo, sources.hi, targets.lo, targets.hi
    cuts = [
        np.unique(np.concatenate([s_lo[:, d], s_hi[:, d], t_lo[:, d], t_hi[:, d]]))
        for d in range(ndim)
    ]
    src, dst = _Side(sources, shape, cuts), _Side(targets, shape, cuts)
    s_blocks = math.prod(src.counts)
    t_blocks = math.prod(dst.counts)
    s_full = src.block >= 0
    h_proc, h_dev, h_start, h_end = _csr(
        src.block[s_full], procs[src.ids[s_full]], src.ids[s_full], s_blocks
    )
    t_full = dst.block >= 0
    n_proc, _, n_start, n_end = _csr(
        dst.block[t_full], procs[dst.ids[t_full]], dst.ids[t_full], t_blocks
    )
    # this process's source blocks, and a device of its holding each
    mine_src: dict[int, int] = {}
    own_block: dict[int, int] = {}
    for did, b in zip(src.ids.tolist(), src.block.tolist()):
        if procs[did] == me and b >= 0:
            mine_src.setdefault(b, did)
            own_block[did] = b
    s_row = {did: i for i, did in enumerate(src.ids.tolist())}
    out = Plan(itemsize, (source, target, shape, process_of), budget)
    kept: list[int] = []

    def box(segs: np.ndarray) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        starts = np.stack([cuts[d][segs[:, d]] for d in range(ndim)], 1) if ndim else segs
        stops = np.stack([cuts[d][segs[:, d] + 1] for d in range(ndim)], 1) if ndim else segs
        return [tuple(r) for r in starts.tolist()], [tuple(r) for r in stops.tolist()]

    # -- receiving: this process's target blocks, ascending ----------------------------------
    my_targets: dict[int, list[int]] = {}
    for i, did in enumerate(dst.ids.tolist()):
        if procs[did] != me:
            continue
        bounds = tuple(
            tuple(int(c) for c in cuts[d][dst.seg_first[d][i] : dst.seg_last[d][i] + 1])
            for d in range(ndim)
        )
        row = s_row.get(did)
        if row is not None and (s_lo[row] == t_lo[i]).all() and (s_hi[row] == t_hi[i]).all():
            kept.append(did)
        out.blocks[did] = (bounds, [])
        if dst.block[i] >= 0:
            my_targets.setdefault(int(dst.block[i]), []).append(did)
    for tb in sorted(my_targets):
        devices = tuple(my_targets[tb])
        segs = dst.segments(tb)
        sb, pos = src.locate(segs)
        starts, stops = box(segs)
        needers = n_proc[n_start[tb] : n_end[tb]]
        rank = int(np.searchsorted(needers, me))
        for k in range(len(segs)):
            b = int(sb[k])
            if b in mine_src:
                for t in devices:
                    piece = Piece(
                        starts[k], stops[k], t if own_block.get(t) == b else mine_src[b], (t,)
                    )
                    out.local.append(piece)
                    out.blocks[t][1].append(piece)
                continue
            held = int(h_end[b] - h_start[b])
            at = int(h_start[b]) + (int(pos[k]) + rank) % held
            sender = int(h_proc[at])
            piece = Piece(starts[k], stops[k], int(h_dev[at]), devices)
            out.receive.setdefault(sender, []).append(piece)
            for t in devices:
                out.blocks[t][1].append(piece)

    # -- sending: pieces of this process's source blocks to the processes whose turn it is --
    rows: list[tuple[int, int, int, int, tuple[int, ...], tuple[int, ...]]] = []
    for sb_ in sorted(mine_src):
        segs = src.segments(sb_)
        tbs, tpos = dst.locate(segs)
        count = n_end[tbs] - n_start[tbs]
        if not count.sum():
            continue
        which = np.repeat(np.arange(len(segs)), count)
        offset = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        q = n_proc[n_start[tbs][which] + offset]
        holders = h_proc[h_start[sb_] : h_end[sb_]]
        turn = h_proc[h_start[sb_] + (which + offset) % len(holders)]
        keep = (turn == me) & ~np.isin(q, holders)
        if not keep.any():
            continue
        first, after = box(segs)
        for k, qq in zip(which[keep].tolist(), q[keep].tolist()):
            rows.append((qq, int(tbs[k]), int(tpos[k]), mine_src[sb_], first[k], after[k]))
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    for qq, _tb, _pos, did, lo, hi in rows:
        out.send.setdefault(qq, []).append(Piece(lo, hi, did, ()))
    out.kept = tuple(kept)
    return out
