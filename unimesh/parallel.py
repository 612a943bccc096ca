"""Programs on a mesh: ``shard_map``, axis collectives, parameter sharding, gathering.

The meaning is JAX's ``jax.shard_map``: the function sees each device's block of every input
(the block :meth:`Layout.shard_slices` names), and the blocks it returns are put back together
as ``out_specs`` say; a mesh axis missing from an output spec promises the value is the same
along that axis. Inside the function, :func:`psum`, :func:`pmean`, :func:`pmax`, :func:`pmin`,
:func:`all_gather`, :func:`axis_index` and :func:`axis_size` work over mesh axes by name, on
every backend that declares ``shard_map``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

from ._validate import short
from .backend import Backend
from .errors import AxisContextError, LayoutError
from .layout import AxisRules, Layout, LayoutMap, PartitionSpec
from .mesh import Mesh

__all__ = [
    "AxisEnv",
    "all_gather",
    "axis_index",
    "axis_size",
    "full_array",
    "pmax",
    "pmean",
    "pmin",
    "psum",
    "shard_map",
    "shard_params",
]


class AxisEnv:
    """What a backend provides inside :func:`shard_map`: the collectives over mesh axes.

    ``axes`` is always a non-empty tuple of distinct axis names of :attr:`mesh` (checked by the
    core). A backend overrides :meth:`reduce`, :meth:`all_gather` and, where it is not this
    device's coordinate, :meth:`axis_index`. The default :meth:`reduce` of several axes reduces
    over one axis after another (sum, max and min are associative).
    """

    def __init__(self, mesh: Mesh, device: int | None = None) -> None:
        self.mesh = mesh
        #: this process's logical device id, where one device runs the function (torch, MLX)
        self.device = device
        self._checked: dict[Any, tuple[str, ...]] = {}

    def axes(self, axis: Any, call: str) -> tuple[str, ...]:
        """``axis`` (a name or a sequence of names) checked against the mesh, as a tuple."""
        try:
            return self._checked[axis]
        except (KeyError, TypeError):  # TypeError: an unhashable sequence (a list)
            names = self.mesh._axes(axis, f"{call}() axis")
            if isinstance(axis, (str, tuple)):
                self._checked[axis] = names
            return names

    def reduce(self, x: Any, axes: tuple[str, ...], op: str) -> Any:
        """``op`` ("sum", "max" or "min") over the devices that differ only along ``axes``."""
        for axis in axes:
            x = self.reduce_one(x, axis, op)
        return x

    def reduce_one(self, x: Any, axis: str, op: str) -> Any:
        raise NotImplementedError

    def all_gather(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        """Every member's ``x`` in the order of their index along ``axes`` (row-major)."""
        raise NotImplementedError

    def axis_index(self, axes: tuple[str, ...]) -> Any:
        """This device's row-major index along ``axes``."""
        if self.device is None:
            raise NotImplementedError
        coords = self.mesh.coords(self.device)
        index = 0
        for axis in axes:
            index = index * self.mesh.axis_size(axis) + coords[axis]
        return index


_ENV: ContextVar[AxisEnv | None] = ContextVar("unimesh_axis_env", default=None)


def _env(call: str, axis: object) -> tuple[AxisEnv, tuple[str, ...]]:
    env = _ENV.get()
    if env is None:
        raise AxisContextError(
            f"unimesh.{call}({axis!r}) was called outside unimesh.shard_map; call it inside the "
            "function given to unimesh.shard_map(f, mesh, in_specs, out_specs)")
    return env, env.axes(axis, call)


def psum(x: Any, axis: str | Sequence[str]) -> Any:
    """The sum of ``x`` over the devices along ``axis`` (a name or a tuple of names)."""
    env, axes = _env("psum", axis)
    return env.reduce(x, axes, "sum")


def pmean(x: Any, axis: str | Sequence[str]) -> Any:
    """The mean of ``x`` over the devices along ``axis``."""
    env, axes = _env("pmean", axis)
    return env.reduce(x, axes, "sum") / math.prod(env.mesh.axis_size(a) for a in axes)


def pmax(x: Any, axis: str | Sequence[str]) -> Any:
    """The elementwise maximum of ``x`` over the devices along ``axis``."""
    env, axes = _env("pmax", axis)
    return env.reduce(x, axes, "max")


def pmin(x: Any, axis: str | Sequence[str]) -> Any:
    """The elementwise minimum of ``x`` over the devices along ``axis``."""
    env, axes = _env("pmin", axis)
    return env.reduce(x, axes, "min")


