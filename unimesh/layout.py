"""A layout: a partition spec bound to a mesh, and the shard arithmetic of the reference
semantics.

The reference semantics of sharding live here and nowhere else: every backend must put on each
device exactly the block :meth:`Layout.shard_slices` names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._validate import check_int
from .errors import LayoutError
from .mesh import Mesh
from .messages import close_match, short
from .placements import Placement, spec_from_placements, to_placements
from .spec import PartitionSpec, entry_axes, layout_fail

__all__ = ["Layout"]


#: devices per slice in shard_bounds (2 MiB per temporary array)
_ROWS = 1 << 18


def _chunk(start: np.ndarray, stop: np.ndarray, n: int, k: np.ndarray) -> tuple[np.ndarray, ...]:
    """``torch.chunk`` of [start, stop) into ``n`` chunks; chunk ``k`` (vectorised). Chunks have
    ceil(len / n) elements, trailing ones short or empty."""
    length = stop - start
    step = -(-length // n)
    lo = np.minimum(start + k * step, stop)
    hi = np.minimum(lo + step, stop)
    return lo, hi


class Layout:
    """A :class:`PartitionSpec` bound to a :class:`Mesh`, validated against it.

    ``spec`` may be a PartitionSpec or a tuple/list of entries.
    """

    __slots__ = ("_hash", "_key", "_mesh", "_spec")

    _mesh: Mesh
    _spec: PartitionSpec
    _key: tuple[Any, ...]
    _hash: int | None

    def __init__(self, mesh: Mesh, spec: PartitionSpec | Sequence[object]) -> None:
        if not isinstance(mesh, Mesh):
            layout_fail(f"Layout() needs a unimesh.Mesh, got {short(mesh)} ({type(mesh).__name__})")
        if not isinstance(spec, PartitionSpec):
            if isinstance(spec, (str, bytes)) or not isinstance(spec, (tuple, list)):
                layout_fail(
                    f"Layout() needs a PartitionSpec (or a tuple of entries), got {short(spec)}"
                )
            spec = PartitionSpec(*spec)
        for ax in spec.axes() + tuple(spec.partial):
            if ax not in mesh.axis_names:
                layout_fail(
                    f"spec {spec!r} names axis {ax!r}"
                    f"{close_match(ax, mesh.axis_names)}, which is not in {mesh!r}; "
                    f"the axes are {mesh.axis_names}"
                )
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_spec", spec)
        entries = list(spec.entries)
        while entries and entries[-1] is None:
            entries.pop()
        object.__setattr__(self, "_key", (tuple(entries), frozenset(spec.partial.items())))
        object.__setattr__(self, "_hash", None)  # computed on first use (layouts are dict keys)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Layout is immutable")

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def spec(self) -> PartitionSpec:
        return self._spec

    def __eq__(self, other: object) -> bool:
        """Equal when on the same mesh with the same meaning: trailing replicated entries of
        the spec do not count (``Layout(m, P())  == Layout(m, P(None))``)."""
        if other is self:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return self._key == other._key and (self._mesh is other._mesh or self._mesh == other._mesh)

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash((self._mesh, self._key))
            object.__setattr__(self, "_hash", h)
        return h

    def __repr__(self) -> str:
        return f"Layout({self._mesh!r}, {self._spec!r})"

    def _repr_html_(self) -> str:
        """The mesh's grid in a notebook, each device with its block index per tensor dim
        (:func:`unimesh.visual.html`)."""
        from .visual import html  # lazy: the notebook view sits above this module

        return html(self._mesh, self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Layout, (self._mesh, self._spec))

    # -- shards --------------------------------------------------------------------------------
    def _shape(self, global_shape: object) -> tuple[int, ...]:
        if (
            type(global_shape) is tuple
            and len(global_shape) >= len(self._spec)
            and all(type(n) is int and n >= 0 for n in global_shape)
        ):
            return global_shape  # the common case, checked without building messages
        if isinstance(global_shape, (str, bytes)) or not isinstance(global_shape, Sequence):
            layout_fail(f"global_shape must be a tuple of ints, got {short(global_shape)}")
        shape = tuple(
            check_int(s, f"global_shape entry {short(s)}", minimum=0, cls=LayoutError)
            for s in global_shape
        )
        if len(shape) < len(self._spec):
            layout_fail(
                f"spec {self._spec!r} has {len(self._spec)} entries but the tensor shape "
                f"{shape} has only {len(shape)} dims"
            )
        return shape

    def shard_bounds(
        self, global_shape: Sequence[int], device_ids: object = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Start and stop of every device's block, as two int arrays of shape (n, ndim).

        Rows follow ``mesh.device_ids.ravel()`` (or the given ids). The vectorised form of
        :meth:`shard_slices`: dim d over axes (x1..xk) is chunked by x1 first (``torch.chunk``:
        ceil division, trailing chunks short or empty), then each chunk by x2, and so on. A
        block empty along a dim starts (and stops) at that dim's size, as torch places an
        empty shard.
        """
        shape = self._shape(global_shape)
        mesh = self._mesh
        if device_ids is None:
            pos = np.arange(mesh.size, dtype=np.int64)
        else:
            pos = mesh.positions(device_ids).ravel()
        n = pos.shape[0]
        starts = np.zeros((n, len(shape)), dtype=np.int64)
        stops = np.empty((n, len(shape)), dtype=np.int64)
        stops[:] = shape
        for at in range(0, n, _ROWS):  # in slices: temporaries stay small at any mesh size
            part = pos[at : at + _ROWS]
            for d, entry in enumerate(self._spec):
                lo, hi = starts[at : at + _ROWS, d], stops[at : at + _ROWS, d]
                for ax in entry_axes(entry):
                    i = mesh.axis_names.index(ax)
                    coord = (part // math.prod(mesh.shape[i + 1 :])) % mesh.shape[i]
                    lo, hi = _chunk(lo, hi, mesh.shape[i], coord)
                starts[at : at + _ROWS, d], stops[at : at + _ROWS, d] = lo, hi
        # an empty block starts at the dim's end: torch's offset for an empty shard, which
        # DCP deduplicates shards by (compute_local_shape_and_global_offset)
        empty = starts == stops
        if empty.any():
            ends = np.broadcast_to(np.asarray(shape, dtype=np.int64), starts.shape)
            starts[empty] = stops[empty] = ends[empty]
        return starts, stops

    def shard_slices(self, global_shape: Sequence[int], device_id: int) -> tuple[slice, ...]:
        """The block of the global array that ``device_id`` holds, one slice per dim."""
        did = check_int(device_id, "device_id", cls=LayoutError)
        lo, hi = self.shard_bounds(global_shape, [did])
        return tuple(slice(a, b) for a, b in zip(lo[0].tolist(), hi[0].tolist()))

    def shard_shape(self, global_shape: Sequence[int], device_id: int) -> tuple[int, ...]:
        """The shape of ``device_id``'s block."""
        return tuple(s.stop - s.start for s in self.shard_slices(global_shape, device_id))

    def device_slices(self, global_shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """Device id -> its block, for every device of the mesh: the per-device form, a dict
        of Python objects (at 2**20 devices, 10**6 entries). Devices that hold the same block
        share one tuple. For bulk work use :meth:`shard_bounds`, two int arrays."""
        lo, hi = self.shard_bounds(global_shape)
        ids = self._mesh.device_ids.ravel().tolist()
        mesh = self._mesh
        used = [mesh.axis_names.index(a) for a in self._spec.axes()]
        if math.prod(mesh.shape[i] for i in used) == len(ids):  # every block distinct
            rows: Any = zip(lo.tolist(), hi.tolist())
            return {d: tuple(slice(a, b) for a, b in zip(r0, r1)) for d, (r0, r1) in zip(ids, rows)}
        # a device's block depends only on its coordinates along the spec's axes
        pos = np.arange(len(ids), dtype=np.int64)
        key = np.zeros(len(ids), dtype=np.int64)
        for i in used:
            stride = math.prod(mesh.shape[i + 1 :])
            key = key * mesh.shape[i] + (pos // stride) % mesh.shape[i]
        first = np.zeros(math.prod(mesh.shape[i] for i in used), dtype=np.int64)
        first[key[::-1]] = pos[::-1]  # the first device holding each block
        blocks = [
            tuple(slice(a, b) for a, b in zip(r0, r1))
            for r0, r1 in zip(lo[first].tolist(), hi[first].tolist())
        ]
        return dict(zip(ids, map(blocks.__getitem__, key.tolist())))

    def shard_counts(self) -> tuple[int, ...]:
        """How many blocks each dim named by the spec is cut into (1 where replicated)."""
        return tuple(math.prod(self._mesh.axis_size(a) for a in entry_axes(e)) for e in self._spec)

    def is_even(self, global_shape: Sequence[int]) -> bool:
        """True when every sharded dim divides evenly (what JAX, Keras and DTensor-TF require)."""
        shape = self._shape(global_shape)
        return all(shape[d] % n == 0 for d, n in enumerate(self.shard_counts()))

    def global_shape(self, block_shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape whose even blocks have ``block_shape`` (how shard_map puts equal
        blocks back together)."""
        block = self._shape(block_shape)
        counts = self.shard_counts()
        return tuple(n * (counts[d] if d < len(counts) else 1) for d, n in enumerate(block))

    # -- placements (torch DTensor's vocabulary: unimesh.placements) ---------------------------
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis, the rule torch's own converter follows
        (:func:`unimesh.placements.to_placements`)."""
        return to_placements(self._mesh, self._spec)

    @classmethod
    def from_placements(cls, mesh: Mesh, placements: Sequence[Placement], ndim: int) -> Layout:
        """The layout whose :meth:`placements` are ``placements`` for a tensor of ``ndim`` dims
        (:func:`unimesh.placements.spec_from_placements`); placements no PartitionSpec can
        express raise :class:`LayoutError`."""
        return cls(mesh, spec_from_placements(mesh, placements, ndim))
