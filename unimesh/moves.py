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

Plans are cached for a repeated (source, target, shape, itemsize, process map, process).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from .layout import Layout

__all__ = ["Piece", "Plan", "plan"]


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


class Plan:
    """One process's part of a reshard.

    - ``grid[d]``: this process's target devices' pieces, per target device, as a nested grid
      (``cuts``: per dim the segment bounds inside the block), so that a block is the pieces
      put together in order;
    - ``local``: pieces one of this process's devices already holds, one per target device
      (``source`` is that device itself where it holds the piece);
    - ``receive[q]``: pieces process ``q`` sends here, in the order both sides list them;
    - ``send[q]``: pieces this process sends to process ``q``, same order as ``q``'s receive;
    - ``kept``: target devices whose block is their source block already (nothing moves).
    """

    __slots__ = ("blocks", "itemsize", "kept", "local", "receive", "send")

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize
        #: target device -> (per-dim segment bounds inside its block, pieces in row-major order)
        self.blocks: dict[int, tuple[tuple[tuple[int, ...], ...], list[Piece]]] = {}
        self.local: list[Piece] = []
        self.receive: dict[int, list[Piece]] = {}
        self.send: dict[int, list[Piece]] = {}
        self.kept: tuple[int, ...] = ()

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


def _partition(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The cut points of one dim: every block's start and stop, sorted, once."""
    return np.unique(np.concatenate([starts, stops]))


def plan(
    source: Layout,
    target: Layout,
    shape: Sequence[int],
    itemsize: int,
    process_of: Sequence[int] | np.ndarray,
    me: int,
) -> Plan:
    """This process's plan to move an array of global ``shape`` from ``source`` to ``target``.

    ``process_of[device id]`` is the process of each device of either mesh; ``me`` is this
    process. Pure and cached: every process computes the same sends and receives for a pair.
    """
    return _plan(source, target, tuple(shape), itemsize, tuple(int(p) for p in process_of), me)


def _firsts(cuts: list[np.ndarray], bounds: np.ndarray) -> np.ndarray:
    """Each row's bounds as segment numbers, per dim."""
    cols = [np.searchsorted(cuts[d], bounds[:, d]) for d in range(bounds.shape[1])]
    return np.stack(cols, 1) if cols else np.zeros((bounds.shape[0], 0), np.int64)


@functools.lru_cache(maxsize=256)
def _plan(
    source: Layout,
    target: Layout,
    shape: tuple[int, ...],
    itemsize: int,
    process_of: tuple[int, ...],
    me: int,
) -> Plan:
    procs = process_of
    s_ids = source.mesh.device_ids.ravel().tolist()
    t_ids = target.mesh.device_ids.ravel().tolist()
    s_lo, s_hi = source.shard_bounds(shape)
    t_lo, t_hi = target.shard_bounds(shape)
    ndim = len(shape)
    # per dim, the segments: the cut points of both layouts together
    cuts = [
        np.unique(np.concatenate([s_lo[:, d], s_hi[:, d], t_lo[:, d], t_hi[:, d]]))
        for d in range(ndim)
    ]
    s_first, s_last = _firsts(cuts, s_lo), _firsts(cuts, s_hi)
    t_first, t_last = _firsts(cuts, t_lo), _firsts(cuts, t_hi)
    # each segment's source block along its dim, named by the block's first segment
    owner = []
    for d in range(ndim):
        o = np.full(max(len(cuts[d]) - 1, 0), -1, dtype=np.int64)
        for a, b in set(zip(s_first[:, d].tolist(), s_last[:, d].tolist())):
            o[a:b] = a
        owner.append(o.tolist())
    # the devices holding each (non-empty) source block, and their processes
    holders: dict[tuple[int, ...], list[int]] = {}
    own: dict[int, tuple[int, ...]] = {}
    s_box = {
        did: (tuple(a), tuple(b)) for did, a, b in zip(s_ids, s_first.tolist(), s_last.tolist())
    }
    for i, did in enumerate(s_ids):
        if not ndim or (s_first[i] < s_last[i]).all():
            key = tuple(s_first[i].tolist())
            holders.setdefault(key, []).append(did)
            own[did] = key
    hold_procs = {k: sorted({procs[d] for d in v}) for k, v in holders.items()}
    mine = {
        k: next(d for d in v if procs[d] == me) for k, v in holders.items() if me in hold_procs[k]
    }
    # target blocks, each with the devices of each process that need it
    needers: dict[tuple[tuple[int, ...], tuple[int, ...]], dict[int, list[int]]] = {}
    for i, did in enumerate(t_ids):
        key = (tuple(t_first[i].tolist()), tuple(t_last[i].tolist()))
        needers.setdefault(key, {}).setdefault(procs[did], []).append(did)

    out = Plan(itemsize)
    kept: list[int] = []
    received: dict[tuple[int, ...], Piece] = {}
    sent: dict[int, set[tuple[int, ...]]] = {}
    turns: dict[tuple[int, ...], int] = {}  # pieces each source block has sent so far
    for (first, last), by_proc in needers.items():
        offsets = list(np.ndindex(*(b - a for a, b in zip(first, last))))
        if any(a == b for a, b in zip(first, last)):
            offsets = []  # an empty block: nothing to move
        targets = by_proc.get(me, [])
        pieces: dict[int, list[Piece]] = {t: [] for t in targets}
        for offset in offsets:
            seg = tuple(a + o for a, o in zip(first, offset))
            key = tuple(owner[d][s] for d, s in enumerate(seg))
            start = tuple(int(cuts[d][s]) for d, s in enumerate(seg))
            stop = tuple(int(cuts[d][s + 1]) for d, s in enumerate(seg))
            hp = hold_procs[key]
            for q, devices in by_proc.items():
                if q in hp:
                    if q == me:  # held here: from the device itself, else from a device here
                        for t in devices:
                            src = t if own.get(t) == key else mine[key]
                            piece = Piece(start, stop, src, (t,))
                            pieces[t].append(piece)
                            out.local.append(piece)
                    continue
                turn = turns.get(key, 0)
                turns[key] = turn + 1
                sender = hp[turn % len(hp)]
                if q == me:
                    if seg not in received:
                        src = next(d for d in holders[key] if procs[d] == sender)
                        received[seg] = Piece(start, stop, src, ())
                        out.receive.setdefault(sender, []).append(received[seg])
                    piece = received[seg]
                    piece.devices += tuple(devices)
                    for t in devices:
                        pieces[t].append(piece)
                elif sender == me and seg not in sent.setdefault(q, set()):
                    sent[q].add(seg)
                    out.send.setdefault(q, []).append(Piece(start, stop, mine[key], tuple(devices)))
        bounds = tuple(tuple(int(c) for c in cuts[d][first[d] : last[d] + 1]) for d in range(ndim))
        for t in targets:
            if s_box.get(t) == (first, last):
                kept.append(t)  # its block is in place: nothing moves or is copied
            out.blocks[t] = (bounds, pieces[t])
    out.kept = tuple(kept)
    return out
