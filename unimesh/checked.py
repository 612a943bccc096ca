"""Checked mode (``shard_map(checked=True)``, ``UNIMESH_CHECKED=1``): before each collective
every process of the mesh says what it is about to call, in one small all-gather, and on a
disagreement every one raises :class:`~unimesh.MeshMismatchError` naming the processes and
what differs, instead of hanging in a collective its peers never join."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .errors import MeshMismatchError
from .groups import GroupComm
from .mesh import Mesh

__all__ = ["agree"]

_OPS = (
    "psum",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pbroadcast",
)
_DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int32",
    "int64",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
)
_FIELDS = ("operation", "axes", "dtype", "shape", "parameters")
_MAX_DIMS = 8


def _describe(op: str, axes: tuple[str, ...], mesh: Mesh, x: Any, params: object) -> np.ndarray:
    """A collective call as int64s: operation, axes (mesh positions), dtype, ndim, the first
    dims, a crc of the rest and of the parameters: equal on every process that agrees."""
    shape = tuple(int(n) for n in x.shape)
    dtype = str(x.dtype).rsplit(".", 1)[-1]
    code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES) + zlib.crc32(dtype.encode())
    where = [mesh.axis_names.index(a) for a in axes] + [-1] * (mesh.ndim - len(axes))
    dims = list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    rest = zlib.crc32(repr((shape[_MAX_DIMS:], params)).encode())
    return np.array([_OPS.index(op), code, len(shape), rest, *where, *dims], dtype=np.int64)


def _field(row: np.ndarray, name: str) -> tuple[int, ...]:
    ndim_mesh = len(row) - 4 - _MAX_DIMS
    parts = {
        "operation": row[0:1],
        "dtype": row[1:2],
        "parameters": row[3:4],
        "axes": row[4 : 4 + ndim_mesh],
        "shape": np.concatenate([row[2:3], row[4 + ndim_mesh :]]),
    }
    return tuple(int(v) for v in parts[name])


def _explain(row: np.ndarray, mesh: Mesh) -> str:
    """A descriptor row in words: ``psum over ('tp',) of float32 (4, 3)``."""
    axes = tuple(mesh.axis_names[i] for i in _field(row, "axes") if i >= 0)
    ndim, *dims = _field(row, "shape")
    shape = tuple(dims[: min(ndim, _MAX_DIMS)]) + (("...",) if ndim > _MAX_DIMS else ())
    code = int(row[1])
    dtype = _DTYPES[code] if code < len(_DTYPES) else "another dtype"
    return f"{_OPS[int(row[0])]} over {axes} of {dtype} {shape}"


def agree(
    comm: GroupComm, count: int, op: str, axes: tuple[str, ...], x: Any, params: object = ()
) -> None:
    """Every process of the mesh calls the collective ``op`` (the ``count``-th of the program)
    here, over ``axes``, with an ``x`` of the same dtype and shape and the same ``params``, or
    every one raises MeshMismatchError naming the processes and what differs. One all-gather
    of a small descriptor over the whole mesh (which cannot itself wait on a disagreement
    about axes)."""
    xp, mesh = comm.xp, comm.mesh
    x = xp.asarray(x)
    mine = _describe(op, axes, mesh, x, params)
    everyone = comm.group(mesh.axis_names)
    rows = xp.to_host(comm.gather_members(xp.asarray(mine), everyone))
    rows = np.asarray(rows).reshape(len(rows), -1)
    if (rows == rows[0]).all():
        return
    said = [_explain(row, mesh) for row in rows]
    kinds = sorted({f for row in rows for f in _FIELDS if _field(row, f) != _field(rows[0], f)})
    groups: dict[str, list[int]] = {}
    for device, text in zip(everyone.members, said):
        groups.setdefault(text, []).append(device)
    if "parameters" in kinds:
        groups = {}
        for device, text, row in zip(everyone.members, said, rows):
            groups.setdefault(f"{text} with parameters #{int(row[3])}", []).append(device)
    detail = "; ".join(f"process(es) {devices} call {text}" for text, devices in groups.items())
    raise MeshMismatchError(
        f"collective {count} of the program differs between processes ({', '.join(kinds)}): "
        f"{detail}. Every process of the mesh must call the same collectives in the same "
        "order, on the same axes, with arrays of the same dtype and shape"
    )