def all_gather(x: Any, axis: str | Sequence[str], dim: int = 0, tiled: bool = True) -> Any:
    """Every device's ``x`` along ``axis``, in the order of their index along it.

    ``tiled=True`` concatenates the pieces along ``dim``; ``tiled=False`` stacks them in a new
    dimension at ``dim`` (``jax.lax.all_gather``'s meaning).
    """
    env, axes = _env("all_gather", axis)
    ndim = len(getattr(x, "shape", ()))
    top = ndim if not tiled else ndim - 1
    if tiled and ndim == 0:
        raise LayoutError("all_gather(tiled=True) needs an array with at least one dim to "
                          "concatenate along; use tiled=False for scalars")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -top - 1 <= dim <= top:
        raise LayoutError(f"all_gather dim must be an int in [{-top - 1}, {top}] for an array of "
                          f"{ndim} dims (tiled={tiled}), got {short(dim)}")
    if dim < 0:
        dim += top + 1
    return env.all_gather(x, axes, dim, bool(tiled))


def axis_index(axis: str | Sequence[str]) -> Any:
    """This device's index along ``axis`` (row-major over a tuple of names): a Python int on
    backends where one process runs one device (torch, MLX), a traced scalar under JAX."""
    env, axes = _env("axis_index", axis)
    return env.axis_index(axes)


def axis_size(axis: str | Sequence[str]) -> int:
    """The number of devices along ``axis`` (the product over a tuple of names)."""
    env, axes = _env("axis_size", axis)
    return math.prod(env.mesh.axis_size(a) for a in axes)


def _layouts(mesh: Mesh, specs: Any, what: str) -> tuple[tuple[Layout, ...], bool]:
    """One Layout per argument/result from a spec or a tuple/list of specs; the flag says
    whether a single spec was given."""
    if isinstance(specs, (PartitionSpec, Layout)) or specs is None:
        specs = (specs,)
        single = True
    elif isinstance(specs, (tuple, list)):
        single = False
    else:
        raise LayoutError(f"{what} must be a P(...) or a tuple of them (one per "
                          f"{'argument' if what == 'in_specs' else 'result'}), got {short(specs)}")
    out = []
    for i, spec in enumerate(specs):
        if isinstance(spec, Layout):
            if spec.mesh != mesh:
                raise LayoutError(f"{what}[{i}] is a layout on {spec.mesh!r}, not on {mesh!r}")
            out.append(spec)
        elif isinstance(spec, PartitionSpec) or spec is None:
            out.append(Layout(mesh, spec if spec is not None else PartitionSpec()))
        else:
            raise LayoutError(f"{what}[{i}] must be a P(...) (None for replicated), got "
                              f"{short(spec)}")
    return tuple(out), single


class _Body:
    """The user's function, run with the backend's :class:`AxisEnv` as the current one."""

    def __init__(self, f: Callable[..., Any], n_out: int, single_out: bool) -> None:
        self.f = f
        self.n_out = n_out
        self.single_out = single_out

    def __call__(self, env: AxisEnv, *blocks: Any) -> Any:
        token = _ENV.set(env)
        try:
            result = self.f(*blocks)
        finally:
            _ENV.reset(token)
        if self.single_out:
            return result
        if not isinstance(result, (tuple, list)) or len(result) != self.n_out:
            raise LayoutError(f"{getattr(self.f, '__name__', 'f')} returned {short(result)}, but "
                              f"out_specs names {self.n_out} results; return a tuple of "
                              f"{self.n_out} arrays")
        return tuple(result)


def shard_map(f: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any,
              backend: str | Backend | None = None) -> Callable[..., Any]:
    """``f`` run on every device's blocks (``jax.shard_map``'s meaning), on any backend.

    Args:
        f: takes one block per argument and returns one block (or a tuple of them) per spec of
            ``out_specs``; it may call :func:`psum` and the other axis collectives.
        mesh: the neutral mesh.
        in_specs: a ``P(...)`` per positional argument (a tuple of them), or one ``P`` for a
            single argument. Arguments are global arrays, or the backend's distributed arrays.
        out_specs: a ``P`` or a tuple of them; a mesh axis an output spec leaves out promises
            that the blocks along it are equal.
        backend: a name or Backend; None detects it (see :func:`unimesh.get_backend`).

    Returns:
        A function of the global arguments that returns the backend's distributed arrays
        (``jax.Array``, torch ``DTensor``, ``unimesh_mlx.MLXArray``).
    """
    from .registry import _check_layout, get_backend

    if not callable(f):
        raise LayoutError(f"shard_map() needs a function, got {short(f)}")
    if not isinstance(mesh, Mesh):
        raise LayoutError(f"shard_map() needs a unimesh.Mesh, got {short(mesh)}")
    ins, _ = _layouts(mesh, in_specs, "in_specs")
    outs, single_out = _layouts(mesh, out_specs, "out_specs")
    be = get_backend(backend)
    be.require("shard_map")
    for layout in ins + outs:
        _check_layout(be, layout)
    body = _Body(f, len(outs), single_out)
    run = be.shard_map(body, mesh, ins, outs, single_out)

    checked: set[tuple[int, tuple[int, ...]]] = set()

    def call(*args: Any) -> Any:
        if len(args) != len(ins):
            raise LayoutError(f"the shard_map of {getattr(f, '__name__', 'f')} takes "
                              f"{len(ins)} argument(s) (one per in_spec), got {len(args)}")
        for i, arg in enumerate(args):  # global shapes; each (argument, shape) checked once
            shape = getattr(arg, "shape", None)
            if shape is not None and (i, tuple(shape)) not in checked:
                _check_even(ins[i], tuple(shape), i)
                checked.add((i, tuple(shape)))
        return run(*args)

    call.__name__ = getattr(f, "__name__", "shard_map")
    call.__doc__ = getattr(f, "__doc__", None)
    return call


