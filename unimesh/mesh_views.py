"""New meshes seen from a mesh: its submeshes, its axes reshaped (flatten, unflatten, rename,
transpose) and a process's block of it (``local_mesh``), each checked against the mesh and
refused by name. Every function reads the mesh through its public properties and returns the
new mesh's parts (shape, axis names, device ids, axis types), which :class:`~unimesh.Mesh`
assembles unchecked (the ids are a rearrangement of checked ids). No framework."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._validate import check_axis_name, check_int, fail
from .mesh_input import axis_position, check_axes, resolve_sizes
from .messages import short

if TYPE_CHECKING:
    from .mesh import Mesh

__all__ = [
    "Parts",
    "flatten",
    "local_block",
    "local_ids",
    "rename",
    "submesh",
    "submeshes",
    "transpose",
    "unflatten",
]

#: a new mesh's shape, axis names, device ids and axis types
Parts = tuple[tuple[int, ...], tuple[str, ...], np.ndarray, tuple[str, ...] | None]


# -- submeshes --------------------------------------------------------------------------------
def _sub(mesh: Mesh, names: tuple[str, ...], ids: np.ndarray) -> Parts:
    types = mesh.axis_types
    if types is not None:
        types = tuple(types[mesh.axis_names.index(n)] for n in names)
    return tuple(mesh.axis_size(n) for n in names), names, ids, types


def submesh(mesh: Mesh, axes: str | Sequence[str], containing: int | None) -> Parts:
    """:meth:`Mesh.submesh`."""
    names = check_axes(mesh.axis_names, axes)
    shape = mesh.shape
    arr = mesh.groups_array(names)
    if containing is None:
        if arr.shape[0] != 1:
            fail(
                f"submesh({names}) of {mesh!r} has {arr.shape[0]} candidates; pass "
                "containing=<device id> to say which one"
            )
        row = 0
    else:
        did = check_int(containing, "containing")
        pos = int(mesh.positions(did))
        coord = np.unravel_index(pos, shape)
        fixed = [i for i in range(mesh.ndim) if mesh.axis_names[i] not in names]
        row = (
            int(np.ravel_multi_index([coord[i] for i in fixed], [shape[i] for i in fixed]))
            if fixed
            else 0
        )
    sub_shape = tuple(mesh.axis_size(n) for n in names)
    return _sub(mesh, names, arr[row].reshape(sub_shape))


def submeshes(mesh: Mesh, axes: str | Sequence[str]) -> list[Parts]:
    """:meth:`Mesh.submeshes`."""
    names = check_axes(mesh.axis_names, axes)
    sub_shape = tuple(mesh.axis_size(n) for n in names)
    return [_sub(mesh, names, row.reshape(sub_shape)) for row in mesh.groups_array(names)]


# -- reshaping --------------------------------------------------------------------------------
def flatten(mesh: Mesh, axes: Sequence[str], name: str) -> Parts:
    """:meth:`Mesh.flatten`."""
    old_names, old_types = mesh.axis_names, mesh.axis_types
    names = check_axes(old_names, axes)
    check_axis_name(name, "flattened axis name")
    rest = [n for n in old_names if n not in names]
    if name in rest:
        fail(
            f"cannot name the flattened axis {name!r}: the mesh keeps an axis of that name "
            f"({tuple(rest)}); choose another name"
        )
    perm: list[int] = []
    new_names: list[str] = []
    new_shape: list[int] = []
    new_types: list[str] = []
    for i, n in enumerate(old_names):
        if n == names[0]:
            perm.extend(old_names.index(m) for m in names)
            new_names.append(name)
            new_shape.append(math.prod(mesh.axis_size(m) for m in names))
            if old_types is not None:
                kinds = {old_types[old_names.index(m)] for m in names}
                if len(kinds) > 1:
                    fail(
                        f"cannot flatten axes {names} of different axis types "
                        f"{sorted(kinds)}; give them one type first"
                    )
                new_types.append(kinds.pop())
        elif n not in names:
            perm.append(i)
            new_names.append(n)
            new_shape.append(mesh.shape[i])
            if old_types is not None:
                new_types.append(old_types[i])
    ids = mesh.device_ids.transpose(perm).reshape(new_shape)
    types = tuple(new_types) if old_types is not None else None
    return tuple(new_shape), tuple(new_names), ids, types


def unflatten(mesh: Mesh, axis: str, sizes: Mapping[str, int]) -> Parts:
    """:meth:`Mesh.unflatten`."""
    old_names, old_shape, old_types = mesh.axis_names, mesh.shape, mesh.axis_types
    i = axis_position(old_names, axis)
    if not isinstance(sizes, Mapping) or not sizes:
        fail(f"unflatten sizes must be a non-empty mapping name -> size, got {short(sizes)}")
    new = resolve_sizes(sizes, old_shape[i], f"axis {axis!r} of size {old_shape[i]}")
    for n in new:
        if n != axis and n in old_names:
            fail(f"cannot unflatten into {n!r}: the mesh already has an axis of that name")
    names = old_names[:i] + tuple(new) + old_names[i + 1 :]
    shape = old_shape[:i] + tuple(new.values()) + old_shape[i + 1 :]
    types = None
    if old_types is not None:
        types = old_types[:i] + (old_types[i],) * len(new) + old_types[i + 1 :]
    return shape, names, mesh.device_ids.reshape(shape), types


def rename(mesh: Mesh, mapping: Mapping[str, str]) -> Parts:
    """:meth:`Mesh.rename`."""
    if not isinstance(mapping, Mapping):
        fail(f"rename() takes a mapping old name -> new name, got {short(mapping)}")
    for old in mapping:
        axis_position(mesh.axis_names, old)
    names = tuple(check_axis_name(mapping.get(n, n)) for n in mesh.axis_names)
    if len(set(names)) != len(names):
        dup = next(n for i, n in enumerate(names) if n in names[:i])
        fail(
            f"rename({short(dict(mapping))}): axis name {dup!r} appears more than once in "
            f"{short(names)}; axis names must be distinct"
        )
    return mesh.shape, names, mesh.device_ids, mesh.axis_types


def transpose(mesh: Mesh, axis_names: Sequence[str]) -> Parts:
    """:meth:`Mesh.transpose`."""
    names = check_axes(mesh.axis_names, axis_names, "transpose axes")
    if len(names) != mesh.ndim:
        fail(
            f"transpose() needs every axis once, in the new order; got {names}, axes are "
            f"{mesh.axis_names}"
        )
    perm = [mesh.axis_names.index(n) for n in names]
    old_types = mesh.axis_types
    types = None if old_types is None else tuple(old_types[p] for p in perm)
    shape = tuple(mesh.shape[p] for p in perm)
    return shape, names, mesh.device_ids.transpose(perm), types


# -- processes --------------------------------------------------------------------------------
def _on_process(mesh: Mesh, process_index: object) -> tuple[int, np.ndarray]:
    """The process index, checked, and whether each mesh position's device is on it (a bool
    array of the mesh's shape)."""
    dpp = mesh.devices_per_process
    p = check_int(process_index, "process_index", minimum=0)
    if dpp is None and p != 0:
        fail(
            f"process_index {p} is out of range: this mesh has no devices_per_process, so it "
            "lives on one process (index 0); set devices_per_process"
        )
    process_of = np.zeros(mesh.shape, dtype=np.int64) if dpp is None else mesh.device_ids // dpp
    return p, process_of == p


def local_ids(mesh: Mesh, process_index: int) -> list[int]:
    """:meth:`Mesh.local_device_ids`."""
    _, mask = _on_process(mesh, process_index)
    return mesh.device_ids[mask].tolist()  # type: ignore[no-any-return]


def local_block(mesh: Mesh, process_index: int) -> Parts:
    """:meth:`Mesh.local_mesh`."""
    p, mask = _on_process(mesh, process_index)
    if not mask.any():
        fail(
            f"process {p} holds no device of {mesh!r} "
            f"(devices_per_process={mesh.devices_per_process})"
        )
    index = []
    for ax in range(mesh.ndim):
        other = tuple(i for i in range(mesh.ndim) if i != ax)
        used = np.flatnonzero(mask.any(axis=other) if other else mask)
        lo, hi = int(used[0]), int(used[-1]) + 1
        index.append(slice(lo, hi))
    block = tuple(index)
    if not mask[block].all():
        fail(
            f"the devices of process {p} do not form a block of {mesh!r}: the block "
            f"{[(s.start, s.stop) for s in block]} also holds other processes' devices"
        )
    ids = mesh.device_ids[block]
    return ids.shape, mesh.axis_names, ids, mesh.axis_types
