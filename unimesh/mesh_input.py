"""Reading a mesh's input as a person gives it, each bad value refused by name: the
:class:`~unimesh.Mesh` constructor's arguments, its dict and JSON forms, device ids as nested
lists, numpy arrays or ranges (checked for shape, nesting depth, integer type and range before
numpy sees them, so hostile input fails fast), and axis sizes with one -1 to infer. No
framework."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._validate import (
    MAX_DEVICES,
    as_tuple,
    check_axis_name,
    check_axis_type,
    check_int,
    check_ndim,
    check_size,
    fail,
)
from .messages import close_match, short

__all__ = [
    "DICT_KEYS",
    "axis_position",
    "check_axes",
    "check_mesh_dict",
    "check_nesting",
    "ids_array",
    "is_arange",
    "mesh_fields",
    "mesh_json",
    "resolve_sizes",
]


def check_nesting(value: object, shape: tuple[int, ...], depth: int = 0) -> None:
    """Nested lists of ids must have ``shape``: checked top-down before numpy sees them, so a
    huge, deep or ragged input fails after at most ``prod(shape)`` steps."""
    if not isinstance(value, (list, tuple)):
        return  # a scalar where a list belongs, or an ndarray: numpy's shape check says so
    if depth == len(shape):
        fail(
            f"device_ids nest deeper than the mesh's {len(shape)} dims: {short(value)} stands "
            "where one id belongs"
        )
    if len(value) != shape[depth]:
        seen = str(shape[:depth] + (len(value),))
        if value and isinstance(value[0], (list, tuple)):
            seen = seen.rstrip(",)") + ", ...)"
        fail(
            f"device_ids has shape {seen} but the mesh shape is {shape}; give one id per "
            "device as an array of the mesh's shape, or a flat list of "
            f"{math.prod(shape)} ids read row-major"
        )
    lengths = {len(v) for v in value if isinstance(v, (list, tuple))}
    if len(lengths) > 1 or (
        lengths and len(lengths) == 1 and any(not isinstance(v, (list, tuple)) for v in value)
    ):
        fail(
            f"device_ids {short(value)} is not a rectangular array of ints (rows of different "
            "lengths)"
        )
    for v in value:
        check_nesting(v, shape, depth + 1)


def row_major(value: object, shape: tuple[int, ...]) -> object:
    """A flat list, tuple or 1-D array of ``prod(shape)`` ids, for a mesh of several dims,
    as an array of ``shape`` (row-major); anything else as it is."""
    if len(shape) < 2:
        return value
    size = math.prod(shape)
    if isinstance(value, np.ndarray):
        return value.reshape(shape) if value.ndim == 1 and value.size == size else value
    if (
        isinstance(value, (list, tuple))
        and len(value) == size
        and not any(isinstance(v, (list, tuple, np.ndarray)) for v in value)
    ):
        flat = np.array(value)
        if flat.ndim == 1:
            return flat.reshape(shape)
    return value


def first_chain(value: object, shape: tuple[int, ...]) -> None:
    """O(ndim) check along the first element of each level, so that a list far larger than the
    mesh (a flat list of millions for a 4-device mesh) is refused before numpy copies it."""
    item = value
    for n in shape:
        if not isinstance(item, (list, tuple)):
            return
        if len(item) != n:
            check_nesting(value, shape)  # raises, naming the offending shape
            return
        if not item:
            return
        item = item[0]


def ids_array(device_ids: object, shape: tuple[int, ...]) -> np.ndarray:
    """Validate user device ids (ndarray or nested lists) into a fresh int64 array of ``shape``.

    Linear in the number of ids: numpy reads the nesting (a ragged or too-deep input is walked
    again, in Python, only to name what is wrong), and distinctness is a count of each id, not a
    sort, whenever the ids are compact (max id < 4 * size + 1024). A flat sequence of exactly
    ``prod(shape)`` ids is read row-major, as Keras's ``DeviceMesh`` reads its devices."""
    device_ids = row_major(device_ids, shape)
    first_chain(device_ids, shape)
    try:
        arr = np.array(device_ids)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        check_nesting(device_ids, shape)
        fail(f"device_ids {short(device_ids)} is not a rectangular array of ints ({exc})")
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(np.int64)
        else:
            if arr.dtype == object:
                check_nesting(device_ids, shape)
            fail(f"device_ids must be ints, got {short(device_ids)} (dtype {arr.dtype})")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        fail(f"device_ids {short(device_ids)} holds values larger than int64")
    arr = arr.astype(np.int64, copy=False)
    if arr.shape != shape:
        check_nesting(device_ids, shape)
        fail(
            f"device_ids has shape {arr.shape} but the mesh shape is {shape}; give one id per "
            "device as an array of the mesh's shape, or a flat list of "
            f"{math.prod(shape)} ids read row-major"
        )
    flat = arr.ravel()
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0:
        fail(f"device_ids must be >= 0 (logical positions in the global device order), got {lo}")
    if hi < 4 * flat.size + 1024:
        seen = np.zeros(hi + 1, dtype=np.bool_)
        seen[flat] = True
        if int(np.count_nonzero(seen)) != flat.size:
            counts = np.bincount(flat)
            fail(
                f"device_ids must be distinct, but {int(np.argmax(counts > 1))} appears more "
                "than once"
            )
    else:
        ordered = np.sort(flat)
        dup = ordered[1:][ordered[1:] == ordered[:-1]]
        if dup.size:
            fail(f"device_ids must be distinct, but {int(dup[0])} appears more than once")
    return arr


