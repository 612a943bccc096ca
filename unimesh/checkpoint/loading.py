"""Loading: every leaf of the target checked and planned (:class:`LoadPlan`: its tensor, its
layout, and this process's block per device) before a byte is read; then each block read as
the byte runs of the saved boxes it touches, one block at a time (or, for a process holding
several blocks of a tensor, up to 64 MiB of them together, box by box in file order), and
handed to the backend's ``from_local``. A rule target (``LayoutMap``, ``AxisRules``) is read
by the same :class:`~unimesh.rules.Resolver` as ``shard_params``."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointError, UnimeshError
from ..layout import Layout
from ..mesh import Mesh
from ..messages import short
from ..spec import PartitionSpec
from .format import Tensor, dtype_name, dtype_text, numpy_dtype
from .raw import aligned_empty
from .reader import Checkpoint, open_checkpoint
from .runs import BoxPart, planned
from .tree import flatten, model_state

__all__ = ["LoadPlan", "load"]

Key = tuple[tuple[int, int], ...]  # a block: (start, stop) per dim


class LoadPlan:
    """One leaf of a load's target, checked: its tensor (None: not in the checkpoint), the
    backend and layout it is loaded into (None: a host array, read whole), the cast asked
    for, this process's block per device (``keys``) and, while the leaf is read, each block's
    reads (``parts``, from the live reshard's planner: :func:`.runs.planned`)."""

    __slots__ = ("be", "cast", "keys", "layout", "leaf", "name", "parts", "tensor")

    def __init__(self, name: str, leaf: Any) -> None:
        self.name, self.leaf = name, leaf
        self.tensor: Tensor | None = None
        self.be: Any = None
        self.layout: Layout | None = None
        self.cast: np.dtype[Any] | None = None
        self.keys: dict[int, Key] = {}
        self.parts: dict[int, list[BoxPart]] | None = None

    def held_bytes(self) -> int:
        """Bytes of the distinct blocks this process's devices hold (after the cast)."""
        assert self.tensor is not None
        itemsize = self.tensor.itemsize if self.cast is None else self.cast.itemsize
        return sum(math.prod(b - a for a, b in key) * itemsize for key in set(self.keys.values()))


def plan_leaf(
    ckpt: Checkpoint,
    name: str,
    leaf: Any,
    backend: Any,
    dtype: Any,
    strict: bool,
    saved: str | None = None,
) -> LoadPlan:
    """``leaf``'s plan, every mismatch with the checkpoint refused by name; ``saved``: the
    checkpoint's name for it where the target renames it."""
    from ..convert import layout_of
    from ..registry import get_backend

    plan = LoadPlan(name, leaf)
    saved = name if saved is None else saved
    if saved not in ckpt.tensors:
        if strict:
            ckpt.tensor(saved)  # raises, naming the closest names
        return plan
    t = plan.tensor = ckpt.tensor(saved)
    if dtype is not None:
        plan.cast = np.dtype(dtype)
    if isinstance(leaf, np.ndarray):  # a host array: read whole, as numpy
        if tuple(leaf.shape) != t.shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {t.shape} in {ckpt.path}, the target "
                f"{tuple(leaf.shape)}"
            )
        if dtype is None and dtype_text(leaf.dtype) != t.dtype:
            raise CheckpointError(
                f"tensor {name!r} is {t.dtype} in {ckpt.path}, the target "
                f"{dtype_text(leaf.dtype)}: pass dtype= to cast on purpose"
            )
        return plan
    if isinstance(leaf, Layout):
        layout, be = leaf, get_backend(backend)
        want_dtype = None
    else:
        found = layout_of(leaf)
        if found is None:
            raise CheckpointError(
                f"target {name!r} is {short(leaf)}: give a unimesh.Layout or a backend's "
                "distributed array"
            )
        be, layout = found
        if backend is not None:
            be = get_backend(backend)
        shape = tuple(int(n) for n in leaf.shape)
        if shape != t.shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {t.shape} in {ckpt.path}, the target {shape}"
            )
        want_dtype = dtype_text(getattr(leaf, "dtype", ""))
    if layout.spec.partial:
        raise CheckpointError(
            f"target {name!r} is laid out as a pending reduction ({layout.spec!r}): a "
            "checkpoint holds values, so load it into a layout without partial (Replicate "
            "where the target has Partial), then reduce or redistribute as you need"
        )
    if len(layout.spec) > len(t.shape):
        raise CheckpointError(
            f"tensor {name!r} has {len(t.shape)} dims, its target layout {layout.spec!r} "
            f"names {len(layout.spec)}"
        )
    be.require("checkpoint", "unimesh.load builds its arrays with from_local")
    if dtype is None and want_dtype and want_dtype != t.dtype:
        raise CheckpointError(
            f"tensor {name!r} is {t.dtype} in {ckpt.path}, the target {want_dtype}: pass "
            "dtype= to cast on purpose"
        )
    plan.be, plan.layout = be, layout
    for device in be.process_devices(layout.mesh):
        plan.keys[device] = tuple((s.start, s.stop) for s in layout.shard_slices(t.shape, device))
    return plan


