"""Conversions between the neutral objects and each framework's: :func:`to_native`,
:func:`from_native`, :func:`distribute`, :func:`from_local`, :func:`local_shards`, and the
checks every backend shares before it is handed a mesh or a layout (:func:`require_mesh`,
:func:`require_layout`). The backend is found by :mod:`unimesh.registry`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .backend import Backend
from .errors import ConversionError, LayoutError, UnimeshError, UnsupportedError
from .layout import Layout
from .mesh import Mesh
from .messages import short
from .registry import REGISTRY, get_backend, owner_of
from .rules import LayoutMap
from .spec import PartitionSpec

__all__ = [
    "distribute",
    "from_local",
    "from_native",
    "layout_of",
    "local_shards",
    "require_layout",
    "require_mesh",
    "to_native",
]


def require_mesh(backend: Backend, mesh: Mesh) -> None:
    """Refuse a mesh of more axes than the backend's framework holds (``max_mesh_axes``), on
    every path that hands a mesh to it, before the framework is called."""
    limit = backend.max_mesh_axes
    if limit is not None and mesh.ndim > limit:
        raise UnsupportedError(
            f"{mesh.ndim} axes is more than a {backend.framework} mesh holds ({limit}); "
            "flatten some axes (Mesh.flatten) or drop size-1 axes",
            backend=backend.name,
        )


def require_layout(backend: Backend, layout: Any) -> None:
    """Raise :class:`~unimesh.UnsupportedError` unless ``backend`` supports what ``layout``
    needs (layouts, tuple axes, pending reductions): the checks shared by every backend."""
    backend.require("layout")
    require_mesh(backend, layout.mesh)
    spec = layout.spec
    if any(isinstance(e, tuple) for e in spec):
        backend.require(
            "tuple_axes",
            f"spec {spec!r} splits one dim over several axes; merge "
            "them into one axis with Mesh.flatten(axes, name) and use that name",
        )
    if spec.partial:
        backend.require("partial", f"spec {spec!r} has pending reductions")


#: (backend name, Layout) -> its native object, for backends whose native layouts are immutable
#: values (``Backend.native_layouts_immutable``): a layout converted again costs a dict lookup
_NATIVE_LAYOUTS: dict[tuple[str, Layout], tuple[PartitionSpec, Any]] = {}
_NATIVE_LAYOUTS_MAX = 4096


def to_native(obj: Any, backend: str | Backend | None = None, **options: Any) -> Any:
    """A neutral Mesh, Layout or LayoutMap as the backend's own object.

    ``options`` go to the backend (e.g. ``device_type`` for torch).
    """
    if type(obj) is Layout and type(backend) is str and not options:
        hit = _NATIVE_LAYOUTS.get((backend, obj))
        # checked and converted before: the same immutable object, if the spec is spelled the
        # same (P() and P(None) are one layout, but the native spec keeps the spelling)
        if hit is not None and (hit[0] is obj.spec or hit[0] == obj.spec):
            return hit[1]
    if not isinstance(obj, (Mesh, Layout, LayoutMap)):
        raise ConversionError(
            f"to_native() takes a unimesh Mesh, Layout or LayoutMap, got {short(obj)} "
            f"({type(obj).__name__})"
        )
    be = get_backend(backend)
    if isinstance(obj, Mesh):
        require_mesh(be, obj)
        be.require("mesh")
        return be.mesh_to_native(obj, **options)
    if isinstance(obj, Layout):
        require_layout(be, obj)
        native = be.layout_to_native(obj, **options)
        if be.native_layouts_immutable and type(backend) is str and not options:
            if len(_NATIVE_LAYOUTS) >= _NATIVE_LAYOUTS_MAX:
                _NATIVE_LAYOUTS.clear()
            _NATIVE_LAYOUTS[(backend, obj)] = (obj.spec, native)
        return native
    require_mesh(be, obj.mesh)  # (a layout's mesh is checked by require_layout)
    be.require("layout_map")
    for layout in obj.values():
        require_layout(be, layout)
    return be.layout_map_to_native(obj, **options)


def from_native(obj: Any) -> Any:
    """A framework's mesh/layout object as the neutral Mesh or Layout (unimesh objects pass
    through). The backend is found from the object's type; nothing new is imported."""
    from .layout import Layout
    from .mesh import Mesh
    from .rules import LayoutMap

    if isinstance(obj, (Mesh, Layout, LayoutMap)):
        return obj
    loaded = REGISTRY.all_loaded()
    for be in loaded:
        if be.owns(obj):
            return be.from_native(obj)
    raise ConversionError(
        f"from_native() got {short(obj)} ({type(obj).__module__}.{type(obj).__qualname__}), "
        f"which no installed backend converts (installed: {[b.name for b in loaded]})"
    )


