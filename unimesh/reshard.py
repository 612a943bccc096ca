"""``unimesh.reshard``: a live distributed array moved to another layout, on any mesh of the job's
devices, moving only the bytes that must move.

This module is the verb: trees and targets, every check before any byte moves, and the
handoff of blocks between two frameworks (DLPack). The move itself is a plan
(:mod:`unimesh.moves`, pure arithmetic) that :mod:`unimesh.transfer` carries out on the
backend's transport (:class:`unimesh.transport.Transport`), from its ``native_blocks`` to
its ``from_local``. A backend may move an array its own compiled way where that is as cheap
(:meth:`~unimesh.transport.Transport.native`, JAX within one device set).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .backend import Backend
from .errors import LayoutError, UnimeshError, UnsupportedError
from .layout import Layout
from .messages import short
from .rules import LayoutMap
from .transfer import add_stats, device_ids, itemsize, move_blocks, plan_stats

__all__ = ["reshard"]


class _Job(NamedTuple):
    """One array of a reshard, checked: what moves it and what it becomes."""

    leaf: Any
    shape: tuple[int, ...]
    #: its layout; None for an array that is not distributed (laid out by ``distribute``)
    source: Layout | None
    target: Layout
    #: the framework whose array it is (for one not distributed: the one that lays it out)
    be: Backend
    #: the framework of the result (``be`` but for a handoff between two frameworks)
    to: Backend
    #: an array not distributed: its own framework, whose tracer may move it (else None)
    owner: Backend | None = None
    #: a handoff: an empty block of ``to`` in the dtype the array takes there
    there: Any = None


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
    jobs: list[_Job] = []
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
            jobs.append(_Job(leaf, shape, None, want, be, be, owner))
            continue
        be, source = owned
        to = be if backend is None else get_backend(backend)
        there = None
        try:
            if to.name != be.name:
                to.transport().refuse_foreign()  # before its runtime is started
            # the target on its framework, and its mesh on the job's devices, before any move
            placing_backend(to, "from_local", want, shape)
            to_native(want, to)
            itemsize(leaf)
            if to.name == be.name:
                be.check_reshard(leaf, source, want, shape)
            else:
                there = _check_handoff(be, to, leaf, source, want, name)
        except UnimeshError as exc:
            if name not in str(exc):  # the backend's refusal, said of this array
                exc.args = (f"reshard() of {name}: {exc.args[0]}", *exc.args[1:])
            raise
        if len(set(source.spec.partial.values())) > 1:
            raise UnsupportedError(
                f"reshard() of {name}: its layout {source!r} holds pending reductions of "
                f"different ops ({source.spec.partial}); reduce all but one first"
            )
        jobs.append(_Job(leaf, shape, source, want, be, to, None, there))
    out = []
    for job in jobs:
        if job.source is None:
            moved = None
            if job.owner is not None:
                moved = job.owner.transport().native(job.leaf, None, job.target, job.shape)
            if moved is not None:  # a tracer: the framework's own differentiable move
                out.append(moved[0])
                continue
            from .convert import distribute

            out.append(distribute(job.leaf, job.target, job.be))
        elif job.there is None:
            out.append(_move(job.be, job.leaf, job.shape, job.source, job.target, stats))
        else:
            out.append(_handoff(job, job.source, stats))
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


def _moves_between_processes(be: Backend) -> bool:
    return type(be.transport()).has("exchange") or be.initialize(300.0)[1] == 1


def _check_handoff(
    be: Backend, to: Backend, leaf: Any, source: Layout, target: Layout, name: str
) -> Any:
    """Two frameworks in one job: the target framework takes the source's blocks (DLPack)
    in a dtype as wide (JAX without x64 would narrow int64), each device in the same process
    in both, and one of them moves data between processes. Returns an empty block of ``to``
    in the dtype ``leaf`` takes there (asked of DLPack once per array)."""
    to.transport().refuse_foreign()
    empty = _empty_there(be, to, leaf)
    theirs = empty.dtype
    if itemsize(leaf) != itemsize(empty):
        raise UnsupportedError(
            f"reshard() of {name} from {be.name} to {to.name}: its dtype {leaf.dtype} would "
            f"become {theirs} there, losing values; cast it first, or widen {to.name}'s types "
            "(JAX: jax.config.update('jax_enable_x64', True))"
        )
    ids = device_ids(source, target)
    here, there = be.transport().processes(ids), to.transport().processes(ids)
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
    shape = tuple(int(n) for n in leaf.shape)
    if _engine(be, to, target, shape) is None:
        raise UnsupportedError(
            f"reshard() of {name} from {be.name} to {to.name}: {be.name} cannot hold the "
            f"target layout {target!r} ({_unheld(be, target, shape)}) and {to.name} moves no "
            "data between processes here; choose a target both frameworks can hold, or "
            "reshard through unimesh.save and unimesh.load"
        )
    return empty


def _unheld(be: Backend, layout: Layout, shape: tuple[int, ...]) -> str | None:
    """Why ``be`` cannot lay out an array of ``shape`` as ``layout`` (uneven blocks, a
    feature of the layout it lacks); None where it can."""
    from .convert import placing_backend

    try:
        placing_backend(be, "from_local", layout, shape)
    except UnimeshError as exc:
        return str(exc.args[0]) if exc.args else type(exc).__name__
    return None


def _engine(be: Backend, to: Backend, target: Layout, shape: tuple[int, ...]) -> Backend | None:
    """Whose engine moves the pieces of a reshard from ``be``'s array to ``to``'s: the
    source's where it moves data between processes and can hold the target (the pieces
    move, then each target block crosses), else the target's where it moves data between
    processes (each source block crosses, then the pieces move; ``to`` holds the target,
    checked before); None where neither can."""
    if _moves_between_processes(be) and _unheld(be, target, shape) is None:
        return be
    return to if _moves_between_processes(to) else None


def _handoff(job: _Job, source: Layout, stats: dict[str, int] | None) -> Any:
    """``job``'s array (of ``job.be``) as ``job.to``'s laid out as its target, each block
    crossing by DLPack: the pieces move on ``be``'s engine, then cross; or, where ``be`` cannot
    (it moves nothing between processes, or cannot hold the target: JAX's uneven blocks), the
    source blocks cross and the pieces move on ``to``'s (:func:`_engine`)."""
    be, to, leaf, shape, target = job.be, job.to, job.leaf, job.shape, job.target

    out, into = be.transport(), to.transport()

    def cross(blocks: Mapping[int, Any]) -> dict[int, Any]:
        return {d: into.take(out.export(b), d) for d, b in blocks.items()}

    if _engine(be, to, target, shape) is be:
        moved = _native(be, leaf, source, target, shape, stats)
        if moved is not None:  # in place already: every block crosses as it is
            blocks = cross(be.native_blocks(moved))
        else:
            blocks = cross(
                move_blocks(be, be.native_blocks(leaf), leaf, shape, source, target, stats)
            )
    else:  # the blocks cross first, and the target's engine moves them
        held = cross(be.native_blocks(leaf))
        like = next(iter(held.values()), job.there)
        blocks = move_blocks(to, held, like, shape, source, target, stats)
    return to.from_local(blocks, target, shape, dtype=job.there.dtype)


def _empty_there(be: Backend, to: Backend, leaf: Any) -> Any:
    """An empty block of ``be``'s array ``leaf`` as ``to`` takes it (its dtype there)."""
    out = be.transport()
    return to.transport().take(out.export(out.empty(leaf.dtype, (0,))), None)


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
    native = be.transport().native(leaf, source, target, shape)
    if native is None:
        return None
    moved, counted = native
    if stats is not None:
        add_stats(
            stats,
            plan_stats(be, source, target, shape, itemsize(leaf)) if counted is None else counted,
        )
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
    out = move_blocks(be, be.native_blocks(leaf), leaf, shape, source, target, stats)
    return be.from_local(out, target, shape, dtype=getattr(leaf, "dtype", None))