def _plan_reads(ckpt: Checkpoint, plan: LoadPlan, memo: dict[Any, Any]) -> None:
    """``plan.parts`` from the reshard planner (one plan per distinct saved boxes, target
    layout and devices in a load: a model's layers share them); none where another library
    reads the chunks, or where the planner declines (the reads then intersect directly)."""
    t, layout = plan.tensor, plan.layout
    if t is None or layout is None or not ckpt.reads_boxes:
        return
    key = (
        t.shape,
        t.itemsize,
        tuple((b.offset, b.size) for b in t.boxes),
        layout,
        tuple(plan.keys),
    )
    if key not in memo:
        # the plan's pieces, as (box index, start, stop): each leaf has its own boxes
        found = planned(t, layout, list(plan.keys))
        index = {id(b): i for i, b in enumerate(t.boxes)}
        memo[key] = (
            None
            if found is None
            else {
                d: [(index[id(box)], a, b) for box, a, b in regions] for d, regions in found.items()
            }
        )
    shared = memo[key]
    if shared is not None:
        plan.parts = {
            d: [(t.boxes[i], a, b) for i, a, b in regions] for d, regions in shared.items()
        }


class LazyBlocks(Mapping[int, np.ndarray]):
    """This process's blocks of one tensor, ``{device: block}``, each read when the backend
    first asks for it (or all on the first ask, where ``read_all`` is given: at most
    :data:`TOGETHER_MAX` bytes) and let go once every device holding it has been given it: a
    load does not stage the whole tensor in host memory."""

    def __init__(
        self,
        keys: dict[int, Key],
        read: Callable[[int], np.ndarray],
        read_all: Callable[[], dict[Key, np.ndarray]] | None = None,
    ) -> None:
        """``read(device)``: the block of ``device``, read (once for devices of one block);
        ``read_all()``: every block at once, by key (asked on the first access instead)."""
        self._keys, self._read, self._read_all = keys, read, read_all
        self._left: dict[Key, int] = {}
        for key in keys.values():
            self._left[key] = self._left.get(key, 0) + 1
        self._held: dict[Key, np.ndarray] = {}

    def __getitem__(self, device: int) -> np.ndarray:
        key = self._keys[device]
        block = self._held.get(key)
        if block is None and self._read_all is not None:
            self._held.update(self._read_all())
            self._read_all = None
            block = self._held[key]
        if block is None:
            block = self._held[key] = self._read(device)
        self._left[key] -= 1
        if self._left[key] <= 0:  # every device of this block has it: let go
            del self._held[key]
        return block

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


#: bytes of one tensor's blocks this process may read together (:func:`_read_blocks`): the
#: load's memory bound beyond its destination
TOGETHER_MAX = 64 << 20


def _read_blocks(ckpt: Checkpoint, plan: LoadPlan) -> dict[Key, np.ndarray]:
    """Every block of this process of the plan's tensor, read together box by box in file
    order (:meth:`~.reader.Checkpoint.read_regions`): for one process holding several
    devices' blocks that share saved boxes (columns of row-major boxes), a cold read
    onto columns took 0.248 s device by device and 0.222 s so (medians of 7, 224 MiB)."""
    assert plan.tensor is not None
    first: dict[Key, int] = {}
    for device, key in plan.keys.items():
        first.setdefault(key, device)
    regions = [
        (*_bounds(key), None if plan.parts is None else plan.parts[device])
        for key, device in first.items()
    ]
    return dict(zip(first, ckpt.read_regions(plan.tensor, regions)))


