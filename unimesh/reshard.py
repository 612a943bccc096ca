"""``unimesh.reshard``: a live distributed array moved to another layout, on any mesh of the job's
devices, moving only the bytes that must move.

The move is a plan (:mod:`unimesh.moves`, pure arithmetic) handed to a transport: the backend's
hooks of the ``reshard`` layer (:meth:`~unimesh.Backend.native_blocks`,
:meth:`~unimesh.Backend.device_processes`, :meth:`~unimesh.Backend.exchange_pieces`,
:meth:`~unimesh.Backend.place`, :meth:`~unimesh.Backend.concatenate`) and its ``from_local``.
A backend may move an array its own compiled way where that is as cheap
(:meth:`~unimesh.Backend.native_reshard`, JAX within one device set).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .backend import Backend
from .errors import LayoutError, UnimeshError, UnsupportedError
from .layout import Layout
from .messages import short
from .moves import Piece, plan, rounds, units
from .rules import LayoutMap

__all__ = ["reshard"]


def _is_leaf(x: Any) -> bool:
    return isinstance(x, Layout) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (dict, list, tuple))
    )


def reshard(
    x: Any,
    target: Layout | LayoutMap | Any,
    *,
    backend: str | Backend | None = None,
    stats: dict[str, int] | None = None,
) -> Any:
    """``x`` (a framework's distributed array, or a pytree of them) laid out as ``target``.

    ``target`` is a :class:`Layout` on any mesh of the job's devices, a pytree of Layouts (a
    prefix of ``x``'s tree), or a :class:`LayoutMap` (each array by its path, ``a/b/0``; an
    array no rule matches is replicated, a rule that matches no array is refused). Each process
    receives only the bytes of its devices' target blocks that none of its devices holds, once,
    from one process that holds them; blocks in place stay. An array that is not distributed (a
    numpy array, a framework's plain tensor) is laid out as :func:`unimesh.distribute` would.
    ``stats``, a dict, gets this process's ``bytes_sent``, ``bytes_received`` (between
    processes) and ``bytes_copied`` (between its own devices), added up over the tree.
    ``backend`` names the framework of the result (default: each array's own; for arrays
    not distributed yet, that of the tree's distributed arrays): another framework in the
    same processes gets each block through DLPack (shared memory where it can), after the
    pieces move on the source framework's engine; no gradient crosses frameworks. Under a
    framework's tracer (JAX ``grad``/``jit``) the framework's own differentiable move is
    used. Every array and target is checked before any byte moves.
    """
    import optree

    from .convert import layout_of, placing_backend, to_native
    from .registry import get_backend

    if stats is not None and not isinstance(stats, dict):
        raise LayoutError(f"reshard(stats=...) takes a dict to fill, got {short(stats)}")
    leaves, treedef = optree.tree_flatten(x, is_leaf=_is_leaf)
    if not leaves:
        raise LayoutError(
            f"reshard() got {short(x)}, which holds no arrays; pass a distributed array or a "
            "pytree (dict, list, tuple) of them"
        )
    paths = ["/".join(str(k) for k in p) for p in optree.treespec_paths(treedef)]
    targets = _targets(x, target, treedef, paths, leaves)
    jobs: list[tuple[str, Any, tuple[int, ...], Layout | None, Layout, tuple[Any, Any]]] = []
    # (owning backend, layout) of each distributed array, None for anything else
    found = [None if isinstance(leaf, Layout) else layout_of(leaf) for leaf in leaves]
    # a host array in the tree goes to the framework of the tree's distributed arrays
    placing = backend
    if placing is None:
        placing = next((f[0] for f in found if f is not None), None)
    for path, leaf, want, owned in zip(paths, leaves, targets, found):
        name = f"array {path!r}" if path else "the array"
        if isinstance(leaf, Layout):
            raise LayoutError(
                f"reshard() moves arrays; {name} is a Layout ({leaf!r}): pass the array laid "
                "out that way, and the Layout you want as target"
            )
        shape = tuple(int(n) for n in leaf.shape)
        _check_target(want, shape, name)
        if owned is None:  # not distributed: a framework's tracer (moved by its own verb),
            # else laid out as distribute() lays it out
            owner = _owner(leaf)
            if (
                owner is not None
                and backend is not None
                and owner.name != get_backend(backend).name
            ):
                owner = None  # another framework's: distribute converts it
            be = placing_backend(placing if owner is None else owner, "distribute", want, shape)
            jobs.append((name, leaf, shape, None, want, (be, owner)))
            continue
        be, source = owned
        to = be if backend is None else get_backend(backend)
        # the target on its framework, and its mesh on the job's devices, before any move
        placing_backend(to, "from_local", want, shape)
        to_native(want, to)
        _itemsize(leaf)
        try:
            if to.name == be.name:
                be.check_reshard(leaf, source, want, shape)
            else:
                _check_handoff(be, to, leaf, source, want, name)
        except UnimeshError as exc:
            if name not in str(exc):  # the backend's refusal, said of this array
                exc.args = (f"reshard() of {name}: {exc.args[0]}", *exc.args[1:])
            raise
        if len(set(source.spec.partial.values())) > 1:
            raise UnsupportedError(
                f"reshard() of {name}: its layout {source!r} holds pending reductions of "
                f"different ops ({source.spec.partial}); reduce all but one first"
            )
        jobs.append((name, leaf, shape, source, want, (be, to)))
    out = []
    for _name, leaf, shape, origin, want, (be, to) in jobs:
        if origin is None:
            moved = None if to is None else to.native_reshard(leaf, None, want, shape)
            if moved is not None:  # a tracer: the framework's own differentiable move
                out.append(moved[0])
                continue
            from .convert import distribute

            out.append(distribute(leaf, want, be))
        elif to.name == be.name:
            out.append(_move(be, leaf, shape, origin, want, stats))
        else:
            out.append(_handoff(be, to, leaf, shape, origin, want, stats))
    return optree.tree_unflatten(treedef, out)


def _targets(
    x: Any, target: Any, treedef: Any, paths: list[str], leaves: list[Any]
) -> list[Layout]:
    """One target Layout per leaf of ``x``."""
    import optree

    if isinstance(target, Layout):
        return [target] * len(leaves)
    if isinstance(target, LayoutMap):
        from .rules import Resolver

        rules = Resolver(target, None, None, "reshard()")
        replicated = Layout(target.mesh, ())  # an array no rule matches
        found = [replicated if (got := rules.layout(path)) is None else got for path in paths]
        rules.unmatched(paths, True, "array of the tree", "The tree's array paths")
        return found
    try:
        full = treedef.flatten_up_to(optree.tree_broadcast_prefix(target, x, is_leaf=_is_leaf))
    except (ValueError, TypeError) as exc:
        raise LayoutError(
            f"reshard() target {short(target)} is neither a Layout, a LayoutMap nor a prefix of "
            f"the arrays' tree ({exc}); give one Layout per array, or one for all"
        ) from None
    for path, got in zip(paths, full):
        if not isinstance(got, Layout):
            raise LayoutError(
                f"reshard() target for array {path!r} is {short(got)}, not a unimesh.Layout; "
                "build one with unimesh.Layout(mesh, P(...))"
            )
    return list(full)


def _check_target(layout: Layout, shape: tuple[int, ...], name: str) -> None:
    if len(layout.spec) > len(shape):
        raise LayoutError(
            f"reshard() of {name}: target {layout!r} names {len(layout.spec)} dims but the "
            f"array has shape {shape}; give a spec of at most {len(shape)} entries"
        )
    if layout.spec.partial:
        raise LayoutError(
            f"reshard() of {name}: a target cannot hold a pending reduction "
            f"({layout!r}); drop partial from its spec"
        )


def _owner(leaf: Any) -> Backend | None:
    """The backend whose framework made ``leaf`` (None for numpy and foreign objects)."""
    from .errors import ConversionError
    from .registry import owner_of

    if isinstance(leaf, np.ndarray):
        return None
    try:
        return owner_of(leaf)
    except ConversionError:
        return None


def _ids(*layouts: Layout) -> list[int]:
    return sorted({d for lay in layouts for d in lay.mesh.device_ids.ravel().tolist()})


def _moves_between_processes(be: Backend) -> bool:
    return type(be).exchange_pieces is not Backend.exchange_pieces or be.initialize(300.0)[1] == 1


def _check_handoff(
    be: Backend, to: Backend, leaf: Any, source: Layout, target: Layout, name: str
) -> None:
    """Two frameworks in one job: the target framework takes the source's blocks (DLPack)
    in a dtype as wide (JAX without x64 would narrow int64), each device in the same process
    in both, and one of them moves data between processes."""
    if type(to).import_block is Backend.import_block:
        to.import_block(None, None)  # its refusal, naming the backend
    there = _empty_there(be, to, leaf)
    theirs = there.dtype
    if _itemsize(leaf) != _itemsize(there):
        raise UnsupportedError(
            f"reshard() of {name} from {be.name} to {to.name}: its dtype {leaf.dtype} would "
            f"become {theirs} there, losing values; cast it first, or widen {to.name}'s types "
            "(JAX: jax.config.update('jax_enable_x64', True))"
        )
    ids = _ids(source, target)
    here, there = be.device_processes(ids), to.device_processes(ids)
    if here != there:
        bad = next(i for i, a, b in zip(ids, here, there) if a != b)
        at = ids.index(bad)
        raise UnsupportedError(
            f"reshard() of {name} from {be.name} to {to.name}: device {bad} is in process "
            f"{here[at]} for {be.name} but in process {there[at]} for {to.name}; start both "
            "runtimes with the same process numbering (torchrun's RANK as JAX_PROCESS_ID), one "
            "device per process in each"
        )
    if not (_moves_between_processes(be) or _moves_between_processes(to)):
        raise UnsupportedError(
            f"reshard() of {name} from {be.name} to {to.name}: neither framework moves data "
            "between processes here; reshard through unimesh.save and unimesh.load"
        )


def _handoff(
    be: Backend,
    to: Backend,
    leaf: Any,
    shape: tuple[int, ...],
    source: Layout,
    target: Layout,
    stats: dict[str, int] | None,
) -> Any:
    """``leaf`` (of ``be``) as ``to``'s array laid out as ``target``: the pieces move on
    ``be``'s engine (or on ``to``'s where ``be`` moves nothing between processes: a backend
    without :meth:`~unimesh.Backend.exchange_pieces`), and each block crosses by DLPack."""

    def cross(blocks: Mapping[int, Any]) -> dict[int, Any]:
        return {d: to.import_block(be.export_block(b), d) for d, b in blocks.items()}

    moved = _native(be, leaf, source, target, shape, stats)
    if moved is not None:  # in place already: every block crosses as it is
        blocks = cross(be.native_blocks(moved))
    elif _moves_between_processes(be):
        blocks = cross(_moved(be, be.native_blocks(leaf), leaf, shape, source, target, stats))
    else:  # the blocks cross first, and the target's engine moves them
        held = cross(be.native_blocks(leaf))
        like = next(iter(held.values()), None)
        if like is None:
            like = _empty_there(be, to, leaf)
        blocks = _moved(to, held, like, shape, source, target, stats)
    return to.from_local(blocks, target, shape, dtype=_empty_there(be, to, leaf).dtype)


def _empty_there(be: Backend, to: Backend, leaf: Any) -> Any:
    """An empty block of ``be``'s array ``leaf`` as ``to`` takes it (its dtype there)."""
    return to.import_block(be.export_block(be.empty_block(leaf.dtype, (0,))), None)


