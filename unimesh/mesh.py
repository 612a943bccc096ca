"""The neutral device mesh: named axes over logical device ids, with no framework attached."""

from __future__ import annotations

import contextvars
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import mesh_views as views
from ._validate import (
    check_int,
    fail,
)
from .mesh_input import (
    axis_position,
    check_axes,
    check_mesh_dict,
    is_arange,
    mesh_fields,
    mesh_json,
)
from .messages import short

__all__ = ["Mesh", "current_mesh"]

_CURRENT: contextvars.ContextVar[tuple[Mesh, ...]] = contextvars.ContextVar(
    "unimesh_current_mesh", default=()
)


def current_mesh() -> Mesh | None:
    """The innermost mesh entered with ``with mesh:`` in this thread/task, or None."""
    stack = _CURRENT.get()
    return stack[-1] if stack else None


class Mesh:
    """An immutable, hashable n-D mesh of named axes over logical device ids.

    Args:
        shape: the size of each axis, positive ints.
        axis_names: one distinct name per axis (letters, digits, ``_``).
        device_ids: an int array of ``shape`` (nested lists accepted), or a flat sequence of
            ``prod(shape)`` ids read row-major (as Keras's ``DeviceMesh`` reads its devices).
            A device id is a logical index into the backend's global device order (sorted by
            process, then local index), not a framework's native id. Default:
            ``arange(size).reshape(shape)``.
        axis_types: None or one of ``"auto" | "explicit" | "manual"`` per axis (JAX's AxisType).
        devices_per_process: None (unknown / one process), or k: device i lives on process i // k.
    """

    __slots__ = ("_cache", "_dpp", "_ids", "_names", "_shape", "_types")

    _shape: tuple[int, ...]
    _names: tuple[str, ...]
    _ids: np.ndarray | None
    _types: tuple[str, ...] | None
    _dpp: int | None
    _cache: dict[str, Any]

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        device_ids: object = None,
        *,
        axis_types: Sequence[str] | None = None,
        devices_per_process: int | None = None,
    ) -> None:
        shape_t, names, ids, types, dpp = mesh_fields(
            shape, axis_names, device_ids, axis_types, devices_per_process
        )
        set_ = object.__setattr__
        set_(self, "_shape", shape_t)
        set_(self, "_names", names)
        set_(self, "_ids", ids)
        set_(self, "_types", types)
        set_(self, "_dpp", dpp)
        set_(self, "_cache", {})

    @classmethod
    def _derived(
        cls,
        shape: tuple[int, ...],
        names: tuple[str, ...],
        ids: np.ndarray,
        types: tuple[str, ...] | None,
        dpp: int | None,
    ) -> Mesh:
        """A mesh from parts that a mesh already checked (flatten, transpose, submeshes, ...):
        the ids are a rearrangement of checked ids, so they are not validated again."""
        mesh = object.__new__(cls)
        flat = ids.ravel()
        own: np.ndarray | None = None
        if not is_arange(flat):
            own = np.ascontiguousarray(ids).reshape(shape)
            own.flags.writeable = False
        set_ = object.__setattr__
        for field, value in (
            ("_shape", shape),
            ("_names", names),
            ("_ids", own),
            ("_types", types),
            ("_dpp", dpp),
            ("_cache", {}),
        ):
            set_(mesh, field, value)
        return mesh

    # -- immutability, equality, hashing, pickling ---------------------------------------------
    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Mesh is immutable; cannot set {name!r} (build a new Mesh instead)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Mesh is immutable; cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        if (self._shape, self._names, self._types, self._dpp) != (
            other._shape,
            other._names,
            other._types,
            other._dpp,
        ):
            return False
        if self._ids is None or other._ids is None:
            return self._ids is None and other._ids is None
        return bool(np.array_equal(self._ids, other._ids))

    def __hash__(self) -> int:
        h = self._cache.get("hash")
        if h is None:
            ids = None if self._ids is None else self._ids.tobytes()
            h = hash((self._shape, self._names, self._types, self._dpp, ids))
            self._cache["hash"] = h
        return h

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.to_dict(),))

    def _repr_html_(self) -> str:
        """The grid of device ids in a notebook (:func:`unimesh.visual.html`)."""
        from .visual import html  # lazy: the notebook view sits above this module

        return html(self)

    def __repr__(self) -> str:
        parts = [
            f"{n}={s}" if n.isidentifier() else f"{n!r}={s}"
            for n, s in zip(self._names, self._shape)
        ]
        if self._ids is not None:
            text = np.array2string(self._ids, separator=", ", threshold=64, max_line_width=10**6)
            parts.append(f"device_ids={' '.join(text.split())}")
        if self._types is not None:
            parts.append(f"axis_types={self._types!r}")
        if self._dpp is not None:
            parts.append(f"devices_per_process={self._dpp}")
        return f"Mesh({', '.join(parts)})"

    # -- context manager -----------------------------------------------------------------------
    def __enter__(self) -> Mesh:  # noqa: PYI034 - typing.Self needs Python 3.11
        _CURRENT.set(_CURRENT.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _CURRENT.get()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                _CURRENT.set(stack[:i] + stack[i + 1 :])
                break

    # -- properties ----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self._shape)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Axis name -> size, in axis order."""
        return dict(zip(self._names, self._shape))

    @property
    def axis_types(self) -> tuple[str, ...] | None:
        return self._types

    @property
    def devices_per_process(self) -> int | None:
        return self._dpp

    @property
    def device_ids(self) -> np.ndarray:
        """The logical device id at each mesh position (read-only int64 array of ``shape``)."""
        if self._ids is not None:
            return self._ids
        ids = self._cache.get("ids")
        if ids is None:
            ids = np.arange(self.size, dtype=np.int64).reshape(self._shape)
            ids.flags.writeable = False
            self._cache["ids"] = ids
        return ids

    @property
    def is_default_order(self) -> bool:
        """True when ``device_ids`` is ``arange(size).reshape(shape)``."""
        return self._ids is None

    @property
    def strides(self) -> tuple[int, ...]:
        """Row-major strides of the default layout (TF DTensor's ``Mesh.strides``)."""
        out = []
        acc = 1
        for s in reversed(self._shape):
            out.append(acc)
            acc *= s
        return tuple(reversed(out))

    @property
    def num_processes(self) -> int:
        """How many processes hold this mesh's devices (1 when ``devices_per_process`` is None)."""
        if self._dpp is None:
            return 1
        return int(np.unique(self.device_ids // self._dpp).size)

    # -- axes ----------------------------------------------------------------------------------
    def axis_size(self, name: str) -> int:
        """Size of the named axis."""
        return self._shape[axis_position(self._names, name)]

    # -- device lookup -------------------------------------------------------------------------
    def positions(self, device_ids: object) -> np.ndarray:
        """Flat row-major mesh positions of the given device ids (vectorised ``coords``)."""
        try:
            q = np.asarray(device_ids)
        except (ValueError, TypeError) as exc:
            fail(f"device ids {short(device_ids)} are not ints ({exc})")
        if (q.dtype.kind == "u" and q.size and q.max() > np.iinfo(np.int64).max) or (
            q.dtype.kind == "O" and all(isinstance(v, int) for v in q.ravel().tolist())
        ):
            fail(
                f"device ids {short(device_ids)} are out of range: device ids are ints "
                f"from 0 to 2**63 - 1, and {self!r} has {short(self.device_ids.ravel().tolist())}"
            )
        if q.dtype.kind not in "iu" or q.dtype == np.bool_:
            if q.size == 0:
                q = q.astype(np.int64)
            else:
                fail(f"device ids must be ints, got {short(device_ids)}")
        q = q.astype(np.int64, copy=False)
        if self._ids is None:
            pos = q
            bad = (q < 0) | (q >= self.size)
        else:
            inverse = self._inverse()
            if inverse is not None:  # dense table: id -> position, -1 where absent
                inside = (q >= 0) & (q < inverse.size)
                pos = inverse[np.where(inside, q, 0)]
                bad = ~inside | (pos < 0)
            else:  # sparse ids: binary search in the sorted ids
                order, sorted_ids = self._cache["order"], self._cache["sorted"]
                idx = np.clip(np.searchsorted(sorted_ids, q), 0, sorted_ids.size - 1)
                bad = sorted_ids[idx] != q
                pos = order[idx]
        if bad.any():
            missing = int(q[bad].ravel()[0])
            fail(
                f"device {missing} is not in {self!r}; its device ids are "
                f"{short(self.device_ids.ravel().tolist())}"
            )
        return pos

    def _inverse(self) -> np.ndarray | None:
        """For non-default ids: a dense id -> position table when the ids are compact
        (max id < 4 * size + 1024), else None after caching the sorted ids for binary search."""
        if "inverse" not in self._cache:
            assert self._ids is not None
            flat = self._ids.ravel()
            top = int(flat.max()) + 1
            if top <= 4 * flat.size + 1024:
                inverse = np.full(top, -1, dtype=np.int64)
                inverse[flat] = np.arange(flat.size, dtype=np.int64)
                self._cache["inverse"] = inverse
            else:
                order = np.argsort(flat, kind="stable")
                self._cache.update(inverse=None, order=order, sorted=flat[order])
        inv: np.ndarray | None = self._cache["inverse"]
        return inv

    def coords_array(self, device_ids: object = None) -> np.ndarray:
        """Coordinates as an int array of shape (n, ndim).

        With no argument: every device, in row-major mesh order (the order of
        ``device_ids.ravel()``); else the coordinates of the given ids.
        """
        if device_ids is None:
            pos = np.arange(self.size, dtype=np.int64)
        else:
            pos = self.positions(device_ids).ravel()
        return np.stack(np.unravel_index(pos, self._shape), axis=-1).astype(np.int64)

    def coords(self, device_id: int) -> dict[str, int]:
        """The mesh coordinate of a device, as ``{axis: index}``."""
        did = check_int(device_id, "device_id")
        pos = int(self.positions(did))
        idx = np.unravel_index(pos, self._shape)
        return {n: int(i) for n, i in zip(self._names, idx)}

    def device_at(self, **coords: int) -> int:
        """The device id at the given coordinate; every axis must be given."""
        missing = [n for n in self._names if n not in coords]
        extra = [k for k in coords if k not in self._names]
        if extra:
            fail(f"unknown axis {extra[0]!r} in device_at(); this mesh's axes are {self._names}")
        if missing:
            fail(
                f"device_at() needs a coordinate for every axis; missing {missing} "
                f"(axes are {self._names})"
            )
        idx = []
        for n, s in zip(self._names, self._shape):
            c = check_int(coords[n], f"coordinate {n}")
            if not 0 <= c < s:
                fail(f"coordinate {n}={c} is out of range; axis {n!r} has size {s} (0..{s - 1})")
            idx.append(c)
        return int(self.device_ids[tuple(idx)])

    def unravel_index(self) -> dict[int, dict[str, int]]:
        """Device id -> ``{axis: index}`` for every device (TF DTensor's ``unravel_index``)."""
        ids = self.device_ids.ravel().tolist()
        cols = self.coords_array().T.tolist()
        return {d: dict(zip(self._names, c)) for d, c in zip(ids, zip(*cols))}

    # -- groups and submeshes ------------------------------------------------------------------
    def groups_array(self, axes: str | Sequence[str]) -> np.ndarray:
        """``groups`` as an int array of shape (number of groups, group size)."""
        names = check_axes(self._names, axes)
        var = [self._names.index(n) for n in names]
        fixed = [i for i in range(self.ndim) if i not in var]
        gsize = math.prod(self._shape[i] for i in var)
        return self.device_ids.transpose(fixed + var).reshape(-1, gsize)

    def groups(self, axes: str | Sequence[str]) -> list[tuple[int, ...]]:
        """The device groups that vary along ``axes`` (others fixed).

        Groups come in row-major order of the fixed coordinates; inside a group, devices are in
        row-major order of ``axes`` as given (so ``("tp", "dp")`` makes tp the major axis). These
        are the members of a per-axis process group (torch) or of ``Group.split`` (MLX).
        """
        return [tuple(g) for g in self.groups_array(axes).tolist()]

    def submesh(self, axes: str | Sequence[str], containing: int | None = None) -> Mesh:
        """The mesh over ``axes`` (any order) that contains device ``containing``.

        This is torch's ``mesh["tp"]`` with the rank made explicit. ``containing`` may be left out
        only when there is a single such submesh (``axes`` covers every axis).
        """
        return Mesh._derived(*views.submesh(self, axes, containing), self._dpp)

    def submeshes(self, axes: str | Sequence[str]) -> list[Mesh]:
        """Every submesh over ``axes``, in the order of ``groups(axes)``."""
        return [Mesh._derived(*parts, self._dpp) for parts in views.submeshes(self, axes)]

    # -- reshaping -----------------------------------------------------------------------------
    def flatten(self, axes: Sequence[str], name: str) -> Mesh:
        """Merge ``axes`` (in the order given, major first) into one axis called ``name``.

        The new axis stands where the first of ``axes`` stood; the others are removed. This is
        torch's private ``DeviceMesh._flatten``, for any subset and order of axes.
        """
        return Mesh._derived(*views.flatten(self, axes, name), self._dpp)

    def unflatten(self, axis: str, sizes: Mapping[str, int]) -> Mesh:
        """Split ``axis`` into the named axes ``sizes`` (row-major, major first), in its place.

        One size may be -1 and is inferred. The inverse of :meth:`flatten` for adjacent axes.
        """
        return Mesh._derived(*views.unflatten(self, axis, sizes), self._dpp)

    def rename(self, mapping: Mapping[str, str]) -> Mesh:
        """A mesh with axes renamed by ``mapping`` (old name -> new name)."""
        return Mesh._derived(*views.rename(self, mapping), self._dpp)

    def transpose(self, axis_names: Sequence[str]) -> Mesh:
        """The same devices with the axes in a new order (a permutation of ``axis_names``)."""
        return Mesh._derived(*views.transpose(self, axis_names), self._dpp)

    # -- processes -----------------------------------------------------------------------------
    def local_device_ids(self, process_index: int) -> list[int]:
        """The ids of this mesh's devices on that process, in row-major mesh order."""
        return views.local_ids(self, process_index)

    def local_mesh(self, process_index: int) -> Mesh:
        """The smallest block of the mesh holding that process's devices (JAX's ``local_mesh``)."""
        return Mesh._derived(*views.local_block(self, process_index), self._dpp)

    # -- serial forms --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; fields at their defaults are left out."""
        d: dict[str, Any] = {"axis_names": list(self._names), "shape": list(self._shape)}
        if self._ids is not None:
            d["device_ids"] = self._ids.tolist()
        if self._types is not None:
            d["axis_types"] = list(self._types)
        if self._dpp is not None:
            d["devices_per_process"] = self._dpp
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Mesh:
        """Rebuild a mesh from :meth:`to_dict`'s output."""
        check_mesh_dict(d)
        return cls(
            d["shape"],
            d["axis_names"],
            d.get("device_ids"),
            axis_types=d.get("axis_types"),
            devices_per_process=d.get("devices_per_process"),
        )

    def to_json(self) -> str:
        """Compact JSON of :meth:`to_dict`."""
        import json

        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> Mesh:
        """Rebuild a mesh from :meth:`to_json`'s output (plain JSON; nothing is evaluated)."""
        return cls.from_dict(mesh_json(s))

    def to_string(self) -> str:
        """The short text form, e.g. ``dp=2,tp=4`` (plus ``;ids=...``, ``;types=...``,
        ``;per_process=k`` where not default); a name other than a plain word (letters,
        digits, ``_``, ``.``, ``-``) is written as a JSON string: ``"mesh 0"=2``.
        :meth:`from_string` reads it back exactly."""
        from ._text import quote_name

        text = ",".join(f"{quote_name(n)}={s}" for n, s in zip(self._names, self._shape))
        if self._ids is not None:
            text += ";ids=" + ",".join(map(str, self._ids.ravel().tolist()))
        if self._types is not None:
            text += ";types=" + ",".join(self._types)
        if self._dpp is not None:
            text += f";per_process={self._dpp}"
        return text

    @classmethod
    def from_string(cls, s: str) -> Mesh:
        """Parse the short text form (``"dp=2,tp=4"``; see :meth:`to_string`)."""
        from ._text import parse_mesh_string

        return cls(**parse_mesh_string(s))


def _rebuild(d: dict[str, Any]) -> Mesh:
    return Mesh.from_dict(d)