def _bounds(key: Key) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A block's (start, stop) in the global index, from its key of (start, stop) pairs."""
    return tuple(a for a, _ in key), tuple(b for _, b in key)


def _cast(block: np.ndarray, cast: Any) -> np.ndarray:
    """``block`` in the dtype the load was asked for (``cast``; None: as saved)."""
    if cast is None:
        return block
    out = aligned_empty(block.shape, cast)
    np.copyto(out, block, casting="unsafe")
    return out


def _read_block(ckpt: Checkpoint, plan: LoadPlan, device: int) -> np.ndarray:
    assert plan.tensor is not None
    key, cast = plan.keys[device], plan.cast
    start, stop = _bounds(key)
    parts = None if plan.parts is None else plan.parts[device]
    return _cast(ckpt.read_region(plan.tensor, start, stop, parts=parts), cast)


def _fill_in_place(ckpt: Checkpoint, plan: LoadPlan) -> bool:
    """Read each of this process's blocks straight into the target array's own memory, where
    its framework lets one write it (:meth:`~unimesh.Backend.host_views`: a torch DTensor on
    the CPU) and no cast is asked for; a block two devices of this process hold is read once.
    False (nothing read) where the target is not such an array."""
    t, be, leaf, layout = plan.tensor, plan.be, plan.leaf, plan.layout
    if t is None or layout is None or plan.cast is not None or isinstance(leaf, Layout):
        return False  # (the same answer on every process: it depends on the target's kind)
    if not be.owns(leaf):
        return False
    from ..convert import placing_backend, to_native

    # what from_local would check and build (the native mesh, collectively where the framework
    # needs it), so that every process takes part whichever path each one takes
    placing_backend(be, "from_local", layout, t.shape)
    to_native(layout, be)
    views = be.host_views(leaf)
    if views is None or set(views) != set(plan.keys):
        return False
    for device, key in plan.keys.items():
        view = views[device]
        if (
            not isinstance(view, np.ndarray)
            or view.shape != tuple(b - a for a, b in key)
            or view.dtype.itemsize != t.itemsize
            or not view.flags.c_contiguous
            or not view.flags.writeable
        ):
            return False
    first: dict[Key, np.ndarray] = {}
    for device, key in plan.keys.items():
        if key in first:  # two devices of this process hold this block
            np.copyto(views[device], first[key])
            continue
        start, stop = _bounds(key)
        parts = None if plan.parts is None else plan.parts[device]
        ckpt.read_region(t, start, stop, views[device], parts)
        first[key] = views[device]
    return True


def _load_fused(
    ckpt: Checkpoint, name: str, leaf: Any, source: Any, backend: Any, dtype: Any
) -> tuple[Any, int]:
    """A target made of several saved tensors (:class:`~unimesh.Concat`) or of a part of one
    (:class:`~unimesh.Slice`): each of this process's blocks read run by run, each run only
    the region of its saved tensor that the block covers, never a whole tensor. Returns the
    array and the bytes of its blocks."""
    from ..convert import from_blocks, layout_of, placing_backend
    from ..fusion import segments
    from ..registry import get_backend

    def problem(text: str) -> CheckpointError:
        return CheckpointError(f"target {name!r} ({source!r}): {text}")

    try:
        used = {n: ckpt.tensor(n) for n in _names_of(source)}
        whole, runs = segments(name, source, {n: t.shape for n, t in used.items()})
    except UnimeshError as exc:
        raise problem(str(exc)) from None
    kinds = {used[r.name].dtype for r in runs}
    if dtype is None and len(kinds) > 1:
        raise problem(f"its parts are saved as {sorted(kinds)}; pass dtype= to say its own")
    want = np.dtype(dtype) if dtype is not None else numpy_dtype(kinds.pop())
    if isinstance(leaf, np.ndarray):
        raise problem("a fused target is a Layout or a distributed array, not numpy")
    if isinstance(leaf, Layout):
        layout, be = leaf, get_backend(backend)
    else:
        found = layout_of(leaf)
        if found is None:
            raise problem(f"give a unimesh.Layout or a distributed array, not {short(leaf)}")
        be, layout = found
        if tuple(int(n) for n in leaf.shape) != whole:
            raise problem(f"the saved parts make shape {whole}, the target is {tuple(leaf.shape)}")
    be = placing_backend(be, "from_local", layout, whole)
    devices = be.process_devices(layout.mesh)
    blocks: dict[int, np.ndarray] = {}
    done: dict[Key, np.ndarray] = {}
    for device in devices:
        index = layout.shard_slices(whole, device)
        key = tuple((s.start, s.stop) for s in index)
        if key in done:
            blocks[device] = done[key]
            continue
        block = aligned_empty(tuple(b - a for a, b in key), want)
        for run in runs if block.size else ():
            assert run.dim is not None  # (a rename is read as the saved tensor itself)
            lo, hi = [a for a, _ in key], [b for _, b in key]
            d = run.dim  # the block's part in this run, in the saved tensor's index
            a, b = max(lo[d], run.at), min(hi[d], run.at + run.stop - run.start)
            if a >= b:
                continue
            lo[d], hi[d] = a - run.at + run.start, b - run.at + run.start
            part = ckpt.read_region(used[run.name], tuple(lo), tuple(hi))
            where = [slice(None)] * len(key)
            where[d] = slice(a - key[d][0], b - key[d][0])
            np.copyto(block[tuple(where)], part, casting="unsafe")
        blocks[device] = done[key] = block
    return from_blocks(blocks, layout, whole, be), sum(b.nbytes for b in done.values())


