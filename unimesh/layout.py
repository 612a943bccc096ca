"""How a tensor is laid out on a mesh: partition specs, placements, layouts, layout maps, axis
rules.

The reference semantics of sharding live here and nowhere else: every backend must put on each
device exactly the block :meth:`Layout.shard_slices` names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn, Union

import numpy as np

from ._validate import check_int, fail, short
from .errors import LayoutError
from .mesh import Mesh

__all__ = [
    "REDUCE_OPS",
    "AxisRules",
    "Layout",
    "LayoutMap",
    "P",
    "Partial",
    "PartitionSpec",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
]

#: Reduce ops a pending (partial) value may carry.
REDUCE_OPS = ("sum", "avg", "max", "min")

Entry = Union[None, str, tuple[str, ...]]  # noqa: UP007 - a runtime alias on Python 3.10


def _lfail(message: str) -> NoReturn:
    fail(message, LayoutError)


def _entry(value: object, where: str) -> Entry:
    """Normalise one spec entry: None, an axis name, or a tuple of names (``()`` -> None,
    ``("x",)`` -> ``"x"``)."""
    if value is None or isinstance(value, str):
        if isinstance(value, str) and not value:
            _lfail(f"{where}: an axis name cannot be empty; use None for a replicated dim")
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if not isinstance(v, str) or not v:
                _lfail(
                    f"{where}: {short(value)} must hold axis names (non-empty str), "
                    f"found {short(v)}"
                )
        t = tuple(value)
        if not t:
            return None
        return t[0] if len(t) == 1 else t
    _lfail(
        f"{where}: {short(value)} ({type(value).__name__}) is not a spec entry; use None, "
        "an axis name, or a tuple of axis names"
    )


class PartitionSpec:
    """How each tensor dim is split over mesh axes (JAX's ``PartitionSpec``).

    ``P("dp", None, ("tp", "cp"))``: dim 0 over ``dp``, dim 1 replicated, dim 2 over ``tp`` then
    ``cp`` (major to minor). ``partial={"tp": "sum"}`` marks a pending reduction over ``tp``
    (torch ``Partial``). Each axis may appear once in the whole spec. Trailing dims not covered
    by the spec are replicated.
    """

    __slots__ = ("_entries", "_partial")

    _entries: tuple[Entry, ...]
    _partial: tuple[tuple[str, str], ...]

    def __init__(self, *entries: object, partial: Mapping[str, str] | None = None) -> None:
        ents = tuple(_entry(e, f"spec entry {i}") for i, e in enumerate(entries))
        pend: list[tuple[str, str]] = []
        if partial is not None:
            if not isinstance(partial, Mapping):
                _lfail(f"partial must be a mapping axis -> reduce op, got {short(partial)}")
            for ax, op in partial.items():
                if not isinstance(ax, str) or not ax:
                    _lfail(f"partial axis {short(ax)} must be a non-empty axis name")
                if op not in REDUCE_OPS:
                    _lfail(
                        f"reduce op {short(op)} for partial axis {ax!r} is not one of {REDUCE_OPS}"
                    )
                pend.append((ax, op))
        seen: set[str] = set()
        for ax in [a for e in ents for a in _axes_of(e)] + [a for a, _ in pend]:
            if ax in seen:
                _lfail(
                    f"axis {ax!r} appears more than once in the spec {_spec_repr(ents, pend)}; "
                    "a mesh axis can split one tensor dim (or be partial) only once"
                )
            seen.add(ax)
        object.__setattr__(self, "_entries", ents)
        object.__setattr__(self, "_partial", tuple(pend))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PartitionSpec is immutable")

    @property
    def partial(self) -> dict[str, str]:
        """Axis -> reduce op of pending reductions."""
        return dict(self._partial)

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self._entries

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec shards over (not the partial ones), in order of appearance."""
        return tuple(a for e in self._entries for a in _axes_of(e))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __getitem__(self, i: int) -> Entry:
        return self._entries[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartitionSpec):
            return self._entries == other._entries and dict(self._partial) == dict(other._partial)
        if isinstance(other, tuple) and not self._partial:
            try:
                return self == PartitionSpec(*other)
            except LayoutError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._entries, frozenset(self._partial)))

    def __repr__(self) -> str:
        return _spec_repr(self._entries, self._partial)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_spec, (self._entries, dict(self._partial) or None))


