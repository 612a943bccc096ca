"""The JAX backend: neutral Mesh <-> ``jax.sharding.Mesh``, Layout <-> ``NamedSharding``.

jax is imported inside the functions, never at module import. A neutral device id is a position
in the global device order (sorted by process, then by id within the process), not JAX's id.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from unimesh import (
    Backend,
    ConversionError,
    LaunchError,
    Layout,
    LayoutError,
    Mesh,
    MeshMismatchError,
    P,
    UnsupportedError,
)
from unimesh.launchers import LauncherSign
from unimesh.messages import first_line, short
from unimesh.program import AxisEnv

from .runtime import leave_without_peers, processes, rendezvous

__all__ = [
    "JaxAxisEnv",
    "JaxBackend",
    "global_devices",
    "key_path",
    "request_cpu_devices",
    "use_mesh",
]

_TYPES = {"auto": "Auto", "explicit": "Explicit", "manual": "Manual"}


def _jax() -> Any:
    import jax

    return jax


def global_devices() -> list[Any]:
    """JAX's devices in unimesh's logical order: by process, then by id within the process."""
    return list(_device_array())


_DEVICES: list[Any] = []  # [(device count, object array in logical order)]


def _device_array() -> np.ndarray:
    """:func:`global_devices` as an object array, sorted once per device set (JAX's device
    list is fixed once its runtime has started)."""
    count = _jax().device_count()
    if _DEVICES and _DEVICES[0][0] == count:
        cached: np.ndarray = _DEVICES[0][1]
        return cached
    devs = sorted(_jax().devices(), key=lambda d: (d.process_index, d.id))
    arr = np.fromiter(devs, dtype=object, count=len(devs))  # no per-object inspection
    _DEVICES[:] = [(count, arr)]
    return arr


#: Meshes up to this size are remembered (a repeated conversion returns the same native mesh,
#: as jax.sharding.Mesh itself does for equal devices and names).
_CACHED_MESH_SIZE = 4096


def request_cpu_devices(count: int) -> None:
    """Ask XLA for ``count`` virtual CPU devices (XLA_FLAGS). Only possible before jax is
    imported, and only when nobody has asked already; otherwise it does nothing."""
    import os
    import sys

    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def _axis_types(mesh: Mesh) -> tuple[Any, ...] | None:
    if mesh.axis_types is None:
        return None
    from jax.sharding import AxisType

    return tuple(getattr(AxisType, _TYPES[t]) for t in mesh.axis_types)


@functools.lru_cache(maxsize=256)
def _jax_spec(entries: tuple[Any, ...]) -> Any:
    """JAX's PartitionSpec of a spec's entries with no pending reductions (immutable, so
    shared; keyed by entries: P() and P(None) are equal, JAX's are not)."""
    return _jax().sharding.PartitionSpec(*entries)


@functools.lru_cache(maxsize=256)
def _cached_sharding(
    backend: JaxBackend, layout: Layout, entries: tuple[Any, ...], device_count: int
) -> Any:
    """The NamedSharding of a small layout (immutable in JAX, so shared)."""
    from jax.sharding import NamedSharding

    return NamedSharding(backend.mesh_to_native(layout.mesh), backend._spec(layout))


@functools.lru_cache(maxsize=32)
def _cached_mesh(backend: JaxBackend, mesh: Mesh, device_count: int) -> Any:
    """The native mesh of a small mesh, remembered per device set (a mesh hashes by value)."""
    return backend._build_mesh(mesh)


_JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_EXCHANGES = [0]


def _absent(client: Any, key: str, others: range) -> list[int]:
    """Which of ``others`` have not set their part of the exchange ``key`` (asked without
    waiting; a service that is gone answers for none)."""
    failed = _jax().errors.JaxRuntimeError
    out = []
    for other in others:
        try:
            client.key_value_try_get_bytes(f"{key}{other}")
        except failed:  # NOT_FOUND, or the service is unreachable
            out.append(other)
    return out


class JaxBackend(Backend):
    """JAX (>= 0.5): ``jax.sharding.Mesh``, ``NamedSharding`` and ``jax.Array``."""

    name = "jax"
    framework = "jax"
    launcher_signs = (
        LauncherSign(
            "jax.distributed",
            any_set=("JAX_COORDINATOR_ADDRESS",),
            rank_var="JAX_PROCESS_ID",
            size_var="JAX_NUM_PROCESSES",
            evidence=_JAX_ENV,
        ),
    )
    extra = "jax"
    native_modules = ("jax",)
    features = frozenset({"axis_types", "multi_process", "partial", "tuple_axes"})
    #: XLA's host platform: 4096 CPU devices start in ~1 s; 8192 take ~30 s and 1 GB
    max_simulated_devices = 4096
    max_mesh_axes = 32  # jax.sharding.Mesh flattens its device array with numpy, 32 dims at most
    native_layouts_immutable = True
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "jax.sharding.Mesh (AbstractMesh from_native)",
        "layout": "jax.sharding.NamedSharding(mesh, PartitionSpec)",
        "distribute": "jax.make_array_from_callback",
        "axis_groups": "named axis inside shard_map (no group object)",
        "shard_map": "jax.shard_map",
        "psum": "jax.lax.psum",
        "psum_scatter": "jax.lax.psum_scatter",
        "all_to_all": "jax.lax.all_to_all",
        "ppermute": "jax.lax.ppermute",
        "value_and_grad": "jax.value_and_grad",
        "all_gather": "jax.lax.all_gather(tiled=...)",
        "axis_index": "jax.lax.axis_index",
        "shard_params": "tree_map_with_path + distribute per leaf",
        "launch": "jax.distributed.initialize (JAX_COORDINATOR_ADDRESS, ...)",
    }

    def prepare_devices(self, count: int) -> int:
        """Before jax is imported: ``count`` virtual CPU devices (XLA_FLAGS), shared out over
        the processes when ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
        ``JAX_PROCESS_ID`` ask for a multi-process run, which is then started with
        ``jax.distributed.initialize`` over gloo CPU collectives. Returns the number of global
        devices."""
        import os

        procs = os.environ.get("JAX_NUM_PROCESSES")
        multi = all(os.environ.get(v) for v in _JAX_ENV)
        request_cpu_devices(max(1, count // int(procs)) if multi and procs else count)
        self.initialize(300.0)
        return len(global_devices())

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:
        """``jax.distributed.initialize`` (gloo CPU collectives) from ``JAX_COORDINATOR_ADDRESS``,
        ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (``launch``'s values win over them), every
        process joining within ``timeout`` seconds (checked first by
        :func:`~unimesh_jax.runtime.rendezvous`, which names a process that never came); a
        peer that stops sending heartbeats for ``timeout`` seconds (at least 10, at most JAX's
        default 100) is gone, and JAX ends the others. Where none of the three is known, JAX's
        own cluster detection (SLURM, Open MPI, Cloud TPU, Kubernetes) starts the job, as
        ``jax.distributed.initialize()`` does; no cluster found: one process."""
        import os

        given: dict[str, str | None] = {v: os.environ.get(v) or None for v in _JAX_ENV}
        if launch is not None:
            for var, value in zip(_JAX_ENV, launch):
                if value is not None:
                    given[var] = str(value)
        missing = [v for v, value in given.items() if not value]
        jax = _jax()
        if jax.distributed.is_initialized():
            return int(jax.process_index()), int(jax.process_count())
        cluster = _detected_cluster() if missing else None
        if cluster is not None:
            return self._start_detected(cluster, given, timeout)
        if len(missing) not in (0, len(_JAX_ENV)):
            raise LaunchError(
                f"a multi-process JAX run needs {', '.join(_JAX_ENV)} (or initialize("
                "coordinator_address=..., num_processes=..., process_id=...)); "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (the others "
                "are) and no cluster JAX detects (SLURM, Open MPI, Cloud TPU) is around: set "
                "them on every process (process ids 0..N-1), or none for one process"
            )
        if not missing:
            address = str(given["JAX_COORDINATOR_ADDRESS"])
            try:
                procs, pid = int(str(given["JAX_NUM_PROCESSES"])), int(str(given["JAX_PROCESS_ID"]))
            except ValueError:
                raise LaunchError(
                    f"JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers, got "
                    f"{given['JAX_NUM_PROCESSES']!r} and "
                    f"{given['JAX_PROCESS_ID']!r}"
                ) from None
            if not 0 <= pid < procs:
                raise LaunchError(
                    f"JAX_PROCESS_ID={pid} must be in 0..JAX_NUM_PROCESSES-1 "
                    f"(JAX_NUM_PROCESSES={procs})"
                )
            rendezvous(address, procs, pid, timeout)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            try:
                # a peer silent for longer than this is gone (JAX's default: 100 s), and the
                # exit barrier waits no longer for it
                patience = max(10, min(100, int(timeout)))
                jax.distributed.initialize(
                    address,
                    num_processes=procs,
                    process_id=pid,
                    initialization_timeout=max(1, int(timeout)),
                    heartbeat_timeout_seconds=patience,
                    shutdown_timeout_seconds=patience,
                )
            except RuntimeError as exc:
                if "once" not in str(exc):
                    first = first_line(exc)
                    raise LaunchError(
                        f"jax.distributed.initialize({address!r}, num_processes={procs}, "
                        f"process_id={pid}) failed within {timeout:.0f} s (a peer process may "
                        f"be gone, or JAX already ran a computation): {first}"
                    ) from exc
        return int(jax.process_index()), int(jax.process_count())

    def _start_detected(
        self, cluster: str, given: dict[str, str | None], timeout: float
    ) -> tuple[int, int]:
        """``jax.distributed.initialize`` with what is known; JAX's detection of ``cluster``
        fills in the rest."""
        jax = _jax()
        procs, pid = given["JAX_NUM_PROCESSES"], given["JAX_PROCESS_ID"]
        try:
            jax.distributed.initialize(
                given["JAX_COORDINATOR_ADDRESS"],
                num_processes=None if procs is None else int(procs),
                process_id=None if pid is None else int(pid),
                initialization_timeout=max(1, int(timeout)),
            )
        except (RuntimeError, ValueError) as exc:
            raise LaunchError(
                f"jax.distributed.initialize() found a {cluster} job but could not start it "
                f"within {timeout:.0f} s: {first_line(exc)}; pass coordinator_address, "
                "num_processes and process_id to unimesh.initialize, or set JAX_COORDINATOR_"
                "ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"
            ) from exc
        return int(jax.process_index()), int(jax.process_count())

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """Through the ``jax.distributed`` coordination service's key-value store: each process
        sets its payload, then reads every other one with a deadline."""
        import time

        from jax._src import distributed

        index, count = self.initialize(timeout)
        if count == 1:
            return [payload]
        client: Any = distributed.global_state.client
        _EXCHANGES[0] += 1
        key = f"unimesh/exchange/{_EXCHANGES[0]}/"
        client.key_value_set_bytes(f"{key}{index}", payload)
        deadline = time.monotonic() + timeout
        out = []
        for other in range(count):
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                out.append(bytes(client.blocking_key_value_get_bytes(f"{key}{other}", left)))
            except Exception as exc:  # JaxRuntimeError: deadline exceeded, service gone
                absent = [other, *_absent(client, key, range(other + 1, count))]
                leave_without_peers()
                first = first_line(exc)
                raise MeshMismatchError(
                    f"process {index} of {count}: {processes(absent)} did not take part in the "
                    f"check within {timeout:.0f} s; a peer process is gone or stuck "
                    f"({first[:200]})"
                ) from exc
        return out

    # -- meshes --------------------------------------------------------------------------------
    def _devices_for(self, mesh: Mesh) -> np.ndarray:
        devs = _device_array()
        top = int(mesh.device_ids.max())
        if top >= len(devs):
            raise MeshMismatchError(
                f"{mesh!r} uses device {top}, but JAX sees {len(devs)} "
                f"device{'s' if len(devs) != 1 else ''}; start more "
                "processes, or for CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{top + 1} before importing jax"
            )
        k = mesh.devices_per_process
        local = _jax().local_device_count()
        if k is not None and _jax().process_count() > 1 and k != local:
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
            return _cached_mesh(self, mesh, _jax().device_count())
        return self._build_mesh(mesh)

    def _build_mesh(self, mesh: Mesh) -> Any:
        from jax.sharding import Mesh as JMesh

        devices = self._devices_for(mesh)
        types = _axis_types(mesh)
        if types is None:
            return JMesh(devices, mesh.axis_names)
        return JMesh(devices, mesh.axis_names, axis_types=types)

    def _mesh_from_native(self, jmesh: Any) -> Mesh:
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
        if _jax().process_count() > 1:
            dpp = _jax().local_device_count()
        return Mesh(
            ids.shape, tuple(jmesh.axis_names), ids, axis_types=types, devices_per_process=dpp
        )

    # -- layouts -------------------------------------------------------------------------------
    def _spec(self, layout: Layout) -> Any:
        partial = layout.spec.partial
        if not partial:
            return _jax_spec(tuple(layout.spec))
        jp: Any = _jax().sharding.PartitionSpec

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
            return _cached_sharding(self, layout, key, _jax().device_count())
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
        jax = _jax()
        self._placeable(layout)
        sharding = self.layout_to_native(layout, **options)
        host = np.asarray(array)
        # dtype given: a process holding none of the mesh's devices has no block to infer it from
        return jax.make_array_from_callback(
            host.shape, sharding, lambda index: host[index], dtype=host.dtype
        )

    def process_devices(self, mesh: Mesh) -> tuple[int, ...]:
        """The mesh's devices among ``jax.local_devices()``, as logical ids."""
        jax = _jax()
        local = set(jax.local_devices())
        mine = [i for i, d in enumerate(global_devices()) if d in local]
        ids = mesh.device_ids.ravel()
        return tuple(int(i) for i in np.unique(ids[np.isin(ids, mine)]).tolist())

    def from_local(
        self,
        blocks: dict[int, Any],
        layout: Layout,
        shape: tuple[int, ...],
        dtype: Any = None,
        **options: Any,
    ) -> Any:
        """``jax.make_array_from_single_device_arrays`` of each local device's block, put on
        that device."""
        jax = _jax()
        self._placeable(layout)
        sharding = self.layout_to_native(layout, **options)
        devices = global_devices()
        arrays = [jax.device_put(blocks[d], devices[d]) for d in sorted(blocks)]
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

    def native_code(self, mesh: Mesh) -> str:
        """``jax.make_mesh`` where the devices are in the default order, else
        ``jax.sharding.Mesh`` over the devices in unimesh's order (by process, then id); the axis
        types spelled out, as to_native gives them."""
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

    def native_layout_code(self, layout: Layout) -> str:
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
        jax = _jax()
        return jax.jit(lambda a, b: a @ b)(array, weight)

    def stop_gradient(self, x: Any) -> Any:
        return _jax().lax.stop_gradient(x)

    def compile(self, fn: Any, options: dict[str, Any]) -> Any:
        """``jax.jit(fn, **options)``: a unimesh step's programs are ``jax.shard_map``."""
        return _jax().jit(fn, **options)

    def local_shards(self, array: Any) -> dict[int, Any]:
        """``{logical device id: numpy block}`` for this process's addressable shards."""
        position = {d: i for i, d in enumerate(global_devices())}
        return {position[s.device]: np.asarray(s.data) for s in array.addressable_shards}

    # -- programs --------------------------------------------------------------------------------
    def shard_map(self, body: Any, mesh: Mesh, ins: Any, outs: Any) -> Any:
        """``jax.shard_map`` over the converted mesh (``check_vma`` on: JAX checks that an
        output is equal along the axes its spec leaves out). Jit the result as usual."""
        jax = _jax()
        env = JaxAxisEnv(mesh)
        return jax.shard_map(
            lambda *blocks: body(env, *blocks),
            mesh=self.mesh_to_native(mesh),
            in_specs=ins.map(self._spec),
            out_specs=outs.map(self._spec),
        )

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Any:
        """``jax.value_and_grad``; each gradient is placed like its argument."""
        jax = _jax()
        vg = jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux)

        def placed(g: Any, a: Any) -> Any:
            sharding = getattr(a, "sharding", None)
            if sharding is None or isinstance(g, jax.core.Tracer) or g.sharding == sharding:
                return g
            return jax.device_put(g, sharding)

        def run(*args: Any) -> Any:
            value, grads = vg(*args)
            return value, tuple(
                jax.tree_util.tree_map(placed, g, args[i]) for g, i in zip(grads, argnums)
            )

        return run

    def full_array(self, array: Any) -> Any:
        """numpy of a ``jax.Array``; gathered from every process when not all addressable."""
        if getattr(array, "is_fully_addressable", True):
            return np.asarray(array)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    def param_paths(self, model: Any) -> list[tuple[str, tuple[int, ...]]]:
        """Each leaf's key path (``a/b/0``) and shape."""
        leaves = _jax().tree_util.tree_flatten_with_path(model)[0]
        return [(key_path(path), tuple(np.shape(leaf))) for path, leaf in leaves]

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """A new pytree whose leaves are placed by ``resolve(path, shape)``; a path joins the
        key entries with ``/`` (dict keys, attribute names, sequence indices)."""
        jax = _jax()

        def place(path: Any, leaf: Any) -> Any:
            host = np.asarray(leaf)
            if host.dtype.kind not in "biufc":
                where = key_path(path) or "(the root)"
                raise ConversionError(
                    f"shard_params() lays out a pytree of arrays; leaf {where!r} is "
                    f"{short(leaf)} ({type(leaf).__name__}); pass the parameters' pytree"
                )
            return self.distribute(host, resolve(key_path(path), host.shape))

        return jax.tree_util.tree_map_with_path(place, model)


def _detected_cluster() -> str | None:
    """The name of the cluster JAX's ``jax.distributed.initialize()`` would detect from the
    environment (SLURM, Open MPI, Cloud TPU, Kubernetes), or None. Asks JAX's own list of
    cluster kinds; an internal it no longer has means no detection (one process)."""
    try:
        from jax._src import clusters

        kinds = list(clusters.ClusterEnv._cluster_types)
        for kind in kinds:
            if not getattr(kind, "opt_in_only_method", False) and kind.is_env_present():
                return str(getattr(kind, "name", kind.__name__))
    except Exception:  # noqa: BLE001 - a JAX internal: any failure means "none detected"
        return None
    return None


def key_path(path: Any) -> str:
    """A JAX key path as ``a/b/0`` (how :func:`unimesh.shard_params` names pytree leaves)."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts)


class JaxAxisEnv(AxisEnv):
    """Axis collectives as ``jax.lax`` calls on the named axes of the enclosing shard_map."""

    @staticmethod
    def _varying(x: Any, axes: tuple[str, ...]) -> Any:
        """``x`` marked as varying along ``axes`` where JAX tracks it as equal there: a psum of
        a value equal along an axis is its size times the value on every backend, and JAX's
        own check would refuse the call instead."""
        jax = _jax()
        x = jax.numpy.asarray(x)
        aval = jax.typeof(x)
        kinds = getattr(aval, "manual_axis_type", None)  # JAX 0.10; older JAX: aval.vma
        vma = kinds.varying if kinds is not None else getattr(aval, "vma", None)
        missing = tuple(a for a in axes if vma is not None and a not in vma)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    def reduce(self, x: Any, axes: tuple[str, ...], op: str) -> Any:
        lax = _jax().lax
        return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op](self._varying(x, axes), axes)

    def all_gather(
        self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool, invariant: bool
    ) -> Any:
        """``lax.all_gather``; ``invariant``: JAX knows the result is equal along ``axes``
        (``to="invarying"``), so an out_spec may leave those axes out, as after a psum."""
        return _jax().lax.all_gather(
            self._varying(x, axes),
            axes,
            axis=dim,
            tiled=tiled,
            to="invarying" if invariant else "varying",
        )

    def psum_scatter(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        return _jax().lax.psum_scatter(
            self._varying(x, axes), axes, scatter_dimension=dim, tiled=tiled
        )

    def all_to_all(
        self, x: Any, axes: tuple[str, ...], split_axis: int, concat_axis: int, tiled: bool
    ) -> Any:
        """``lax.all_to_all``; untiled as the tiled one on the split dim moved to the front
        (JAX 0.10's transpose of an untiled all_to_all with split != concat fails with a
        cotangent shape error)."""
        jax = _jax()
        x = self._varying(x, axes)
        if tiled:
            return jax.lax.all_to_all(x, axes, split_axis, concat_axis, tiled=True)
        front = jax.numpy.moveaxis(x, split_axis, 0)
        return jax.numpy.moveaxis(jax.lax.all_to_all(front, axes, 0, 0, tiled=True), 0, concat_axis)

    def ppermute(self, x: Any, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> Any:
        """``lax.ppermute``. JAX numbers the devices of a tuple of axes in mesh order there
        (unlike its own ``axis_index`` and ``all_gather``, which follow the tuple's order), so
        indices are translated when the tuple is not in mesh order."""
        ordered = tuple(sorted(axes, key=self.mesh.axis_names.index))
        if ordered != axes:
            sizes = [self.mesh.axis_size(a) for a in axes]

            def in_mesh_order(index: int) -> int:
                coords = dict(zip(axes, np.unravel_index(index, sizes)))
                return int(
                    np.ravel_multi_index(
                        [coords[a] for a in ordered], [self.mesh.axis_size(a) for a in ordered]
                    )
                )

            perm = tuple((in_mesh_order(a), in_mesh_order(b)) for a, b in perm)
        return _jax().lax.ppermute(self._varying(x, ordered), ordered, perm)

    def pbroadcast(self, x: Any, axes: tuple[str, ...], source: int) -> Any:
        """A psum of the source's value and zeros elsewhere (``lax.pbroadcast`` has no CPU
        lowering in JAX 0.10); JAX differentiates it to a sum at the source."""
        jax = _jax()
        x = self._varying(x, axes)
        mine = jax.numpy.where(jax.lax.axis_index(axes) == source, x, jax.numpy.zeros_like(x))
        return jax.lax.psum(mine, axes)

    def axis_index(self, axes: tuple[str, ...]) -> Any:
        return _jax().lax.axis_index(axes)


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Any]:
    """Make ``mesh`` current for unimesh and for JAX (``jax.set_mesh``); yields the JAX mesh."""
    import unimesh

    native = unimesh.to_native(mesh, "jax")
    with mesh, _jax().set_mesh(native):
        yield native