def is_arange(flat: np.ndarray) -> bool:
    """``flat == arange(flat.size)``, looking at a short prefix first so that a permuted array
    is told apart without a full pass."""
    n = flat.size
    if n == 0 or int(flat[0]) != 0 or int(flat[-1]) != n - 1:
        return n == 0
    head = min(n, 1024)
    if not np.array_equal(flat[:head], np.arange(head)):
        return False
    return bool(np.array_equal(flat, np.arange(n)))


def resolve_sizes(axes: Mapping[str, object], total: int | None, what: str) -> dict[str, int]:
    """Validate name -> size (at most one -1, inferred so the product is ``total``)."""
    out: dict[str, int] = {}
    infer: str | None = None
    for name, size in axes.items():
        check_axis_name(name)
        s = check_int(size, f"size of axis {name!r}")
        if s == -1:
            if infer is not None:
                fail(f"only one axis size may be -1, but {infer!r} and {name!r} both are")
            infer = name
        elif s < 1:
            fail(f"size of axis {name!r} must be a positive int or -1, got {s}")
        out[name] = s
    arith = " x ".join(f"{n}={s}" for n, s in out.items())
    known = math.prod(s for s in out.values() if s != -1)
    if infer is not None:
        if total is None:
            fail(f"axis {infer!r} has size -1, which needs num_devices to infer it from")
        if total % known:
            fail(
                f"cannot infer axis {infer!r}: {arith} leaves {total} / {known}, "
                f"which is not a whole number ({what})"
            )
        out[infer] = total // known
    elif total is not None and known != total:
        fail(
            f"axis sizes {arith} = {known} devices, but {what} has {total}; make the product "
            f"equal {total}"
        )
    check_size(tuple(out.values()))
    return out


def axis_position(names: tuple[str, ...], name: object) -> int:
    """Where the axis ``name`` stands among a mesh's axes ``names``; refused if unknown."""
    if isinstance(name, str) and name in names:
        return names.index(name)
    fail(f"unknown axis {short(name)}{close_match(name, names)}; this mesh's axes are {names}")


def check_axes(names: tuple[str, ...], axes: object, what: str = "axes") -> tuple[str, ...]:
    """A name or a tuple of names given for a mesh with axes ``names``, as a non-empty tuple
    of distinct known axes."""
    given = (axes,) if isinstance(axes, str) else as_tuple(axes, what)
    if not given:
        fail(f"{what} must name at least one axis of {names}")
    for n in given:
        axis_position(names, n)
    if len(set(given)) != len(given):
        fail(f"{what} {given} repeats an axis; name each axis once")
    return given  # type: ignore[return-value]