def layout_of(array: Any) -> tuple[Backend, Layout] | None:
    """``(backend, layout)`` of a backend's distributed array: an MLX array's ``layout``, a
    DTensor's placements, a ``jax.Array``'s (or Keras variable's) sharding; None for anything
    else (a numpy array, a framework's plain tensor, a tracer). The owning backend is found
    once, from the array's type; nothing new is imported."""
    import numpy as np

    if array is None or isinstance(array, (np.ndarray, Layout, Mesh, LayoutMap)):
        return None
    try:
        be = owner_of(array)
    except ConversionError:
        return None
    found = getattr(array, "layout", None)
    if isinstance(found, Layout):
        return be, found
    for obj in (  # a sharding first: a refused array's message would print the array
        getattr(array, "sharding", None),
        getattr(getattr(array, "value", None), "sharding", None),
        array,
    ):
        if obj is None:
            continue
        try:
            got = from_native(obj)
        except UnimeshError:
            continue
        if isinstance(got, Layout):
            return be, got
    return None


def from_local(
    local: Any,
    layout: Any,
    global_shape: Any,
    backend: str | Backend | None = None,
    *,
    dtype: Any = None,
    **options: Any,
) -> Any:
    """The native distributed array of shape ``global_shape`` laid out as ``layout``, built from
    this process's own data only (the inverse of :func:`local_shards`; torch
    ``DTensor.from_local``, JAX ``make_array_from_single_device_arrays``).

    ``local`` is either ``{device id: block}`` for every device of the mesh this process holds
    (the form :func:`local_shards` returns), or one array: this process's part of the global
    array, the box its devices' blocks tile (a data loader's slice of the batch; JAX's
    ``make_array_from_process_local_data``). Every block must have the shape the layout gives
    its device (:meth:`Layout.shard_slices`); nothing is exchanged between processes, and
    blocks that the layout replicates are trusted to be equal. ``dtype`` (the framework's, or
    numpy's) types the array on a process that holds none of the mesh's devices.
    """
    from ._validate import check_int

    if not isinstance(layout, Layout):
        raise LayoutError(
            f"from_local() needs a unimesh.Layout, got {short(layout)}; build one "
            "with unimesh.Layout(mesh, P(...))"
        )
    if isinstance(global_shape, (str, bytes)) or not isinstance(global_shape, (tuple, list)):
        raise LayoutError(
            f"from_local() needs global_shape, a tuple of ints, got {short(global_shape)}"
        )
    shape = tuple(
        check_int(n, f"global_shape[{i}]", minimum=0, cls=LayoutError)
        for i, n in enumerate(global_shape)
    )
    if len(shape) < len(layout.spec):
        raise LayoutError(
            f"global_shape {shape} has {len(shape)} dims, but {layout.spec!r} names "
            f"{len(layout.spec)}"
        )
    be = placing_backend(backend, "from_local", layout, shape)
    mine = tuple(be.process_devices(layout.mesh))
    lo, hi = layout.shard_bounds(shape, list(mine))  # each local device's block, once
    blocks = _local_blocks(local, layout, shape, mine, lo, hi)
    for d, r0, r1 in zip(mine, lo.tolist(), hi.tolist()):
        got = tuple(getattr(blocks[d], "shape", ()))
        want = tuple(b - a for a, b in zip(r0, r1))
        if got != want:
            raise LayoutError(
                f"the block for device {d} has shape {got}, but {layout!r} gives device {d} the "
                f"block {_text_bounds(r0, r1)} of the global {shape}, of shape {want}"
            )
    return be.from_local(blocks, layout, shape, dtype, **options)


def local_shards(array: Any, backend: str | Backend | None = None) -> dict[int, Any]:
    """This process's blocks of a native distributed array, ``{device id: numpy block}``: what
    :func:`from_local` takes back. The backend is found from the array's type unless given."""
    be = get_backend(backend) if backend is not None else owner_of(array)
    be.require("distribute")
    return be.local_shards(array)


def _text_bounds(start: list[int], stop: list[int]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(start, stop)) + "]"


