"""Placements, torch DTensor's vocabulary for a layout (one per mesh axis), framework-free, and
the two-way rule between them and partition specs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Union

from ._validate import check_int
from .errors import LayoutError
from .mesh import Mesh
from .messages import short
from .spec import REDUCE_OPS, Entry, PartitionSpec, entry_axes, layout_fail

__all__ = [
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "from_torch_placement",
    "spec_from_placements",
    "to_placements",
]


class _Value:
    """Immutable value object: equality, hash and repr from ``__slots__`` (no dataclasses import,
    which would cost ``import unimesh`` a third of numpy's import time)."""

    __slots__: tuple[str, ...] = ()

    def __init__(self, *values: object) -> None:
        for name, value in zip(self.__slots__, values):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _key(self) -> tuple[object, ...]:
        return tuple(getattr(self, n) for n in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({body})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._key())


class Shard(_Value):
    """The mesh axis splits tensor dim ``dim`` in contiguous chunks."""

    __slots__ = ("dim",)
    dim: int

    def __init__(self, dim: int) -> None:
        super().__init__(dim)


class StridedShard(_Value):
    """The mesh axis splits ``dim`` after ``split_factor`` more-major splits by later mesh axes
    (torch's ``_StridedShard``)."""

    __slots__ = ("dim", "split_factor")
    dim: int
    split_factor: int

    def __init__(self, dim: int, split_factor: int) -> None:
        super().__init__(dim, split_factor)


class Replicate(_Value):
    """Every device along the mesh axis holds the same data."""

    __slots__ = ()


class Partial(_Value):
    """Values along the mesh axis are pending a reduction ``op``."""

    __slots__ = ("op",)
    op: str

    def __init__(self, op: str = "sum") -> None:
        super().__init__(op)


Placement = Union[Shard, StridedShard, Replicate, Partial]  # noqa: UP007 - as Entry


def to_placements(mesh: Mesh, spec: PartitionSpec) -> tuple[Placement, ...]:
    """One placement per mesh axis for ``spec`` on ``mesh``, the rule torch's own converter
    follows.

    Start from Replicate; for dim d over axes (x1..xk), axis xj at mesh index m gets
    ``sf`` = product of the sizes of the earlier xi whose mesh index is > m, and becomes
    ``Shard(d)`` if sf == 1 else ``StridedShard(d, sf)``. Partial axes become ``Partial(op)``.
    """
    out: list[Placement] = [Replicate()] * mesh.ndim
    for d, entry in enumerate(spec):
        axes = entry_axes(entry)
        idx = [mesh.axis_names.index(a) for a in axes]
        for j, m in enumerate(idx):
            sf = math.prod(mesh.shape[i] for i in idx[:j] if i > m)
            out[m] = Shard(d) if sf == 1 else StridedShard(d, sf)
    for ax, op in spec.partial.items():
        out[mesh.axis_names.index(ax)] = Partial(op)
    return tuple(out)


def from_torch_placement(p: object) -> Placement | None:
    """torch's own placement object as the core's, or None when ``p`` is not one of torch's.

    Recognised by class (``Shard``, ``_StridedShard``, ``Replicate``, ``Partial`` from a
    ``torch.`` module), so torch is never imported here. torch's other placements (a masked or
    norm ``Partial``) have no PartitionSpec form and raise :class:`LayoutError`.
    """
    cls = type(p)
    if not cls.__module__.startswith("torch."):
        return None
    name = cls.__name__
    if name in ("_StridedShard", "StridedShard"):
        return StridedShard(int(p.dim), int(p.split_factor))  # type: ignore[attr-defined]
    if name == "Shard":
        return Shard(int(p.dim))  # type: ignore[attr-defined]
    if name == "Replicate":
        return Replicate()
    if name == "Partial":
        return Partial(str(p.reduce_op))  # type: ignore[attr-defined]
    layout_fail(
        f"torch placement {short(p)} ({cls.__module__}.{name}) has no PartitionSpec "
        "equivalent; only Shard, _StridedShard, Replicate and Partial do"
    )


def spec_from_placements(mesh: Mesh, placements: Sequence[Placement], ndim: int) -> PartitionSpec:
    """The spec whose :func:`to_placements` are ``placements`` for a tensor of ``ndim`` dims.

    ``placements`` may be the core's objects or torch's own (``torch.distributed.tensor.Shard``
    and the rest; see :func:`from_torch_placement`).

    The spec has exactly ``ndim`` entries. Where size-1 axes make several orders equivalent,
    the most ascending order is chosen.
    Placements no PartitionSpec can express raise :class:`LayoutError`.
    """
    if not isinstance(mesh, Mesh):
        layout_fail(f"from_placements() needs a unimesh.Mesh, got {short(mesh)}")
    nd = check_int(ndim, "ndim", minimum=0, cls=LayoutError)
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
        layout_fail(f"placements must be a sequence, got {short(placements)}")
    if len(placements) != mesh.ndim:
        layout_fail(
            f"got {len(placements)} placements for a mesh of {mesh.ndim} axes "
            f"{mesh.axis_names}; give one per mesh axis"
        )
    by_dim: dict[int, list[tuple[int, int]]] = {}
    partial: dict[str, str] = {}
    for m, p in enumerate(placements):
        p = from_torch_placement(p) or p
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            if p.op not in REDUCE_OPS:
                layout_fail(
                    f"Partial op {p.op!r} on axis {mesh.axis_names[m]!r} is not one of {REDUCE_OPS}"
                )
            partial[mesh.axis_names[m]] = p.op
            continue
        if isinstance(p, StridedShard):
            sf = check_int(p.split_factor, "StridedShard split_factor", minimum=1, cls=LayoutError)
        elif isinstance(p, Shard):
            sf = 1
        else:
            layout_fail(
                f"placement {short(p)} on axis {mesh.axis_names[m]!r} is not a Shard, "
                "StridedShard, Replicate or Partial"
            )
        dim = check_int(p.dim, "Shard dim", cls=LayoutError)
        if dim < 0:
            dim += nd
        if not 0 <= dim < nd:
            layout_fail(
                f"placement {p!r} on axis {mesh.axis_names[m]!r} shards dim {p.dim}, "
                f"out of range for a tensor of {nd} dims"
            )
        by_dim.setdefault(dim, []).append((m, sf))
    entries: list[Entry] = [None] * nd
    for dim, items in by_dim.items():
        order: list[int] = []
        for m, sf in sorted(items, reverse=True):  # largest mesh index first
            prefix = 1
            for pos in range(len(order) + 1):
                if prefix == sf:
                    order.insert(pos, m)
                    break
                if pos < len(order):
                    prefix *= mesh.shape[order[pos]]
            else:
                layout_fail(
                    f"placements {tuple(placements)!r} have no PartitionSpec equivalent: "
                    f"no order of the axes sharding dim {dim} gives axis "
                    f"{mesh.axis_names[m]!r} split_factor {sf}"
                )
        names = tuple(mesh.axis_names[i] for i in order)
        entries[dim] = names[0] if len(names) == 1 else names
    return PartitionSpec(*entries, partial=partial or None)