#: the fields of :meth:`Mesh.to_dict`
DICT_KEYS = ("axis_names", "shape", "device_ids", "axis_types", "devices_per_process")


def mesh_fields(
    shape: object,
    axis_names: object,
    device_ids: object,
    axis_types: object,
    devices_per_process: object,
) -> tuple[tuple[int, ...], tuple[str, ...], np.ndarray | None, tuple[str, ...] | None, int | None]:
    """:class:`~unimesh.Mesh`'s arguments checked, each refused by name: (shape, names, ids
    or None for the default order, axis types or None, devices per process or None)."""
    shape_t = tuple(
        check_int(s, f"mesh shape entry {short(s)}", minimum=1)
        for s in as_tuple(shape, "mesh shape")
    )
    if not shape_t:
        fail("a mesh needs at least one axis; got shape ()")
    check_ndim(len(shape_t))
    names = tuple(check_axis_name(n) for n in as_tuple(axis_names, "axis_names"))
    if len(names) != len(shape_t):
        fail(
            f"axis_names {names} has {len(names)} names but shape {shape_t} has "
            f"{len(shape_t)} axes; give one name per axis"
        )
    seen: set[str] = set()
    for name in names:  # linear, and the message stays short for 20,000 names
        if name in seen:
            fail(
                f"axis name {name!r} appears more than once in {short(names)}; axis names "
                "must be distinct"
            )
        seen.add(name)
    check_size(shape_t)
    ids: np.ndarray | None = None
    if device_ids is not None:
        ids = ids_array(device_ids, shape_t)
        if is_arange(ids.ravel()):
            ids = None  # the default order: keep it implicit (O(1) and equal by value)
        else:
            ids.flags.writeable = False
    types: tuple[str, ...] | None = None
    if axis_types is not None:
        raw = as_tuple(axis_types, "axis_types")
        if len(raw) != len(shape_t):
            fail(f"axis_types {short(raw)} has {len(raw)} entries for {len(shape_t)} axes")
        types = tuple(check_axis_type(t, f"axis_types entry for {n!r}") for t, n in zip(raw, names))
    dpp = None
    if devices_per_process is not None:
        dpp = check_int(devices_per_process, "devices_per_process", minimum=1, maximum=MAX_DEVICES)
    return shape_t, names, ids, types, dpp


def check_mesh_dict(d: object) -> None:
    """Refuse what :meth:`Mesh.from_dict` cannot read, before a huge ``device_ids`` is
    turned into an array: not a dict, unknown or missing fields, a shape too large."""
    if not isinstance(d, Mapping):
        fail(f"Mesh.from_dict() takes a dict, got {short(d)} ({type(d).__name__})")
    unknown = [k for k in d if k not in DICT_KEYS]
    if unknown:
        fail(f"unknown mesh field {short(unknown[0])}; valid fields are {DICT_KEYS}")
    for key in ("axis_names", "shape"):
        if key not in d:
            fail(f"mesh dict {short(dict(d))} lacks the required field {key!r}")
    shape = d["shape"]
    if isinstance(shape, (list, tuple)):
        # bound the size before device_ids (possibly huge nested lists) is turned into an array
        check_size(tuple(check_int(s, f"mesh shape entry {short(s)}", minimum=1) for s in shape))


def mesh_json(s: object) -> Any:
    """The dict in :meth:`Mesh.to_json`'s text (plain JSON; nothing is evaluated), refused by
    name when it is not JSON; a long text of plain ids is read by a fast path."""
    import json

    if not isinstance(s, (str, bytes, bytearray)):
        fail(f"Mesh.from_json() takes a str, got {short(s)} ({type(s).__name__})")
    if isinstance(s, str) and len(s) > 1 << 16:
        from ._text import json_ids_fast

        fast = json_ids_fast(s)
        if fast is not None:
            return fast
    try:
        d = json.loads(s)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        fail(f"not valid mesh JSON: {short(s)} ({exc})")
    return d
