"""The program contract: what :func:`unimesh.shard_map` hands a backend and what it gets back.

A backend's ``shard_map(body, mesh, ins, outs)`` receives the user's function as a
:class:`Body`, the argument and result specs as :class:`SpecTree` values, and runs the body on
each device's blocks with an :class:`AxisEnv` (its collectives over mesh axes) as the current
one; it returns a function of the global arguments, or a :class:`Program`, which also takes
the arguments already flattened (:meth:`Program.run_flat`). The user-facing calls
(``shard_map``, ``psum`` ...) live in :mod:`unimesh.parallel` and
:mod:`unimesh.collectives`, above this module and :mod:`unimesh.backend`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, cast

from .errors import AxisContextError, LayoutError
from .layout import Layout
from .mesh import Mesh
from .mesh_input import check_axes
from .messages import short
from .spec import PartitionSpec

__all__ = ["STATIC", "AxisEnv", "Body", "Program", "SpecTree", "current_env"]


class AxisEnv:
    """What a backend provides inside :func:`shard_map`: the collectives over mesh axes.

    Every argument reaching these methods has been checked by the core: ``axes`` is a non-empty
    tuple of distinct axis names of :attr:`mesh`, dims are in range and divide as the
    collective needs, ``perm`` is a partial permutation of ``0..n-1``. JAX implements them
    with ``jax.lax``; per-process backends get them from
    :class:`unimesh.process_env.ProcessAxisEnv`.
    """

    def __init__(self, mesh: Mesh, device: int | None = None) -> None:
        self.mesh = mesh
        #: this process's logical device id, where one device runs the function (torch, MLX)
        self.device = device
        self._checked: dict[Any, tuple[str, ...]] = {}
        self._sizes: dict[tuple[str, ...], int] = {}
        #: this device's index along axes, per (device, axes)
        self._indices: dict[tuple[int, tuple[str, ...]], int] = {}
        #: the axes the running function is manual over (None: every axis)
        self.manual: frozenset[str] | None = None

    def axes(self, axis: Any, call: str) -> tuple[str, ...]:
        """``axis`` (a name or a sequence of names) checked against the mesh, as a tuple."""
        try:
            return self._checked[axis]
        except (KeyError, TypeError):  # TypeError: an unhashable sequence (a list)
            names = check_axes(self.mesh.axis_names, axis, f"{call}() axis")
            if isinstance(axis, (str, tuple)):
                self._checked[axis] = names
            return names

    def size(self, axes: tuple[str, ...]) -> int:
        try:
            return self._sizes[axes]
        except KeyError:
            n = self._sizes[axes] = math.prod(self.mesh.axis_size(a) for a in axes)
            return n

    def psum(self, x: Any, axes: tuple[str, ...]) -> Any:
        """The sum over the devices that differ only along ``axes``."""
        raise NotImplementedError

    def pmax(self, x: Any, axes: tuple[str, ...]) -> Any:
        raise NotImplementedError

    def pmin(self, x: Any, axes: tuple[str, ...]) -> Any:
        raise NotImplementedError

    def all_gather(
        self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool, invariant: bool
    ) -> Any:
        """Every member's ``x`` in the order of their index along ``axes`` (row-major)."""
        raise NotImplementedError

    def psum_scatter(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        raise NotImplementedError

    def all_to_all(
        self, x: Any, axes: tuple[str, ...], split_axis: int, concat_axis: int, tiled: bool
    ) -> Any:
        raise NotImplementedError

    def ppermute(self, x: Any, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> Any:
        raise NotImplementedError

    def pbroadcast(self, x: Any, axes: tuple[str, ...], source: int) -> Any:
        raise NotImplementedError

    def axis_index(self, axes: tuple[str, ...]) -> Any:
        """This device's row-major index along ``axes``."""
        if self.device is None:
            raise NotImplementedError
        key = (self.device, axes)
        index = self._indices.get(key)
        if index is None:  # once per axes (the mesh coordinate: half of a 13 us call)
            coords = self.mesh.coords(self.device)
            index = 0
            for axis in axes:
                index = index * self.mesh.axis_size(axis) + coords[axis]
            self._indices[key] = index
        return index


#: the AxisEnv of the body running in this context. A ContextVar, whose ``get`` torch.compile's
#: tracer does not trace: it runs the collective eagerly, where the check_vma tags the engine
#: sets on tensors hold (a traced collective loses them; issue 38).
_CURRENT: ContextVar[AxisEnv | None] = ContextVar("unimesh_axis_env", default=None)


def current_env(call: str, axis: object) -> tuple[AxisEnv, tuple[str, ...]]:
    """The running body's AxisEnv and ``axis`` checked as a tuple of names, for the collective
    ``call``; :class:`~unimesh.AxisContextError` outside :func:`unimesh.shard_map`."""
    env = _CURRENT.get()
    if env is None:
        raise AxisContextError(
            f"unimesh.{call}({short(axis)}) was called outside unimesh.shard_map; call it inside "
            "the function given to unimesh.shard_map(f, mesh, in_specs, out_specs)"
        )
    axes = env.axes(axis, call)
    manual = env.manual
    if manual is not None and not manual.issuperset(axes):
        auto = next(a for a in axes if a not in manual)
        raise AxisContextError(
            f"unimesh.{call}({short(axis)}) names axis {auto!r}, over which the function is "
            f"automatic: shard_map's axis_names is {sorted(manual)}; a collective may use only "
            f"manual axes (add {auto!r} to axis_names)"
        )
    return env, axes


def _is_spec(x: object) -> bool:
    return x is None or isinstance(x, (PartitionSpec, Layout))


class _Static:
    """Where ``in_specs`` has None: the argument leaves below it pass through unchanged
    (``jax.shard_map``'s meaning: not an array to lay out, e.g. a flag or an object)."""

    def __repr__(self) -> str:
        return "None"


#: the marker of a None in_spec in :attr:`SpecTree.tree`
STATIC = _Static()


def _is_layout(x: object) -> bool:
    return x is STATIC or isinstance(x, Layout)


class SpecTree:
    """``in_specs`` or ``out_specs``: a pytree prefix whose leaves are specs (``P``, a Layout,
    or None), each turned into a :class:`Layout` on the mesh. A None out_spec means ``P()``;
    a None in_spec marks static arguments (JAX's meaning): :meth:`for_leaves` gives None for
    the leaves below it, which the backend passes to the function unchanged (an array among
    them is seen whole, as under ``P()``)."""

    def __init__(self, mesh: Mesh, specs: Any, what: str) -> None:
        import optree

        self.what = what
        self.mesh = mesh
        leaves, self.treedef = optree.tree_flatten(specs, is_leaf=_is_spec, none_is_leaf=True)
        layouts = []
        static = []
        for path, spec in zip(optree.treespec_paths(self.treedef), leaves):
            where = what + "".join(f"[{p!r}]" for p in path)
            if isinstance(spec, Layout):
                if spec.mesh != mesh:
                    raise LayoutError(f"{where} is a layout on {spec.mesh!r}, not on {mesh!r}")
                layouts.append(spec)
            elif isinstance(spec, PartitionSpec) or spec is None:
                layouts.append(Layout(mesh, spec if spec is not None else PartitionSpec()))
            else:
                raise LayoutError(
                    f"{where} must be a P(...) (None for replicated), got {short(spec)}"
                )
            static.append(spec is None and what == "in_specs")
        self.layouts = tuple(layouts)
        #: per spec leaf: a None in_spec (its arguments pass through unchanged)
        self.static = tuple(static)
        self.tree = optree.tree_unflatten(
            self.treedef, [STATIC if s else lay for lay, s in zip(self.layouts, static)]
        )
        self._per_leaf: dict[Any, tuple[Layout | None, ...]] = {}

    def map(self, fn: Callable[[Layout], Any]) -> Any:
        """The spec tree with every layout replaced by ``fn(layout)`` (same containers); a
        static in_spec stays None."""
        import optree

        return optree.tree_unflatten(
            self.treedef,
            [None if s else fn(lay) for lay, s in zip(self.layouts, self.static)],
        )

    def for_leaves(self, tree: Any, treedef: Any) -> tuple[Layout | None, ...]:
        """The layout of every leaf of ``tree`` (whose structure is ``treedef``), by prefix;
        None for a leaf below a None in_spec. None nodes of ``tree`` have no leaves, as in
        JAX: an argument that is None takes no spec from the arguments after it."""
        try:
            return self._per_leaf[treedef]
        except KeyError:
            pass
        import optree

        try:
            full = optree.tree_broadcast_prefix(self.tree, tree, is_leaf=_is_layout)
        except ValueError as exc:
            raise LayoutError(
                f"{self.what} {short(self.tree)} is not a prefix of the "
                f"{'arguments' if self.what == 'in_specs' else 'results'} {short(tree)}: "
                f"{str(exc).splitlines()[0]}"
            ) from None
        layouts: tuple[Layout | None, ...] = tuple(
            v if isinstance(v, Layout) else None
            for v in optree.tree_leaves(full, is_leaf=_is_layout)
        )
        self._per_leaf[treedef] = layouts
        return layouts


class Body:
    """The user's function, run with the backend's :class:`AxisEnv` as the current one; its
    result must have ``out_specs`` as a prefix (checked here, for every backend)."""

    def __init__(self, f: Callable[..., Any], outs: SpecTree) -> None:
        self.f = f
        self.outs = outs
        #: per-process engines check that processes agree on every collective (shard_map)
        self.checked = False
        #: the axes the function is manual over (``axis_names``); None: every axis
        self.manual: frozenset[str] | None = None
        #: JAX's check_vma flag: False runs JAX's unchecked rules
        self.check_vma = True

    def __call__(self, env: AxisEnv, *blocks: Any) -> Any:
        return self.flat(env, *blocks)[0]

    def flat(self, env: AxisEnv, *blocks: Any) -> tuple[Any, list[Any], Any, tuple[Layout, ...]]:
        """The result, its leaves, its treedef and the out layout of every leaf."""
        import optree

        outer, env.manual = env.manual, self.manual  # a program inside a program's body
        token = _CURRENT.set(env)
        try:
            result = self.f(*blocks)
        finally:
            _CURRENT.reset(token)
            env.manual = outer
        leaves, treedef = optree.tree_flatten(result)
        outs = self.outs.for_leaves(result, treedef)  # out_specs have no static leaves
        return result, leaves, treedef, cast("tuple[Layout, ...]", outs)


class Program:
    """What a per-process backend's ``shard_map`` may return instead of a plain function: a
    callable of the global arguments that also takes them already flattened, so
    :func:`unimesh.shard_map`, which flattens them to check their shapes, does not flatten
    them twice."""

    def __call__(self, *args: Any) -> Any:
        raise NotImplementedError

    def run_flat(self, leaves: list[Any], treedef: Any, layouts: tuple[Layout | None, ...]) -> Any:
        """The program on the arguments' leaves (of tree ``treedef``) laid out as ``layouts``
        (None for a leaf below a None in_spec)."""
        raise NotImplementedError
