"""The JAX backend's translator layer: neutral Mesh <-> ``jax.sharding.Mesh``, Layout <->
``NamedSharding``, distributed arrays in and out. A neutral device id is a position in the global
device order (sorted by process, then by id within the process), not JAX's id."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from unimesh import (
    ConversionError,
    Layout,
    LayoutError,
    Mesh,
    MeshMismatchError,
    P,
    UnsupportedError,
)
from unimesh.messages import short

from .runtime import JaxRuntime, device_array, global_devices, import_jax

#: host bytes of blocks in flight to their devices in one from_local, at most (see from_local)
_STAGED = 32 << 20

_TYPES = {"auto": "Auto", "explicit": "Explicit", "manual": "Manual"}


#: Meshes up to this size are remembered (a repeated conversion returns the same native mesh,
#: as jax.sharding.Mesh itself does for equal devices and names).
_CACHED_MESH_SIZE = 4096


def _axis_types(mesh: Mesh) -> tuple[Any, ...] | None:
    if mesh.axis_types is None:
        return None
    from jax.sharding import AxisType

    return tuple(getattr(AxisType, _TYPES[t]) for t in mesh.axis_types)


@functools.lru_cache(maxsize=256)
def _jax_spec(entries: tuple[Any, ...]) -> Any:
    """JAX's PartitionSpec of a spec's entries with no pending reductions (immutable, so
    shared; keyed by entries: P() and P(None) are equal, JAX's are not)."""
    return import_jax().sharding.PartitionSpec(*entries)


@functools.lru_cache(maxsize=256)
def _cached_sharding(
    backend: JaxTranslator, layout: Layout, entries: tuple[Any, ...], device_count: int
) -> Any:
    """The NamedSharding of a small layout (immutable in JAX, so shared)."""
    from jax.sharding import NamedSharding

    return NamedSharding(backend.mesh_to_native(layout.mesh), backend._spec(layout))


@functools.lru_cache(maxsize=32)
def _cached_mesh(backend: JaxTranslator, mesh: Mesh, device_count: int) -> Any:
    """The native mesh of a small mesh, remembered per device set (a mesh hashes by value)."""
    return backend._build_mesh(mesh)


@functools.lru_cache(maxsize=64)
def _cached_neutral(backend: JaxTranslator, jmesh: Any, device_count: int) -> Mesh:
    """The unimesh Mesh of a JAX mesh (immutable and hashable in JAX, so remembered: an
    array's sharding is read on every reshard and save)."""
    return backend._neutral_mesh(jmesh)


class JaxTranslator(JaxRuntime):
    """The translator layer, on the runtime's device order."""

    # -- meshes --------------------------------------------------------------------------------
    def _devices_for(self, mesh: Mesh) -> np.ndarray:
        devs = device_array()
        top = int(mesh.device_ids.max())
        if top >= len(devs):
            raise MeshMismatchError(
                f"{mesh!r} uses device {top}, but JAX sees {len(devs)} "
                f"device{'s' if len(devs) != 1 else ''}; start more "
                "processes, or for CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{top + 1} before importing jax"
            )
        k = mesh.devices_per_process
        local = import_jax().local_device_count()
        if k is not None and import_jax().process_count() > 1 and k != local:
            raise MeshMismatchError(
                f"{mesh!r} says {k} devices per process, but each JAX process has {local}"
            )
        out: np.ndarray = devs[mesh.device_ids]
        return out

    def mesh_to_native(self, mesh: Mesh, *, abstract: bool = False, **options: Any) -> Any:
        """A ``jax.sharding.Mesh`` over the devices at the mesh's logical positions; with
        ``abstract=True`` a ``jax.sharding.AbstractMesh`` (sizes, names and types, no devices:
        for any size, on any machine).

        ``axis_types`` become ``jax.sharding.AxisType``; with None the mesh gets the default of
        ``jax.sharding.Mesh(...)``, which is ``Auto`` for every axis (``jax.make_mesh`` would
        give ``Explicit``).
        """
        self.reject_options(options, "abstract")
        if abstract:
            from jax.sharding import AbstractMesh

            types = _axis_types(mesh)
            if types is None:
                return AbstractMesh(mesh.shape, mesh.axis_names)
            return AbstractMesh(mesh.shape, mesh.axis_names, axis_types=types)
        if mesh.size <= _CACHED_MESH_SIZE:
            return _cached_mesh(self, mesh, import_jax().device_count())
        return self._build_mesh(mesh)

    def _build_mesh(self, mesh: Mesh) -> Any:
        from jax.sharding import Mesh as JMesh

        devices = self._devices_for(mesh)
        types = _axis_types(mesh)
        if types is None:
            return JMesh(devices, mesh.axis_names)
        return JMesh(devices, mesh.axis_names, axis_types=types)

    def _mesh_from_native(self, jmesh: Any) -> Mesh:
        if jmesh.size <= _CACHED_MESH_SIZE:
            return _cached_neutral(self, jmesh, import_jax().device_count())
        return self._neutral_mesh(jmesh)

    def _neutral_mesh(self, jmesh: Any) -> Mesh:
        from jax.sharding import AbstractMesh

        types: tuple[str, ...] | None = tuple(str(t.name).lower() for t in jmesh.axis_types)
        if types is not None and all(t == "auto" for t in types):
            types = None  # JAX's Mesh(...) default: unimesh's "no axis types"
        if isinstance(jmesh, AbstractMesh):
            # no devices: the neutral mesh gets the default order, 0..size-1
            return Mesh(tuple(jmesh.axis_sizes), tuple(jmesh.axis_names), axis_types=types)
        position = {d: i for i, d in enumerate(global_devices())}
        try:
            ids = np.vectorize(position.__getitem__, otypes=[np.int64])(jmesh.devices)
        except KeyError as exc:  # pragma: no cover - a device JAX itself does not list
            raise MeshMismatchError(
                f"{jmesh} holds device {exc}, which jax.devices() does not list"
            ) from exc
        dpp = None
        if import_jax().process_count() > 1:
            dpp = import_jax().local_device_count()
        return Mesh(
            ids.shape, tuple(jmesh.axis_names), ids, axis_types=types, devices_per_process=dpp
        )

    # -- layouts -------------------------------------------------------------------------------
    def _spec(self, layout: Layout) -> Any:
        partial = layout.spec.partial
        if not partial:
            return _jax_spec(tuple(layout.spec))
        jp: Any = import_jax().sharding.PartitionSpec

        bad = {a: op for a, op in partial.items() if op != "sum"}
        if bad:
            raise UnsupportedError(
                f"JAX keeps only pending sums (unreduced axes); {layout.spec!r} asks for {bad}",
                backend=self.name,
                capability="partial",
            )
        if partial:
            types = dict(zip(layout.mesh.axis_names, layout.mesh.axis_types or ()))
            implicit = [a for a in partial if types.get(a) != "explicit"]
            if implicit:
                raise UnsupportedError(
                    f"JAX keeps a pending sum (unreduced) only over 'explicit' axes; {implicit} "
                    f"of {layout.mesh!r} are not: give the mesh axis_types with 'explicit' there",
                    backend=self.name,
                    capability="partial",
                )
            return jp(*layout.spec, unreduced=set(partial))
        return jp(*layout.spec)

    def layout_to_native(self, layout: Layout, **options: Any) -> Any:
        """A ``NamedSharding`` on the converted mesh; partial sums become ``unreduced`` axes."""
        if not options and layout.mesh.size <= _CACHED_MESH_SIZE:
            key = tuple(layout.spec)  # P() and P(None) are equal, JAX's specs are not
            return _cached_sharding(self, layout, key, import_jax().device_count())
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh_to_native(layout.mesh, **options), self._spec(layout))

    def from_native(self, obj: Any) -> Any:
        from jax.sharding import AbstractMesh, NamedSharding
        from jax.sharding import Mesh as JMesh

        if isinstance(obj, (JMesh, AbstractMesh)):
            return self._mesh_from_native(obj)
        if isinstance(obj, NamedSharding):
            mesh = self._mesh_from_native(obj.mesh)
            spec = obj.spec
            entries = []
            for e in getattr(spec, "partitions", spec):  # `partitions`: JAX with unreduced
                if e is spec.UNCONSTRAINED:
                    raise UnsupportedError(
                        f"{spec} has an UNCONSTRAINED entry, which unimesh cannot hold",
                        backend=self.name,
                        capability="layout",
                    )
                entries.append(e)
            if getattr(spec, "reduced", None):
                raise UnsupportedError(
                    f"{spec} has reduced axes, which unimesh cannot hold",
                    backend=self.name,
                    capability="partial",
                )
            unreduced = getattr(spec, "unreduced", None) or ()
            partial = {a: "sum" for a in sorted(unreduced)} or None
            return Layout(mesh, P(*entries, partial=partial))
        raise ConversionError(
            f"the jax backend converts Mesh, AbstractMesh and NamedSharding, not {short(obj)} "
            f"({type(obj).__module__}.{type(obj).__qualname__})"
        )

    def distribute(self, array: Any, layout: Layout, **options: Any) -> Any:
        """A global ``jax.Array`` with ``NamedSharding``; each addressable shard is the reference
        block. Built from per-device blocks, so it works across processes as well."""
        jax = import_jax()
        self._placeable(layout)
        sharding = self.layout_to_native(layout, **options)
        host = np.asarray(array)
        # dtype given: a process holding none of the mesh's devices has no block to infer it from
        return jax.make_array_from_callback(
            host.shape, sharding, lambda index: host[index], dtype=host.dtype
        )

    def process_devices(self, mesh: Mesh) -> tuple[int, ...]:
        """The mesh's devices among ``jax.local_devices()``, as logical ids."""
        jax = import_jax()
        local = set(jax.local_devices())
        mine = [i for i, d in enumerate(global_devices()) if d in local]
        ids = mesh.device_ids.ravel()
        return tuple(int(i) for i in np.unique(ids[np.isin(ids, mine)]).tolist())

    def from_local(
        self,
        blocks: Mapping[int, Any],
        layout: Layout,
        shape: tuple[int, ...],
        dtype: Any = None,
        **options: Any,
    ) -> Any:
        """``jax.make_array_from_single_device_arrays`` of each local device's block, put on
        that device."""
        jax = import_jax()
        self._placeable(layout)
        sharding = self.layout_to_native(layout, **options)
        devices = global_devices()
        arrays: list[Any] = []
        pending, staged = 0, 0  # copies not yet waited for, and their host bytes
        for d in sorted(blocks):
            block = blocks[d]
            size = int(getattr(block, "nbytes", 0))
            if staged and staged + size > _STAGED:
                # a checkpoint load reads blocks on demand: bound the host bytes still being
                # copied (each block is let go once on its device), keeping the copies async
                jax.block_until_ready(arrays[pending:])
                pending, staged = len(arrays), 0
            arrays.append(jax.device_put(block, devices[d]))
            staged += size
            del block
        if arrays:
            dtype = arrays[0].dtype
        elif dtype is None:
            raise LayoutError(
                f"this process holds none of {layout.mesh!r}'s devices, so no block says the "
                "array's type; pass dtype=... (e.g. numpy.float32) on every process"
            )
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)

    def _placeable(self, layout: Layout) -> None:
        """Arrays live on meshes without manual axes."""
        types = layout.mesh.axis_types or ()
        if "manual" in types:
            manual = [n for n, t in zip(layout.mesh.axis_names, types) if t == "manual"]
            raise UnsupportedError(
                f"cannot place an array on {layout.mesh!r}: axes {manual} are 'manual', which "
                "JAX uses only inside shard_map; distribute on the mesh with those axes 'auto' "
                "or 'explicit'",
                backend=self.name,
                capability="distribute",
            )

    def native_code(self, of: Mesh | Layout) -> str:
        """``jax.make_mesh`` where the devices are in the default order, else
        ``jax.sharding.Mesh`` over the devices in unimesh's order (by process, then id); the axis
        types spelled out, as to_native gives them. A layout: :meth:`_layout_code`."""
        if isinstance(of, Layout):
            return self._layout_code(of)
        mesh = of
        names = tuple(mesh.axis_names)
        kinds = [_TYPES[t] for t in mesh.axis_types] if mesh.axis_types else ["Auto"] * mesh.ndim
        types = (
            "(" + ", ".join(f"AxisType.{k}" for k in kinds) + ("," if mesh.ndim == 1 else "") + ")"
        )
        note = (
            "# axis types "
            + ", ".join(f"{n}: {k}" for n, k in zip(names, kinds))
            + " (jax.make_mesh's default would be Explicit)\n"
        )
        head = "import jax\nfrom jax.sharding import AxisType\n"
        if mesh.is_default_order and mesh.devices_per_process is None:
            return (
                head
                + "\n"
                + note
                + f"mesh = jax.make_mesh({mesh.shape}, {names}, axis_types={types})"
            )
        return (
            head + "import numpy as np\n\n"
            "# unimesh's device ids are positions in this order\n"
            "devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))\n"
            + note
            + "mesh = jax.sharding.Mesh(np.array(devices, dtype=object)"
            f"[np.array({mesh.device_ids.tolist()})], {names}, axis_types={types})"
        )

    def _layout_code(self, layout: Layout) -> str:
        """``NamedSharding(mesh, P(...))``."""
        self._spec(layout)  # what to_native refuses, this refuses too
        parts = [repr(e) for e in layout.spec]
        if layout.spec.partial:
            parts.append(f"unreduced={set(layout.spec.partial)!r}")
        entries = ", ".join(parts)
        return (
            "from jax.sharding import NamedSharding, PartitionSpec as P\n\n"
            f"sharding = NamedSharding(mesh, P({entries}))\n"
            "# array = jax.device_put(array, sharding)"
        )

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """``jax.jit`` of the matmul: XLA's sharding propagation does the rest."""
        jax = import_jax()
        return jax.jit(lambda a, b: a @ b)(array, weight)

    def local_shards(self, array: Any) -> dict[int, Any]:
        """``{logical device id: numpy block}`` for this process's addressable shards."""
        position = {d: i for i, d in enumerate(global_devices())}
        return {position[s.device]: np.asarray(s.data) for s in array.addressable_shards}

    # -- live reshard: unimesh.reshard's transport on JAX --------------------------------------
    def native_blocks(self, array: Any) -> dict[int, Any]:
        """``{logical device id: the shard's jax.Array}``, each on its device (no copy)."""
        position = {d: i for i, d in enumerate(global_devices())}
        return {position[s.device]: s.data for s in array.addressable_shards}

    def process_count(self) -> int:
        return int(import_jax().process_count())