def _native(
    be: Backend,
    leaf: Any,
    source: Layout,
    target: Layout,
    shape: tuple[int, ...],
    stats: dict[str, int] | None,
) -> Any:
    """``leaf`` moved by the framework's own verb where it has one for this move (its bytes
    added to ``stats``), else None; never for a pending reduction."""
    if source.spec.partial:
        return None
    native = be.native_reshard(leaf, source, target, shape)
    if native is None:
        return None
    moved, counted = native
    _add(stats, counted)
    return moved


def _move(
    be: Backend,
    leaf: Any,
    shape: tuple[int, ...],
    source: Layout,
    target: Layout,
    stats: dict[str, int] | None,
) -> Any:
    moved = _native(be, leaf, source, target, shape, stats)
    if moved is not None:
        return moved
    out = _moved(be, be.native_blocks(leaf), leaf, shape, source, target, stats)
    return be.from_local(out, target, shape, dtype=getattr(leaf, "dtype", None))


def _moved(
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
    (:meth:`~unimesh.Backend.move_with_gradient`): the gradient of the move is the reverse
    move, the cotangent blocks resharded from ``target`` to ``source`` (a pending sum's
    addends each get the whole cotangent, as the derivative of a sum says; an avg's, a
    share)."""

    kind = (like.dtype, _itemsize(like))  # not ``like``: autodiff keeps these closures

    def forward(given: Mapping[int, Any]) -> dict[int, Any]:
        return _plain(be, given, kind, shape, source, target, stats)

    def backward(cotangents: Mapping[int, Any]) -> dict[int, Any]:
        from .spec import PartitionSpec

        ops = set(source.spec.partial.values())
        if ops & {"max", "min"}:
            raise UnsupportedError(
                f"reshard() of {source!r}: the gradient of a pending {min(ops)} is not a "
                "move; reduce it before the differentiated function",
                backend=be.name,
                capability="grad",
            )
        plain = Layout(source.mesh, PartitionSpec(*source.spec))
        got = _plain(be, cotangents, kind, shape, target, plain, None)
        if ops == {"avg"}:
            n = math.prod(source.mesh.axis_size(a) for a in source.spec.partial)
            got = {d: be.combine("avg", b, n) for d, b in got.items()}
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
    """:func:`_moved` outside autodiff; ``kind``: the framework's dtype and its item size."""
    ids = _ids(source, target)
    process_of = np.zeros(max(ids) + 1, dtype=np.int64)
    process_of[ids] = be.device_processes(ids)
    me, _ = be.initialize(300.0)  # this process's index (the runtime is already up)
    if not source.spec.partial:
        return _blocks(be, blocks, source, target, shape, kind, process_of, me, stats)
    # a pending reduction: each coordinate along the partial axes holds one addend of every
    # block; each is moved as its own layout, then reduced on the target devices
    (op,) = set(source.spec.partial.values())
    parts = [
        _blocks(be, {d: b for d, b in blocks.items() if d in addend.mesh.device_ids},
                addend, target, shape, kind, process_of, me, stats)
        for addend in _addends(source)
    ]  # fmt: skip
    out = {}
    for t in parts[0]:
        total = parts[0][t]
        for more in parts[1:]:
            total = be.combine("max" if op == "max" else "min" if op == "min" else "sum",
                               total, more[t])  # fmt: skip
        out[t] = be.combine("avg", total, len(parts)) if op == "avg" else total
    return out


def _addends(source: Layout) -> list[Layout]:
    """A partial layout as one plain layout per coordinate along its partial axes, each over
    the devices at that coordinate."""
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
    their dtype and item size): the plan's pieces cut, exchanged and joined."""
    dtype, itemsize = kind
    the_plan = plan(source, target, shape, itemsize, process_of, me)
    origin: dict[int, tuple[int, ...]] = {}
    if blocks:
        s_lo, _ = source.shard_bounds(shape, sorted(blocks))
        origin = {d: tuple(s_lo[i].tolist()) for i, d in enumerate(sorted(blocks))}

    def cut(device: int, start: tuple[int, ...], stop: tuple[int, ...]) -> Any:
        o = origin[device]
        return blocks[device][tuple(slice(a - b, c - b) for a, b, c in zip(start, o, stop))]

    data: dict[int, Any] = {}
    # target blocks the framework lets the core write into as pieces arrive (torch): no join
    sinks: dict[int, Any] = {}
    local = {id(p) for p in the_plan.local}
    for t, (bounds, pieces) in the_plan.blocks.items():
        if t in the_plan.kept or not pieces:
            continue
        size = tuple(b[-1] - b[0] for b in bounds)
        block = be.writable_block(dtype, size, t)
        if block is not None:
            sinks[t] = block
            for p in pieces:
                if id(p) in local:  # held here: written now
                    _write(block, bounds, p, be.place(cut(p.source, p.start, p.stop), t))
    budget, count = rounds(source, target, shape, itemsize, process_of)
    # per round, per peer: (piece, its rows to move) to send, and to receive
    send_at: dict[int, dict[int, list[Piece]]] = {}
    take_at: dict[int, dict[int, list[tuple[Piece, Piece]]]] = {}
    for q, ps in the_plan.send.items():
        for i, lo, hi, r in units(ps, itemsize, budget):
            send_at.setdefault(r, {}).setdefault(q, []).append(_rows(ps[i], lo, hi))
    for q, ps in the_plan.receive.items():
        for i, lo, hi, r in units(ps, itemsize, budget):
            take_at.setdefault(r, {}).setdefault(q, []).append((ps[i], _rows(ps[i], lo, hi)))
    parts: dict[int, list[Any]] = {}
    for r in range(count):  # every process makes the same calls (a transport may need it)
        outgoing = {q: [cut(p.source, p.start, p.stop) for p in ps]
                    for q, ps in send_at.get(r, {}).items()}  # fmt: skip
        wanted = take_at.get(r, {})
        shapes = {q: [run.shape for _, run in runs] for q, runs in wanted.items()}
        got = be.exchange_pieces(outgoing, shapes, dtype)
        del outgoing
        for q, runs in wanted.items():
            for (whole, run), arr in zip(runs, got[q]):
                for t in whole.devices:
                    if t in sinks:
                        _write(sinks[t], the_plan.blocks[t][0], run, be.place(arr, t))
                if any(t not in sinks for t in whole.devices):
                    parts.setdefault(id(whole), []).append(arr)
        del got
    for key, arrs in parts.items():  # a piece cut into runs of rows is joined again
        data[key] = arrs[0] if len(arrs) == 1 else be.concatenate(arrs, 0)
    out = {}
    for t, (bounds, pieces) in the_plan.blocks.items():
        if t in the_plan.kept:
            out[t] = blocks[t]
        elif t in sinks:
            out[t] = sinks[t]
        else:
            out[t] = _assemble(be, t, bounds, pieces, data, cut, dtype)
    _add(stats, the_plan.stats())
    return out