def _check_even(layout: Layout, shape: tuple[int, ...], index: int) -> None:
    """shard_map splits every argument into equal blocks (JAX's rule, on every backend)."""
    if len(layout.spec) > len(shape):
        raise LayoutError(f"shard_map argument {index} has shape {shape}, fewer dims than its "
                          f"in_spec {layout.spec!r}")
    if not layout.is_even(shape):
        counts = layout.shard_counts()
        bad = next(d for d, n in enumerate(shape[:len(counts)]) if n % counts[d])
        raise LayoutError(
            f"shard_map argument {index} has shape {shape}: dim {bad} ({shape[bad]}) does not "
            f"split evenly into {counts[bad]} blocks under {layout.spec!r} on {layout.mesh!r}; "
            f"shard_map needs equal blocks: pad dim {bad} to a multiple of {counts[bad]}")


def full_array(array: Any, backend: str | Backend | None = None) -> Any:
    """The whole global value of a backend's distributed array, as a numpy array, on every
    process (``DTensor.full_tensor()``, JAX's process_allgather, MLX world all_gather)."""
    from .registry import _owner, get_backend

    be = get_backend(backend) if backend is not None else _owner(array)
    return be.full_array(array)


def _resolver(rules: LayoutMap | AxisRules, mesh: Mesh | None,
              logical_axes: Any, be: Backend) -> Callable[[str, tuple[int, ...]], Layout]:
    from .registry import _check_layout

    if isinstance(rules, LayoutMap):
        if mesh is not None and mesh != rules.mesh:
            raise LayoutError(f"the layout map is on {rules.mesh!r}, not on mesh={mesh!r}")
        the_mesh = rules.mesh
    elif isinstance(rules, AxisRules):
        if not isinstance(mesh, Mesh):
            raise LayoutError("shard_params() with AxisRules needs mesh=unimesh.Mesh(...), got "
                              f"{short(mesh)}")
        if not callable(logical_axes) and not isinstance(logical_axes, dict):
            raise LayoutError(
                "shard_params() with AxisRules needs logical_axes: a dict {parameter path: "
                "(logical axis names)} or a function of the path, got "
                f"{short(logical_axes)}")
        the_mesh = mesh
    else:
        raise LayoutError(f"shard_params() takes a unimesh.LayoutMap or unimesh.AxisRules, got "
                          f"{short(rules)}")

    def resolve(path: str, shape: tuple[int, ...]) -> Layout:
        if isinstance(rules, LayoutMap):
            layout = rules.get(path)
        else:
            names = logical_axes(path) if callable(logical_axes) else logical_axes.get(path)
            layout = None if names is None else Layout(the_mesh, rules.spec(names, the_mesh))
        if layout is None:
            return Layout(the_mesh, PartitionSpec())
        if len(layout.spec) > len(shape):
            raise LayoutError(f"parameter {path!r} has shape {shape}, but its layout "
                              f"{layout.spec!r} names {len(layout.spec)} dims")
        _check_layout(be, layout)
        if not layout.is_even(shape) and not be.supports("uneven_shards"):
            raise LayoutError(
                f"parameter {path!r} of shape {shape} does not divide evenly under "
                f"{layout.spec!r} on {the_mesh!r}, and backend {be.name!r} needs even shards; "
                "change the rule for it or the mesh axis sizes")
        return layout

    return resolve


def shard_params(model: Any, rules: LayoutMap | AxisRules, *, mesh: Mesh | None = None,
                 logical_axes: Any = None, backend: str | Backend | None = None) -> Any:
    """Every parameter of ``model`` laid out by rule; unmatched parameters are replicated.

    ``rules`` is a :class:`LayoutMap` (patterns matched against each parameter's path with
    ``re.fullmatch``, as Keras does) or :class:`AxisRules` with ``logical_axes`` (a dict or a
    function from parameter path to logical axis names) and ``mesh``. Paths are the framework's
    own: ``fc1.weight`` (torch ``named_parameters``), ``dense/kernel`` (Keras variable paths),
    ``layers.0.weight`` (MLX), ``w1`` / ``block/w`` (JAX pytree keys joined with ``/``).

    torch ``nn.Module``: parameters become DTensors, in place; returns the module. JAX pytree:
    returns a new pytree of ``jax.Array``. Keras model: each variable is re-placed with its
    layout (Keras on JAX), in place. MLX ``nn.Module``: each parameter becomes this process's
    block, in place.
    """
    from .registry import get_backend

    be = get_backend(backend)
    be.require("distribute")
    resolve = _resolver(rules, mesh, logical_axes, be)
    return be.shard_params(model, resolve)
