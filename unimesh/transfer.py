"""A reshard plan carried out on one backend's transport: this process's source blocks in,
its target blocks out.

:mod:`unimesh.moves` says which piece goes where (pure arithmetic); this module asks the
backend's transport (:class:`unimesh.transport.Transport`: ``processes``, ``exchange``,
``take``, ``empty``) to move them and joins them with its :class:`~unimesh.arrays.Arrays`,
inside the framework's autodiff where it records one (``Backend.move_with_gradient``).
:func:`unimesh.reshard` (``reshard.py``) is the public verb above it: trees, targets, checks,
and handoffs between frameworks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .backend import Backend
from .errors import LayoutError, UnsupportedError
from .layout import Layout
from .moves import Piece, plan
from .transport import Transport

__all__ = [
    "add_stats",
    "addends",
    "device_ids",
    "itemsize",
    "move_blocks",
    "process_map",
    "refuse_gradient_of_extreme",
]


def device_ids(*layouts: Layout) -> list[int]:
    return sorted({d for lay in layouts for d in lay.mesh.device_ids.ravel().tolist()})


def move_blocks(
    be: Backend,
    blocks: Mapping[int, Any],
    like: Any,
    shape: tuple[int, ...],
    source: Layout,
    target: Layout,
    stats: dict[str, int] | None,
) -> dict[int, Any]:
    """This process's target blocks, on ``be``'s engine, from its source ``blocks`` (native
    blocks of ``be``, of ``like``'s dtype), in the framework's autodiff where it records
    (``Backend.move_with_gradient``): the gradient of the move is the reverse move, the
    cotangent blocks resharded from ``target`` to ``source`` (a pending sum's addends each
    get the whole cotangent, as the derivative of a sum says; an avg's, a share)."""

    kind = (like.dtype, itemsize(like))  # not ``like``: autodiff keeps these closures

    def forward(given: Mapping[int, Any]) -> dict[int, Any]:
        return _plain(be, given, kind, shape, source, target, stats)

    def backward(cotangents: Mapping[int, Any]) -> dict[int, Any]:
        from .spec import PartitionSpec

        ops = set(source.spec.partial.values())
        refuse_gradient_of_extreme(be.name, source)
        plain = Layout(source.mesh, PartitionSpec(*source.spec))
        be.check_reshard(None, target, plain, shape)  # checked as any move, before it moves
        got = _plain(be, cotangents, kind, shape, target, plain, None)
        if ops == {"avg"}:
            n = math.prod(source.mesh.axis_size(a) for a in source.spec.partial)
            got = {d: b / n for d, b in got.items()}
        return got

    return be.move_with_gradient(blocks, forward, backward, like)


def _plain(
    be: Backend,
    blocks: Mapping[int, Any],
    kind: tuple[Any, int],
    shape: tuple[int, ...],
    source: Layout,
    target: Layout,
    stats: dict[str, int] | None,
) -> dict[int, Any]:
    """:func:`move_blocks` outside autodiff; ``kind``: the framework's dtype and its item size."""
    process_of = process_map(be, source, target)
    me, _ = be.initialize(300.0)  # this process's index (the runtime is already up)
    if not source.spec.partial:
        return _blocks(be, blocks, source, target, shape, kind, process_of, me, stats)
    # a pending reduction: each coordinate along the partial axes holds one addend of every
    # block; each is moved as its own layout, then reduced on the target devices
    (op,) = set(source.spec.partial.values())
    parts = [
        _blocks(be, {d: b for d, b in blocks.items() if d in addend.mesh.device_ids},
                addend, target, shape, kind, process_of, me, stats)
        for addend in addends(source)
    ]  # fmt: skip
    out = {}
    for t in parts[0]:
        total = parts[0][t]
        for more in parts[1:]:
            total = _reduce(be, op, total, more[t])
        out[t] = total / len(parts) if op == "avg" else total
    return out


def _reduce(be: Backend, op: str, a: Any, b: Any) -> Any:
    """Two native blocks reduced elementwise, in the core: a sum (``sum``, ``avg``) with the
    framework's ``+``; ``max``, ``min`` over the two stacked, with its ``Arrays.reduce``."""
    if op in ("sum", "avg"):
        return a + b
    arrays = be.arrays()
    return arrays.reduce(arrays.concatenate([a[None], b[None]], 0), op)


def refuse_gradient_of_extreme(backend: str, source: Layout) -> None:
    """Refuse a pending max or min under autodiff: its gradient is not a move. The one
    refusal, called where a framework finds the array under its autodiff (its
    ``check_reshard``, before any byte moves) and by the reverse move itself."""
    ops = sorted(set(source.spec.partial.values()) & {"max", "min"})
    if ops:
        raise UnsupportedError(
            f"reshard() of {source!r} under autodiff: the gradient of a pending {ops[0]} is "
            "not a move; reduce it outside the differentiated function (or outside the "
            "framework's gradient recording)",
            backend=backend,
            capability="grad",
        )


def addends(source: Layout) -> list[Layout]:
    """A partial layout as one plain layout per coordinate along its partial axes, each over
    the devices at that coordinate (a plain layout: itself)."""
    if not source.spec.partial:
        return [source]
    from .mesh import Mesh
    from .spec import PartitionSpec

    mesh = source.mesh
    axes = list(source.spec.partial)
    keep = [a for a in mesh.axis_names if a not in axes]
    spec = PartitionSpec(*source.spec)
    out = []
    for at in np.ndindex(*(mesh.axis_size(a) for a in axes)):
        index = tuple(at[axes.index(a)] if a in axes else slice(None) for a in mesh.axis_names)
        ids = np.asarray(mesh.device_ids)[index]
        if keep:
            sub = Mesh(tuple(mesh.axis_size(a) for a in keep), tuple(keep), device_ids=ids)
        else:
            sub = Mesh((1,), ("_addend",), device_ids=[int(ids)])
        out.append(Layout(sub, spec))
    return out


def _blocks(
    be: Backend,
    blocks: Mapping[int, Any],
    source: Layout,
    target: Layout,
    shape: tuple[int, ...],
    kind: tuple[Any, int],
    process_of: np.ndarray,
    me: int,
    stats: dict[str, int] | None,
) -> dict[int, Any]:
    """This process's target blocks, from its ``blocks`` laid out as ``source`` (``kind``:
    their dtype and item size): the plan's pieces cut, packed, exchanged round by round as
    its schedule says, unpacked and joined."""
    dtype, itemsize = kind
    wire = be.transport()
    join = wire.arrays.concatenate
    the_plan = plan(source, target, shape, itemsize, process_of, me)
    settle = getattr(be, "settle", None)  # the per-process engine's (a lazy framework's)
    if settle is not None and the_plan.crosses:
        # what is pending runs first, on every process of the move alike: the exchange
        # below may run as it is called, while a collective waits until it is evaluated
        settle(list(blocks.values()))
    origin: dict[int, tuple[int, ...]] = {}
    if blocks:
        s_lo, _ = source.shard_bounds(shape, sorted(blocks))
        origin = {d: tuple(s_lo[i].tolist()) for i, d in enumerate(sorted(blocks))}

    def cut(p: Piece) -> Any:
        o = origin[p.source]
        return blocks[p.source][tuple(slice(a - b, c - b) for a, b, c in zip(p.start, o, p.stop))]

    data: dict[int, Any] = {}
    # target blocks the framework lets the core write into as pieces arrive (torch): no join
    sinks: dict[int, Any] = {}
    local = {id(p) for p in the_plan.local}
    for t, (bounds, pieces) in the_plan.blocks.items():
        if t in the_plan.kept or not pieces:
            continue
        size = tuple(b[-1] - b[0] for b in bounds)
        if wire.writes_in_place:
            sinks[t] = block = wire.empty(dtype, size, t)
            for p in pieces:
                if id(p) in local:  # held here: written now
                    _write(block, bounds, p, wire.take(cut(p), t))
    parts: dict[int, list[Any]] = {}
    for step in the_plan.schedule:  # every process makes the same calls (a transport may need it)
        outgoing = {q: [cut(u.run).reshape(-1) for u in us] for q, us in step.sends.items()}
        got = wire.exchange(outgoing, step.counts, dtype)
        del outgoing
        for q, us in step.receives.items():
            flat = got[q]
            for whole, run, at in us:
                arr = flat[at : at + run.size].reshape(run.shape)
                for t in whole.devices:
                    if t in sinks:
                        _write(sinks[t], the_plan.blocks[t][0], run, wire.take(arr, t))
                if any(t not in sinks for t in whole.devices):
                    parts.setdefault(id(whole), []).append(arr)
        del got
    for key, arrs in parts.items():  # a piece cut into runs of rows is joined again
        data[key] = arrs[0] if len(arrs) == 1 else join(arrs, 0)
    out = {}
    for t, (bounds, pieces) in the_plan.blocks.items():
        if t in the_plan.kept:
            out[t] = blocks[t]
        elif t in sinks:
            out[t] = sinks[t]
        else:
            out[t] = _assemble(wire, t, bounds, pieces, data, cut, dtype)
    add_stats(stats, the_plan.stats())
    return out


def _write(block: Any, bounds: tuple[tuple[int, ...], ...], piece: Piece, arr: Any) -> None:
    """``arr`` (the box of ``piece``) written into the target ``block`` whose per-dim
    segment bounds are ``bounds``."""
    index = tuple(slice(a - b[0], c - b[0]) for a, c, b in zip(piece.start, piece.stop, bounds))
    block[index] = arr


def _assemble(
    wire: Transport,
    device: int,
    bounds: tuple[tuple[int, ...], ...],
    pieces: list[Any],
    data: dict[int, Any],
    cut: Any,
    dtype: Any,
) -> Any:
    """The target block of ``device``: its pieces, put on it and joined in grid order."""
    grid = [len(b) - 1 for b in bounds]
    if not pieces:  # an empty block (this process may hold no block to take a dtype from)
        shape = tuple(max(b[-1] - b[0], 0) if len(b) > 1 else 0 for b in bounds)
        return wire.take(wire.empty(dtype, shape, device), device)
    parts = []
    for p in pieces:
        arr = data[id(p)] if id(p) in data else cut(p)
        parts.append(wire.take(arr, device))

    def join(items: list[Any], dim: int) -> Any:
        if dim == len(grid):
            return items[0]
        step = math.prod(grid[dim + 1 :])
        rows = [join(items[i * step : (i + 1) * step], dim + 1) for i in range(grid[dim])]
        return rows[0] if len(rows) == 1 else wire.arrays.concatenate(rows, dim)

    return join(parts, 0)


def plan_stats(
    be: Backend, source: Layout, target: Layout, shape: tuple[int, ...], size: int
) -> dict[str, int]:
    """This process's bytes in the plan of a move (what a framework's own verb must move)."""
    return plan(source, target, shape, size, process_map(be, source, target),
                be.initialize(300.0)[0]).stats()  # fmt: skip


def process_map(be: Backend, source: Layout, target: Layout) -> np.ndarray:
    """The process of each device id of either layout (by id; 0 for ids of neither)."""
    ids = device_ids(source, target)
    process_of = np.zeros(max(ids) + 1, dtype=np.int64)
    process_of[ids] = be.transport().processes(ids)
    return process_of


def same_blocks(a: Layout, b: Layout) -> bool:
    """Whether two layouts are the same placement, so that a reshard from one to the other
    moves nothing: equal, or differing only in the processes their meshes record
    (``devices_per_process``, which the backend knows anyway). Axis types count (JAX's
    arrays carry them). For a backend's :meth:`~unimesh.transport.Transport.native`,
    which gives the framework's result of such a move (the array itself, or its own verb's)."""
    if a == b:
        return True
    ma, mb = a.mesh, b.mesh
    return (
        a.spec == b.spec
        and ma.shape == mb.shape
        and ma.axis_names == mb.axis_names
        and ma.axis_types == mb.axis_types
        and bool(np.array_equal(ma.device_ids, mb.device_ids))
    )


def add_stats(stats: dict[str, int] | None, counted: Mapping[str, int]) -> None:
    if stats is None:
        return
    for key in ("bytes_sent", "bytes_received", "bytes_copied"):
        stats[key] = stats.get(key, 0) + int(counted.get(key, 0))


def itemsize(leaf: Any) -> int:
    """Bytes per element of a framework's array: numpy's and torch's ``dtype.itemsize``,
    TensorFlow's and MLX's ``dtype.size``, a dtype's name (Keras) through numpy."""
    dtype = getattr(leaf, "dtype", None)
    for name in ("itemsize", "size"):
        size = getattr(dtype, name, None)
        if isinstance(size, int) and size > 0:
            return size
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        pass
    text = str(dtype).rsplit(".", 1)[-1]
    try:
        return int(np.dtype(text).itemsize)
    except TypeError:
        if text == "bfloat16":
            return 2
        raise LayoutError(
            f"reshard() cannot tell the element size of dtype {dtype!r}; cast the array to a "
            "numeric dtype numpy knows (float32, bfloat16, int64, bool, ...)"
        ) from None