def _names_of(source: Any) -> list[str]:
    from ..fusion import Concat, Slice

    if isinstance(source, Concat):
        return list(source.names)
    if isinstance(source, Slice):
        return [source.name]
    return [source]


def _by_rule(
    ckpt: Checkpoint, rules: Any, logical_axes: Any, mesh: Mesh | None, strict: bool
) -> dict[str, Layout]:
    """``{name: Layout}`` for every tensor of ``ckpt`` by a LayoutMap or AxisRules (no rule:
    replicated); rule keys matching no tensor refused (``strict``) or warned of."""
    from ..rules import Resolver

    try:
        rules_of = Resolver(rules, mesh, logical_axes, "load()")
    except UnimeshError as exc:
        raise CheckpointError(str(exc)) from None
    out = {}
    for name in ckpt.tensors:
        layout = rules_of.layout(name)
        out[name] = layout if layout is not None else Layout(rules_of.mesh, PartitionSpec())
    try:
        rules_of.unmatched(ckpt.names, strict, "tensor of the checkpoint",
                           "The checkpoint's tensor names", stacklevel=5)  # fmt: skip
    except UnimeshError as exc:
        raise CheckpointError(str(exc)) from None
    return out


def load(
    path: str | os.PathLike[str],
    target: Any,
    *,
    strict: bool = True,
    dtype: Any = None,
    backend: Any = None,
    mesh: Mesh | None = None,
    logical_axes: Any = None,
    stats: dict[str, int] | None = None,
    verify: bool = False,
    sources: Mapping[str, Any] | None = None,
) -> Any:
    """The checkpoint's tensors laid out as ``target`` says, as the backend's distributed
    arrays in ``target``'s tree. ``target`` is a pytree whose leaves are :class:`Layout` s
    (shape and dtype from the checkpoint) or native distributed arrays (loaded into their
    layout; shape and dtype must match); or a :class:`LayoutMap` (or :class:`AxisRules` with
    ``mesh`` and ``logical_axes``, as :func:`unimesh.shard_params` takes them): every tensor
    of the checkpoint laid out by its name (unmatched: replicated), returned as a dict by
    name. Each process reads only the byte runs of the blocks its devices hold. ``strict``:
    every tensor of ``target`` must be in the checkpoint, and every key of a rule target must
    match a tensor (False: missing ones are left as given, unmatched keys warned of).
    ``dtype`` casts on purpose; otherwise a dtype differing from a native target's is an
    error, never a silent cast. ``stats`` (a dict) receives ``bytes_read`` (from data files)
    and ``bytes_held`` (of the distinct blocks this process's devices hold). ``verify=True``
    checks the checksum of every saved box a block comes from (reading those boxes whole, so
    more than the blocks' bytes). A numpy leaf is read whole, as numpy.

    ``sources`` maps a target name to what it is read from: a saved name (a rename),
    :class:`~unimesh.Concat` (a fused qkv from saved q, k, v) or :class:`~unimesh.Slice` (q
    from a saved qkv), each block read run by run from the saved tensors, never whole.

    ``target`` may also be a framework's model (a torch ``nn.Module``, a Keras model, an
    ``mlx.nn.Module``): each of its arrays is loaded in its own layout (no gather) and
    written into the model in place, which is returned."""
    from ..convert import from_blocks
    from ..fusion import check_sources
    from ..rules import AxisRules, LayoutMap

    try:
        made_of = check_sources(sources)
    except UnimeshError as exc:
        raise CheckpointError(str(exc)) from None
    as_model = model_state(target, backend)
    if as_model is not None:  # a model: its arrays loaded in their layouts, then written into it
        be, state = as_model
        values = load(path, state, strict=strict, dtype=dtype, backend=be, stats=stats,
                      verify=verify)  # fmt: skip
        be.model_assign(target, {k: v for k, v in values.items() if v is not state[k]})
        return target
    with open_checkpoint(path, verify=verify) as ckpt:  # its data files closed at the end
        if isinstance(target, (LayoutMap, AxisRules)):
            target = _by_rule(ckpt, target, logical_axes, mesh, strict)
        names, leaves, treedef = flatten(target)
        # every leaf checked and planned before any byte is read
        unknown = sorted(set(made_of) - set(names))
        if unknown:
            raise CheckpointError(
                f"sources names targets {unknown} that the target does not have (targets: "
                f"{short(names, 200)})"
            )
        fused = {n: v for n, v in made_of.items() if not isinstance(v, str)}
        renamed = {n: v for n, v in made_of.items() if isinstance(v, str)}
        plans = [plan_leaf(ckpt, name, leaf, backend, dtype, strict, renamed.get(name))
                 for name, leaf in zip(names, leaves) if name not in fused]  # fmt: skip
        made_fused = {
            name: _load_fused(ckpt, name, leaf, fused[name], backend, dtype)
            for name, leaf in zip(names, leaves)
            if name in fused
        }
        out = []
        held = sum(n for _, n in made_fused.values())
        memo: dict[Any, Any] = {}
        by_name = {p.name: p for p in plans}
        for name in names:
            if name in made_fused:
                out.append(made_fused[name][0])
                continue
            plan = by_name[name]
            t, cast = plan.tensor, plan.cast
            _plan_reads(ckpt, plan, memo)
            if t is None:  # not in the checkpoint (strict=False): left as given
                out.append(plan.leaf)
            elif plan.be is None:  # a host array: read whole, as numpy
                whole = ckpt.read(t.name)
                out.append(whole if cast is None else whole.astype(cast))
                held += whole.nbytes
            elif _fill_in_place(ckpt, plan):  # the target's own memory holds the values now
                out.append(plan.leaf)
                held += plan.held_bytes()
            else:
                be, layout = plan.be, plan.layout
                assert layout is not None
                together = (  # within the memory bound; a cast would hold both copies
                    cast is None
                    and ckpt.reads_runs(t)
                    and len(set(plan.keys.values())) > 1
                    and plan.held_bytes() <= TOGETHER_MAX
                )
                blocks = LazyBlocks(
                    plan.keys,
                    functools.partial(_read_block, ckpt, plan),
                    functools.partial(_read_blocks, ckpt, plan) if together else None,
                )
                made = from_blocks(blocks, layout, t.shape, be)
                wanted = t.dtype if cast is None else dtype_name(cast)
                got = dtype_text(getattr(made, "dtype", wanted))
                if got != wanted:  # the framework changed it (JAX without x64 keeps no int64)
                    raise CheckpointError(
                        f"tensor {plan.name!r} is {wanted}, but the {be.name} backend made it "
                        f"{got}: the framework cannot hold {wanted} as configured (for JAX: "
                        "jax.config.update('jax_enable_x64', True)); pass dtype= to cast on "
                        "purpose"
                    )
                out.append(made)
                held += plan.held_bytes()
            plan.parts = None  # read: its parts are not kept through the rest of the load
        if stats is not None:
            stats["bytes_read"] = ckpt.bytes_read
            stats["bytes_held"] = held
        import optree

        return optree.tree_unflatten(treedef, out)
