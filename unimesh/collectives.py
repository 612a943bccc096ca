"""The collectives a :func:`unimesh.shard_map` body calls over mesh axes by name, with
``jax.lax``'s meaning on every backend that declares ``shard_map``: :func:`psum`, :func:`pmean`,
:func:`pmax`, :func:`pmin`, :func:`psum_scatter`, :func:`all_gather`, :func:`all_to_all`,
:func:`ppermute`, :func:`pbroadcast`, :func:`axis_index`, :func:`axis_size`. Each checks its
arguments here, once for every backend, and hands the running body's axis env the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import LayoutError
from .messages import short
from .program import current_env

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pbroadcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in getattr(x, "shape", ()))


def _dim(value: object, ndim: int, what: str, call: str) -> int:
    """``value`` as a dim of an array with ``ndim`` dims (negative counts from the end)."""
    if isinstance(value, bool) or not isinstance(value, int) or not -ndim <= value < ndim:
        raise LayoutError(
            f"{call}() {what} must be an int in [{-ndim}, {ndim - 1}] for an array "
            f"of {ndim} dims, got {short(value)}"
        )
    return value % ndim


def _divides(
    x: Any, dim: int, n: int, tiled: bool, call: str, axes: tuple[str, ...], what: str
) -> None:
    size = _shape(x)[dim]
    if tiled and size % n:
        raise LayoutError(
            f"{call}() over {axes} splits {what} {dim} (size {size}) into {n} "
            f"blocks, one per device: {size} is not a multiple of {n}"
        )
    if not tiled and size != n:
        raise LayoutError(
            f"{call}(tiled=False) over {axes} needs {what} {dim} to have one entry "
            f"per device ({n}), got size {size}; pass tiled=True to split it into "
            "blocks"
        )


def psum(x: Any, axis_name: str | Sequence[str]) -> Any:
    """The sum of ``x`` over the devices along ``axis_name`` (a name or a tuple of names)."""
    env, axes = current_env("psum", axis_name)
    return env.psum(x, axes)


def pmean(x: Any, axis_name: str | Sequence[str]) -> Any:
    """The mean of ``x`` over the devices along ``axis_name``."""
    env, axes = current_env("pmean", axis_name)
    return env.psum(x, axes) / env.size(axes)


def pmax(x: Any, axis_name: str | Sequence[str]) -> Any:
    """The elementwise maximum of ``x`` over the devices along ``axis_name``. Like ``jax.lax.pmax``
    it has no derivative: stop the gradient before it (``.detach()``, ``stop_gradient``)."""
    env, axes = current_env("pmax", axis_name)
    return env.pmax(x, axes)


def pmin(x: Any, axis_name: str | Sequence[str]) -> Any:
    """The elementwise minimum of ``x`` over the devices along ``axis_name`` (no derivative)."""
    env, axes = current_env("pmin", axis_name)
    return env.pmin(x, axes)


def all_gather(
    x: Any,
    axis_name: str | Sequence[str],
    dim: int = 0,
    tiled: bool = True,
    to: str = "varying",
    *,
    axis: int | None = None,
) -> Any:
    """Every device's ``x`` along ``axis_name``, in the order of their index along it.

    ``tiled=True`` concatenates the pieces along ``dim``; ``tiled=False`` stacks them in a new
    dimension at ``dim`` (``jax.lax.all_gather``'s meaning). ``to="varying"`` (JAX's default)
    differentiates to a reduce-scatter; ``to="invarying"`` tells JAX the result is equal along
    ``axis_name``, so an out_spec may leave the axis out (``jax.lax.all_gather(..., to=...)``).
    ``axis=`` is JAX's name for ``dim``. Unlike ``jax.lax.all_gather``, ``tiled`` is True by
    default (torch's ``all_gather_into_tensor``): pass it explicitly when porting JAX code.
    """
    env, axes = current_env("all_gather", axis_name)
    if axis is not None:
        if dim not in (0, axis):
            raise LayoutError(
                f"all_gather() got dim={short(dim)} and axis={short(axis)}: axis is JAX's name "
                "for dim, pass one of them"
            )
        dim = axis
    ndim = len(_shape(x))
    if tiled and ndim == 0:
        raise LayoutError(
            "all_gather(tiled=True) needs an array with at least one dim to "
            "concatenate along; use tiled=False for scalars"
        )
    if to not in ("varying", "invarying"):
        raise LayoutError(f"all_gather to= must be 'varying' or 'invarying', got {short(to)}")
    d = _dim(dim, ndim if tiled else ndim + 1, "dim", "all_gather")
    return env.all_gather(x, axes, d, bool(tiled), to == "invarying")


def psum_scatter(
    x: Any, axis_name: str | Sequence[str], scatter_dimension: int = 0, tiled: bool = False
) -> Any:
    """The sum over ``axis_name`` of ``x``, of which each device keeps its own block of dim
    ``scatter_dimension`` (a reduce-scatter, ``jax.lax.psum_scatter``'s meaning): with
    ``tiled=False`` that dim has one entry per device and disappears; with ``tiled=True`` it is
    split into equal blocks, the device at index ``i`` keeping block ``i``."""
    env, axes = current_env("psum_scatter", axis_name)
    ndim = len(_shape(x))
    if ndim == 0:
        raise LayoutError("psum_scatter() needs an array with a dim to scatter, got a scalar")
    d = _dim(scatter_dimension, ndim, "scatter_dimension", "psum_scatter")
    _divides(x, d, env.size(axes), bool(tiled), "psum_scatter", axes, "scatter_dimension")
    return env.psum_scatter(x, axes, d, bool(tiled))


def all_to_all(
    x: Any, axis_name: str | Sequence[str], split_axis: int, concat_axis: int, tiled: bool = False
) -> Any:
    """Each device splits dim ``split_axis`` into one block per device along ``axis_name``, sends
    block ``j`` to the device at index ``j``, and puts what it receives along ``concat_axis`` in
    the senders' order (``jax.lax.all_to_all``'s meaning: with ``tiled=False`` the split dim
    has one entry per device and a new dim of that size appears at ``concat_axis``)."""
    env, axes = current_env("all_to_all", axis_name)
    ndim = len(_shape(x))
    if ndim == 0:
        raise LayoutError("all_to_all() needs an array with a dim to split, got a scalar")
    s = _dim(split_axis, ndim, "split_axis", "all_to_all")
    c = _dim(concat_axis, ndim, "concat_axis", "all_to_all")
    _divides(x, s, env.size(axes), bool(tiled), "all_to_all", axes, "split_axis")
    return env.all_to_all(x, axes, s, c, bool(tiled))


def _perm(perm: object, n: int) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((src, dst) for src, dst in perm)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise LayoutError(
            f"ppermute perm must be a sequence of (source, destination) index "
            f"pairs, got {short(perm)}"
        ) from None
    for src, dst in pairs:
        for v in (src, dst):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
                raise LayoutError(
                    f"ppermute perm pair {short((src, dst))}: indices must be ints "
                    f"in [0, {n - 1}] (the axis has {n} devices)"
                )
    for k, what in ((0, "source"), (1, "destination")):
        seen = [p[k] for p in pairs]
        if len(set(seen)) != len(seen):
            dup = next(v for v in seen if seen.count(v) > 1)
            raise LayoutError(
                f"ppermute perm is not a permutation: {what} {dup} appears more "
                f"than once in {short(perm)}"
            )
    return pairs


def ppermute(x: Any, axis_name: str | Sequence[str], perm: Sequence[tuple[int, int]]) -> Any:
    """Send ``x`` from the device at index ``src`` to the one at ``dst`` for every pair of
    ``perm`` (indices along ``axis_name``); a device no pair sends to gets zeros
    (``jax.lax.ppermute``'s meaning)."""
    env, axes = current_env("ppermute", axis_name)
    n = env.size(axes)
    pairs: tuple[Any, ...] | None
    try:  # a step passes the same perm at every call: checked once
        pairs = tuple((src, dst) for src, dst in perm)
        known = (pairs, n) in _PERMS and all(type(a) is int and type(b) is int for a, b in pairs)
    except (TypeError, ValueError):
        pairs, known = None, False
    if not known:
        given = perm if pairs is None or isinstance(perm, (list, tuple)) else pairs
        checked = _perm(given, n)
        if len(_PERMS) < 4096:
            _PERMS.add((checked, n))
        return env.ppermute(x, axes, checked)
    return env.ppermute(x, axes, pairs)  # type: ignore[arg-type]


#: (pairs, axis size) that passed _perm (only tuples of Python ints get here, so they hash)
_PERMS: set[tuple[tuple[tuple[int, int], ...], int]] = set()


def pbroadcast(x: Any, axis_name: str | Sequence[str], source: int) -> Any:
    """The value of ``x`` on the device at index ``source`` along ``axis_name``, on every device of
    the axis (``jax.lax.pbroadcast``'s meaning; its gradient flows back to the source)."""
    env, axes = current_env("pbroadcast", axis_name)
    n = env.size(axes)
    if isinstance(source, bool) or not isinstance(source, int) or not 0 <= source < n:
        raise LayoutError(
            f"pbroadcast source must be an index in [0, {n - 1}] along {axes}, got {short(source)}"
        )
    return env.pbroadcast(x, axes, source)


def axis_index(axis_name: str | Sequence[str]) -> Any:
    """This device's index along ``axis_name`` (row-major over a tuple of names): a traced
    scalar under JAX, a 0-d tensor on torch (tagged as varying along the axis), a Python int
    on MLX."""
    env, axes = current_env("axis_index", axis_name)
    return env.axis_index(axes)


def axis_size(axis_name: str | Sequence[str]) -> int:
    """The number of devices along ``axis_name`` (the product over a tuple of names)."""
    env, axes = current_env("axis_size", axis_name)
    return env.size(axes)