def _local_blocks(
    local: Any,
    layout: Any,
    shape: tuple[int, ...],
    mine: tuple[int, ...],
    lo: Any,
    hi: Any,
) -> dict[int, Any]:
    """``local`` as {device id: block} for exactly this process's devices ``mine``, whose
    blocks start at the rows of ``lo`` and stop at those of ``hi``."""
    import numpy as np

    if isinstance(local, Mapping):
        keys = list(local)
        held = set(mine)
        extra = [k for k in keys if k not in held]
        missing = [d for d in mine if d not in local]
        if extra or missing:
            raise LayoutError(
                f"from_local() got blocks for devices {short(sorted(keys, key=str), 80)}, but "
                f"this process holds devices {short(list(mine), 80)} of {layout.mesh!r}"
                + (f"; missing {short(missing, 60)}" if missing else "")
                + (f"; not this process's: {short(extra, 60)}" if extra else "")
            )
        return dict(local)
    if getattr(local, "shape", None) is None:
        raise ConversionError(
            f"from_local() takes an array or a dict {{device id: block}}, got {short(local)}"
        )
    if not mine:
        raise LayoutError(
            f"this process holds no device of {layout.mesh!r}, so it has no block to give; "
            "pass {} (an empty dict)"
        )
    if len(mine) == 1:
        return {mine[0]: local}
    start, stop = lo.min(axis=0), hi.max(axis=0)
    box = tuple(int(b - a) for a, b in zip(start.tolist(), stop.tolist()))
    distinct = {(tuple(a), tuple(b)) for a, b in zip(lo.tolist(), hi.tolist())}
    tiled = sum(int(np.prod(np.subtract(b, a))) for a, b in distinct) == int(np.prod(box))
    if not tiled:
        raise LayoutError(
            f"this process's devices {short(list(mine), 60)} hold blocks of {shape} under "
            f"{layout!r} that do not tile one box, so one array cannot hold them; pass a dict "
            "{device id: block} instead"
        )
    got = tuple(local.shape)
    if got != box:
        where = _text_bounds(start.tolist(), stop.tolist())
        raise LayoutError(
            f"this process's data has shape {got}, but its devices {short(list(mine), 60)} "
            f"hold the box {where} of the global {shape} under {layout!r}, of shape {box}"
        )
    return {
        d: local[tuple(slice(a - s0, b - s0) for a, b, s0 in zip(r0, r1, start.tolist()))]
        for d, r0, r1 in zip(mine, lo.tolist(), hi.tolist())
    }


def from_blocks(
    blocks: Mapping[int, Any], layout: Layout, shape: tuple[int, ...], backend: Backend
) -> Any:
    """:func:`from_local` for a caller that built ``blocks`` itself, one per device of this
    process with the shape the layout gives it (a checkpoint load): the backend and layout are
    checked, the blocks handed over untouched, each taken when the backend asks for it."""
    be = placing_backend(backend, "from_local", layout, shape)
    return be.from_local(blocks, layout, shape, None)


def placing_backend(
    backend: str | Backend | None, capability: str, layout: Layout, shape: tuple[int, ...]
) -> Backend:
    """The backend that lays out an array of ``shape`` as ``layout`` (``capability``:
    ``distribute`` or ``from_local``), checked for the layout's features and, where the shards
    do not divide evenly, for ``uneven_shards``."""
    be = get_backend(backend)
    be.require(capability)
    require_layout(be, layout)
    if not layout.is_even(shape):
        be.require(
            "uneven_shards",
            f"shape {shape} does not divide evenly under {layout.spec!r} on "
            f"{layout.mesh!r}; pad the tensor or choose other axes",
        )
    return be


def distribute(
    array: Any, layout: Any, backend: str | Backend | None = None, **options: Any
) -> Any:
    """A native distributed array laid out as ``layout``: each device holds the block
    ``layout.shard_slices(array.shape, device)``."""
    from .layout import Layout

    if not isinstance(layout, Layout):
        raise LayoutError(
            f"distribute() needs a unimesh.Layout, got {short(layout)}; build one "
            "with unimesh.Layout(mesh, P(...))"
        )
    shape = getattr(array, "shape", None)
    if shape is None:
        raise ConversionError(f"distribute() needs an array with a .shape, got {short(array)}")
    import numpy as np

    dtype = getattr(array, "dtype", None)
    # ml_dtypes' bfloat16 and float8 kinds are numbers too (numpy calls them kind "V")
    numeric = not isinstance(dtype, np.dtype) or (
        dtype.kind in "biufc" or dtype.name == "bfloat16" or dtype.name.startswith("float8")
    )
    if not numeric:
        raise ConversionError(
            f"distribute() lays out arrays of numbers or bools; got one of dtype {dtype} "
            f"({short(array)}); convert it first, e.g. np.asarray(x, np.float32)"
        )
    be = placing_backend(backend, "distribute", layout, tuple(shape))
    return be.distribute(array, layout, **options)