def _write(block: Any, bounds: tuple[tuple[int, ...], ...], piece: Piece, arr: Any) -> None:
    """``arr`` (the box of ``piece``) written into the target ``block`` whose per-dim
    segment bounds are ``bounds``."""
    index = tuple(slice(a - b[0], c - b[0]) for a, c, b in zip(piece.start, piece.stop, bounds))
    block[index] = arr


def _rows(piece: Piece, lo: int, hi: int) -> Piece:
    """Rows ``lo:hi`` of ``piece`` (along its first dim; a 0-d piece whole)."""
    if not piece.start or (lo == 0 and hi == piece.shape[0]):
        return piece
    start = (piece.start[0] + lo, *piece.start[1:])
    stop = (piece.start[0] + hi, *piece.stop[1:])
    return Piece(start, stop, piece.source, piece.devices)


def _assemble(
    be: Backend,
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
        return be.place(be.empty_block(dtype, shape), device)
    parts = []
    for p in pieces:
        arr = data[id(p)] if id(p) in data else cut(p.source, p.start, p.stop)
        parts.append(be.place(arr, device))

    def join(items: list[Any], dim: int) -> Any:
        if dim == len(grid):
            return items[0]
        step = math.prod(grid[dim + 1 :])
        rows = [join(items[i * step : (i + 1) * step], dim + 1) for i in range(grid[dim])]
        return rows[0] if len(rows) == 1 else be.concatenate(rows, dim)

    return join(parts, 0)


def _add(stats: dict[str, int] | None, counted: Mapping[str, int]) -> None:
    if stats is None:
        return
    for key in ("bytes_sent", "bytes_received", "bytes_copied"):
        stats[key] = stats.get(key, 0) + int(counted.get(key, 0))


def _itemsize(leaf: Any) -> int:
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