def _rebuild_spec(entries: tuple[Entry, ...], partial: dict[str, str] | None) -> PartitionSpec:
    return PartitionSpec(*entries, partial=partial)


P = PartitionSpec


def _axes_of(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry


def _spec_repr(entries: Sequence[Entry], partial: Sequence[tuple[str, str]]) -> str:
    body = ", ".join(repr(e) for e in entries)
    if partial:
        body += (", " if body else "") + f"partial={dict(partial)!r}"
    return f"P({body})"


# -- placements (torch DTensor's vocabulary, framework-free) ------------------------------------
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
            _lfail(f"Layout() needs a unimesh.Mesh, got {short(mesh)} ({type(mesh).__name__})")
        if not isinstance(spec, PartitionSpec):
            if isinstance(spec, (str, bytes)) or not isinstance(spec, (tuple, list)):
                _lfail(f"Layout() needs a PartitionSpec (or a tuple of entries), got {short(spec)}")
            spec = PartitionSpec(*spec)
        for ax in spec.axes() + tuple(spec.partial):
            if ax not in mesh.axis_names:
                _lfail(
                    f"spec {spec!r} names axis {ax!r}, which is not in {mesh!r}; "
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
            _lfail(f"global_shape must be a tuple of ints, got {short(global_shape)}")
        shape = tuple(
            check_int(s, f"global_shape entry {short(s)}", minimum=0, cls=LayoutError)
            for s in global_shape
        )
        if len(shape) < len(self._spec):
            _lfail(
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
        ceil division, trailing chunks short or empty), then each chunk by x2, and so on.
        """
        shape = self._shape(global_shape)
        coords = self._mesh.coords_array(device_ids)
        n = coords.shape[0]
        starts = np.zeros((n, len(shape)), dtype=np.int64)
        stops = np.tile(np.asarray(shape, dtype=np.int64), (n, 1))
        for d, entry in enumerate(self._spec):
            lo, hi = starts[:, d], stops[:, d]
            for ax in _axes_of(entry):
                i = self._mesh.axis_names.index(ax)
                lo, hi = _chunk(lo, hi, self._mesh.shape[i], coords[:, i])
            starts[:, d], stops[:, d] = lo, hi
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
        """Device id -> its block, for every device of the mesh."""
        lo, hi = self.shard_bounds(global_shape)
        ids = self._mesh.device_ids.ravel().tolist()
        return {
            d: tuple(slice(a, b) for a, b in zip(r0, r1))
            for d, r0, r1 in zip(ids, lo.tolist(), hi.tolist())
        }

    def shard_counts(self) -> tuple[int, ...]:
        """How many blocks each dim named by the spec is cut into (1 where replicated)."""
        return tuple(math.prod(self._mesh.axis_size(a) for a in _axes_of(e)) for e in self._spec)

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

    # -- placements ----------------------------------------------------------------------------
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis, the rule torch's own converter follows.

        Start from Replicate; for dim d over axes (x1..xk), axis xj at mesh index m gets
        ``sf`` = product of the sizes of the earlier xi whose mesh index is > m, and becomes
        ``Shard(d)`` if sf == 1 else ``StridedShard(d, sf)``. Partial axes become ``Partial(op)``.
        """
        mesh = self._mesh
        out: list[Placement] = [Replicate()] * mesh.ndim
        for d, entry in enumerate(self._spec):
            axes = _axes_of(entry)
            idx = [mesh.axis_names.index(a) for a in axes]
            for j, m in enumerate(idx):
                sf = math.prod(mesh.shape[i] for i in idx[:j] if i > m)
                out[m] = Shard(d) if sf == 1 else StridedShard(d, sf)
        for ax, op in self._spec.partial.items():
            out[mesh.axis_names.index(ax)] = Partial(op)
        return tuple(out)

    @classmethod
    def from_placements(cls, mesh: Mesh, placements: Sequence[Placement], ndim: int) -> Layout:
        """The layout whose :meth:`placements` are ``placements`` for a tensor of ``ndim`` dims.

        The spec has exactly ``ndim`` entries. Where size-1 axes make several orders equivalent,
        the most ascending order is chosen.
        Placements no PartitionSpec can express raise :class:`LayoutError`.
        """
        if not isinstance(mesh, Mesh):
            _lfail(f"from_placements() needs a unimesh.Mesh, got {short(mesh)}")
        nd = check_int(ndim, "ndim", minimum=0, cls=LayoutError)
        if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
            _lfail(f"placements must be a sequence, got {short(placements)}")
        if len(placements) != mesh.ndim:
            _lfail(
                f"got {len(placements)} placements for a mesh of {mesh.ndim} axes "
                f"{mesh.axis_names}; give one per mesh axis"
            )
        by_dim: dict[int, list[tuple[int, int]]] = {}
        partial: dict[str, str] = {}
        for m, p in enumerate(placements):
            if isinstance(p, Replicate):
                continue
            if isinstance(p, Partial):
                if p.op not in REDUCE_OPS:
                    _lfail(
                        f"Partial op {p.op!r} on axis {mesh.axis_names[m]!r} is not one of "
                        f"{REDUCE_OPS}"
                    )
                partial[mesh.axis_names[m]] = p.op
                continue
            if isinstance(p, StridedShard):
                sf = check_int(
                    p.split_factor, "StridedShard split_factor", minimum=1, cls=LayoutError
                )
            elif isinstance(p, Shard):
                sf = 1
            else:
                _lfail(
                    f"placement {short(p)} on axis {mesh.axis_names[m]!r} is not a Shard, "
                    "StridedShard, Replicate or Partial"
                )
            dim = check_int(p.dim, "Shard dim", cls=LayoutError)
            if dim < 0:
                dim += nd
            if not 0 <= dim < nd:
                _lfail(
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
                    _lfail(
                        f"placements {tuple(placements)!r} have no PartitionSpec equivalent: "
                        f"no order of the axes sharding dim {dim} gives axis "
                        f"{mesh.axis_names[m]!r} split_factor {sf}"
                    )
            names = tuple(mesh.axis_names[i] for i in order)
            entries[dim] = names[0] if len(names) == 1 else names
        return cls(mesh, PartitionSpec(*entries, partial=partial or None))


# -- layout maps and logical axis rules ----------------------------------------------------------
def _pairs(rules: object, what: str, form: str) -> list[tuple[Any, Any]]:
    """A mapping or a sequence of pairs as a list of pairs."""
    if isinstance(rules, Mapping):
        return list(rules.items())
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        _lfail(f"{what}s must be a mapping or a list of {form} pairs, got {short(rules)}")
    out = []
    for pair in rules:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            _lfail(f"{what} {short(pair)} is not a {form} pair")
        out.append((pair[0], pair[1]))
    return out


class LayoutMap:
    """Ordered mapping of variable-path patterns to layouts (``keras.distribution.LayoutMap``).

    Lookup follows Keras 3: an exact key wins; else every key is tried as a regex that must
    match the whole path (``re.fullmatch``); two matching keys are an error naming both; none
    gives None.
    Values may be PartitionSpecs or tuples of entries and are validated against ``mesh``.
    """

    def __init__(
        self, mesh: Mesh, rules: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()
    ) -> None:
        if not isinstance(mesh, Mesh):
            _lfail(f"LayoutMap() needs a unimesh.Mesh, got {short(mesh)}")
        self._mesh = mesh
        self._rules: dict[str, Layout] = {}
        self._compiled: dict[str, re.Pattern[str]] = {}
        for key, value in _pairs(rules, "LayoutMap rule", "(pattern, spec)"):
            self[key] = value

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            _lfail(f"LayoutMap keys are regex strings, got {short(key)}")
        try:
            pattern = re.compile(key)
        except re.error as exc:
            _lfail(f"LayoutMap key {key!r} is not a valid regex ({exc})")
        if isinstance(value, Layout):
            if value.mesh != self._mesh:
                _lfail(f"layout for {key!r} is on {value.mesh!r}, not this map's {self._mesh!r}")
            layout = value
        else:
            layout = Layout(self._mesh, value)
        self._rules[key] = layout
        self._compiled[key] = pattern

    def __delitem__(self, key: str) -> None:
        del self._rules[key]
        del self._compiled[key]

    def __getitem__(self, path: str) -> Layout | None:
        return self.get(path)

    def get(self, path: str) -> Layout | None:
        """The layout for a variable path, or None when no key matches."""
        if not isinstance(path, str):
            _lfail(f"LayoutMap lookups take a str path, got {short(path)}")
        if path in self._rules:
            return self._rules[path]
        hits = [k for k, pat in self._compiled.items() if pat.fullmatch(path)]
        if len(hits) > 1:
            _lfail(
                f"path {path!r} matches more than one LayoutMap key: {hits[0]!r} and "
                f"{hits[1]!r}; make the patterns exclusive"
            )
        return self._rules[hits[0]] if hits else None

    def __contains__(self, key: object) -> bool:
        return key in self._rules

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def items(self) -> list[tuple[str, Layout]]:
        return list(self._rules.items())

    def values(self) -> list[Layout]:
        return list(self._rules.values())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayoutMap):
            return NotImplemented
        return self._mesh == other._mesh and list(self._rules.items()) == list(other._rules.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: {v.spec!r}" for k, v in self._rules.items())
        return f"LayoutMap({self._mesh!r}, {{{body}}})"


class AxisRules:
    """Logical axis names -> mesh axes (flax/MaxText logical axis rules).

    ``rules`` is a sequence of ``(logical, mesh_axes)`` pairs (or a mapping); ``mesh_axes`` is a
    mesh axis name, a tuple of names, or None. A logical name may have several rules: for each
    tensor dim the first rule whose mesh axes are all still unused wins (earlier dims first).
    A logical name with no usable rule is replicated, or an error with ``strict=True``.
    """

    def __init__(self, rules: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> None:
        out: list[tuple[str, Entry]] = []
        for logical, target in _pairs(rules, "axis rule", "(logical name, mesh axes)"):
            if not isinstance(logical, str) or not logical:
                _lfail(f"logical axis name {short(logical)} must be a non-empty str")
            out.append((logical, _entry(target, f"rule for {logical!r}")))
        self._rules = tuple(out)

    @property
    def rules(self) -> tuple[tuple[str, Entry], ...]:
        return self._rules

    def __repr__(self) -> str:
        return f"AxisRules({list(self._rules)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AxisRules) and self._rules == other._rules

    def __hash__(self) -> int:
        return hash(self._rules)

    def spec(
        self, logical_axes: Sequence[str | None], mesh: Mesh | None = None, *, strict: bool = False
    ) -> PartitionSpec:
        """The PartitionSpec for a tensor whose dims have these logical names (None: replicated).

        With ``mesh``, rules naming axes absent from it are an error.
        """
        if isinstance(logical_axes, str) or not isinstance(logical_axes, Sequence):
            _lfail(f"logical_axes must be a tuple of logical names, got {short(logical_axes)}")
        if mesh is not None and not isinstance(mesh, Mesh):
            _lfail(f"mesh must be a unimesh.Mesh, got {short(mesh)}")
        known = {name for name, _ in self._rules}
        used: set[str] = set()
        entries: list[Entry] = []
        for name in logical_axes:
            if name is None:
                entries.append(None)
                continue
            if not isinstance(name, str):
                _lfail(f"logical axis {short(name)} must be a str or None")
            if name not in known and strict:
                _lfail(f"no rule for logical axis {name!r}; rules cover {sorted(known)}")
            chosen: Entry = None
            for logical, target in self._rules:
                if logical != name:
                    continue
                axes = _axes_of(target)
                if mesh is not None:
                    for a in axes:
                        if a not in mesh.axis_names:
                            _lfail(
                                f"rule {logical!r} -> {target!r} names axis {a!r}, which is not "
                                f"in {mesh!r}"
                            )
                if target is None or not used.intersection(axes):
                    chosen = target
                    break
            used.update(_axes_of(chosen))
            entries.append(chosen)
        return PartitionSpec(*entries)

    def layout(self, logical_axes: Sequence[str | None], mesh: Mesh) -> Layout:
        """``Layout(mesh, self.spec(logical_axes, mesh))``."""
        return Layout(mesh, self.spec(logical_axes, mesh))
