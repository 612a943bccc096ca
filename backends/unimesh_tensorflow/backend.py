"""The TensorFlow DTensor backend (single client): neutral Mesh/Layout <->
``dtensor.Mesh``/``Layout``.

DTensor numbers mesh positions 0..N-1 in row-major order (its ``global_device_ids``); the neutral
device order goes into which device sits at each position (``local_devices``). A neutral device id
is a position in ``tf.config.list_logical_devices(device_type)``. tensorflow is imported inside the
functions, never at module import.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from unimesh import (
    Backend,
    ConversionError,
    Layout,
    Mesh,
    MeshMismatchError,
    P,
    UnsupportedError,
)
from unimesh.messages import short
from unimesh.transport import Transport

__all__ = ["TensorFlowBackend", "configure_cpu_devices"]


#: dim names DTensor gives a meaning of its own (its layout's sharding specs)
_RESERVED = frozenset({"unsharded", "any", "match"})


def _tf() -> Any:
    import tensorflow as tf

    _keep_autograph_out()
    return tf


@functools.cache  # once per process
def _keep_autograph_out() -> None:
    """Inside ``tf.function``, AutoGraph rewrites the Python of every function a traced
    function calls, unless its module is on its do-not-convert list (numpy's, keras's are):
    unimesh's calls there (``reshard`` of a symbolic DTensor) are plain Python over
    layouts, run as written, so their modules join that list (TF's own configuration
    module; where a TF version lacks it, AutoGraph only warns that it cannot convert them)."""
    try:
        from tensorflow.python.autograph.core import config, config_lib
    except ImportError:  # pragma: no cover - a TF without AutoGraph's configuration module
        return
    rules = getattr(config, "CONVERSION_RULES", None)
    if isinstance(rules, tuple) and hasattr(config_lib, "DoNotConvert"):
        mine = ("unimesh", "unimesh_tensorflow", "unimesh_keras")
        extra = tuple(config_lib.DoNotConvert(m) for m in mine)
        config.CONVERSION_RULES = extra + rules


def _dtensor() -> Any:
    from tensorflow.experimental import dtensor

    return dtensor


def configure_cpu_devices(count: int) -> None:
    """Split the host CPU into ``count`` logical devices. Must run before any other TensorFlow
    call that starts its runtime; afterwards TensorFlow refuses, and this says so."""
    tf = _tf()
    cpus = tf.config.list_physical_devices("CPU")  # listing logical devices would start it
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    except RuntimeError as exc:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == count:
            return
        raise MeshMismatchError(
            f"TensorFlow is already initialised with {have} logical CPU devices and cannot be "
            f"given {count}: call unimesh_tensorflow.configure_cpu_devices({count}) before any "
            "other TensorFlow call"
        ) from exc


class TensorFlowBackend(Backend):
    """TensorFlow DTensor (``tf.experimental.dtensor``), one client."""

    name = "tensorflow"
    #: logical CPU devices: 4096 start in ~4 s; 2**20 take ~145 s and 5.7 GB
    max_simulated_devices = 4096
    framework = "tensorflow"
    #: the CPU wheel is a distribution of its own
    distributions = ("tensorflow", "tensorflow-cpu")
    extra = "tensorflow"
    native_modules = ("tensorflow",)
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "tf.experimental.dtensor.Mesh",
        "layout": "tf.experimental.dtensor.Layout",
        "distribute": "dtensor.copy_to_mesh + dtensor.relayout",
        "launch": "one client (DTENSOR_NUM_CLIENTS=1); tf.config.set_logical_device_configuration "
        "for CPU devices",
    }

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:
        """One DTensor client: nothing to start. A multi-client launch (DTensor's
        ``DTENSOR_NUM_CLIENTS`` above 1, or launch parameters) is refused instead of running
        each client alone."""
        import os

        super().initialize(timeout, launch)  # refuses launch parameters
        clients = os.environ.get("DTENSOR_NUM_CLIENTS", "1").strip() or "1"
        if clients != "1":
            raise UnsupportedError(
                f"DTENSOR_NUM_CLIENTS={clients}: the tensorflow backend runs one DTensor client "
                "(multi-client DTensor is not supported); unset DTENSOR_NUM_CLIENTS, or use the "
                "jax or torch backend for several processes",
                backend=self.name,
                capability="multi_process",
            )
        return 0, 1

    def prepare_devices(self, count: int) -> int:
        """``count`` logical CPU devices if TensorFlow's runtime has not started; returns how
        many there are."""
        with contextlib.suppress(MeshMismatchError):  # started earlier: use what it has
            configure_cpu_devices(count)
        return len(self._devices("CPU"))

    def _devices(self, device_type: str) -> list[Any]:
        return list(_tf().config.list_logical_devices(device_type))

    def mesh_to_native(self, mesh: Mesh, *, device_type: str = "CPU", **options: Any) -> Any:
        """``dtensor.Mesh`` with positions 0..N-1 and, at position i, the logical device
        ``device_ids.flat[i]``."""
        self.reject_options(options, "device_type")
        reserved = [a for a in mesh.axis_names if a in _RESERVED]
        if reserved:
            raise UnsupportedError(
                f"DTensor reserves the dim names {sorted(_RESERVED)}, and {mesh!r} uses "
                f"{reserved}: rename those axes (Mesh.rename)",
                backend=self.name,
                capability="mesh",
            )
        devices = self._devices(device_type)
        top = int(mesh.device_ids.max())
        if top >= len(devices):
            raise MeshMismatchError(
                f"{mesh!r} uses device {top}, but TensorFlow has {len(devices)} logical "
                f"{device_type} devices; for CPU call unimesh_tensorflow.configure_cpu_devices("
                f"{top + 1}) before any other TensorFlow call"
            )
        n = mesh.size
        tf = _tf()
        full = []
        for d in devices:  # DTensor wants fully qualified names (job, replica, task)
            spec = tf.DeviceSpec.from_string(d.name)
            full.append(
                tf.DeviceSpec(
                    job="localhost",
                    replica=0,
                    task=0,
                    device_type=spec.device_type,
                    device_index=spec.device_index,
                ).to_string()
            )
        local = [full[i] for i in mesh.device_ids.ravel().tolist()]
        return _dtensor().Mesh(
            list(mesh.axis_names), np.arange(n).reshape(mesh.shape), list(range(n)), local
        )

    def _mesh_from_native(self, native: Any) -> Mesh:
        if native.is_single_device():  # Mesh.from_device: no axes, no device ids to read
            raise UnsupportedError(
                f"{native.to_string()!r} is a single-device DTensor mesh "
                "(dtensor.Mesh.from_device), which has no axes; a unimesh Mesh has at least one: "
                "describe it as unimesh.Mesh((1,), ('x',)) (dtensor.create_mesh([('x', 1)]))",
                backend=self.name,
                capability="mesh",
            )
        names = list(native.dim_names)
        shape = tuple(int(s) for s in native.shape())
        global_ids = np.asarray(native.global_device_ids())
        local_ids = [int(i) for i in native.local_device_ids()]
        if len(local_ids) != global_ids.size:
            raise UnsupportedError(
                f"{native} spans several DTensor clients; the tensorflow backend handles one",
                backend=self.name,
                capability="multi_process",
            )
        tf = _tf()

        def key(name: str) -> tuple[str, int]:
            spec = tf.DeviceSpec.from_string(name)
            return (spec.device_type or "CPU").upper(), int(spec.device_index or 0)

        devices = [str(d) for d in native.local_devices()]
        kinds = {key(d)[0] for d in devices}
        index = {key(d.name): i for kind in kinds for i, d in enumerate(self._devices(kind))}
        ids = np.empty(global_ids.size, dtype=np.int64)
        for pos, dev in zip(local_ids, devices):
            if key(dev) not in index:
                raise MeshMismatchError(
                    f"{native} holds {dev}, which this TensorFlow does not "
                    "list among its logical devices"
                )
            ids[pos] = index[key(dev)]
        return Mesh(shape, tuple(names), ids.reshape(shape))

    def describe_native(self, native: Any) -> str:
        """A DTensor Mesh or Layout as readable lines (their ``repr`` is one line of
        ``from_string`` text with every device's full name)."""
        mesh = getattr(native, "mesh", native)
        dims = ", ".join(f"{n}={k}" for n, k in zip(mesh.dim_names, mesh.shape()))
        local = [str(d) for d in mesh.local_devices()]
        task = local[0].rsplit("/", 1)[0] if local else ""
        names = [d.rsplit("device:", 1)[-1] for d in local]
        if len(names) > 2 and names == [f"{mesh.device_type()}:{i}" for i in range(len(names))]:
            names = [f"{names[0]} .. {names[-1]}"]
        lines = [
            f"dtensor.Mesh({dims}), device type {mesh.device_type()}",
            f"  global device ids: {mesh.global_device_ids().tolist()}",
            f"  local devices: {', '.join(names)} ({len(local)}, on {task})",
        ]
        if native is not mesh:
            lines.insert(0, f"dtensor.Layout(sharding_specs={list(native.sharding_specs)}) on")
        return "\n".join(lines)

    def layout_to_native(self, layout: Layout, *, rank: int | None = None, **options: Any) -> Any:
        """``dtensor.Layout`` with one sharding spec per tensor dim (``UNSHARDED`` for None);
        ``rank`` pads the spec with ``UNSHARDED`` for a tensor with more dims."""
        dtensor = _dtensor()
        entries = list(layout.spec)
        if rank is not None:
            if rank < len(entries):
                raise UnsupportedError(
                    f"rank {rank} is less than the {len(entries)} entries of {layout.spec!r}",
                    backend=self.name,
                )
            entries += [None] * (rank - len(entries))
        specs = [dtensor.UNSHARDED if e is None else e for e in entries]
        return dtensor.Layout(specs, self.mesh_to_native(layout.mesh, **options))

    def from_native(self, obj: Any) -> Any:
        dtensor = _dtensor()
        if isinstance(obj, dtensor.Mesh):
            return self._mesh_from_native(obj)
        if isinstance(obj, dtensor.Layout):
            entries: list[str | None] = []
            for s in obj.sharding_specs:
                if s == dtensor.UNSHARDED:
                    entries.append(None)
                elif s == dtensor.MATCH:
                    raise UnsupportedError(
                        f"{obj} has a 'match' entry, which unimesh cannot hold",
                        backend=self.name,
                        capability="layout",
                    )
                else:
                    entries.append(s)
            return Layout(self._mesh_from_native(obj.mesh), P(*entries))
        layout = self._tensor_layout(obj)
        if layout is not None:
            return self.from_native(layout)
        raise ConversionError(
            f"the tensorflow backend converts dtensor.Mesh, dtensor.Layout and DTensors, not "
            f"{short(obj)} "
            f"({type(obj).__module__}.{type(obj).__qualname__})"
        )

    @staticmethod
    def _tensor_layout(obj: Any) -> Any:
        """The ``dtensor.Layout`` of a DTensor, None for anything else."""
        tf = _tf()
        if not isinstance(obj, (tf.Tensor, tf.Variable)) or tf.is_symbolic_tensor(obj):
            return None  # a traced tensor's layout cannot be read (fetch_layout is eager)
        try:
            with tf.init_scope():  # eagerly, also for a DVariable or a tensor a function holds
                return _dtensor().fetch_layout(obj)
        except (ValueError, TypeError, RuntimeError, tf.errors.OpError):
            return None

    def from_local(
        self,
        blocks: Mapping[int, Any],
        layout: Layout,
        shape: tuple[int, ...],
        dtype: Any = None,
        **options: Any,
    ) -> Any:
        """``dtensor.pack`` of the blocks, one per local device in the mesh's device order
        (DTensor's components are those of ``unpack``)."""
        tf, dtensor = _tf(), _dtensor()
        native = self.layout_to_native(layout, rank=len(shape), **options)
        ids = layout.mesh.device_ids.ravel().tolist()
        parts = [tf.convert_to_tensor(np.asarray(blocks[d])) for d in ids]
        return dtensor.pack(parts, native)

    def distribute(self, array: Any, layout: Layout, **options: Any) -> Any:
        """A DTensor laid out as ``layout``: the tensor is copied to the mesh replicated, then
        DTensor's ``relayout`` cuts it; each component is the reference block."""
        tf, dtensor = _tf(), _dtensor()
        tensor = tf.convert_to_tensor(np.asarray(array))
        native = self.layout_to_native(layout, rank=len(tensor.shape), **options)
        replicated = dtensor.Layout.replicated(native.mesh, rank=len(tensor.shape))
        return dtensor.relayout(dtensor.copy_to_mesh(tensor, replicated), native)

    def native_code(self, of: Mesh | Layout) -> str:
        """``dtensor.Mesh`` with global ids 0..N-1 over the local devices in unimesh's order.
        A layout: :meth:`_layout_code`."""
        if isinstance(of, Layout):
            return self._layout_code(of)
        mesh = of
        n, flat = mesh.size, mesh.device_ids.ravel().tolist()
        return (
            "import numpy as np\nfrom tensorflow.experimental import dtensor\n\n"
            "# DTensor's global ids are 0..N-1; the device order is the local_devices order\n"
            f'local = [f"/job:localhost/replica:0/task:0/device:CPU:{{i}}" for i in {flat}]\n'
            f"mesh = dtensor.Mesh({list(mesh.axis_names)}, np.arange({n}).reshape("
            f"{mesh.shape}), list(range({n})), local)"
        )

    def _layout_code(self, layout: Layout) -> str:
        """``dtensor.Layout(sharding specs, mesh)``, ``UNSHARDED`` for a replicated dim."""
        specs = ", ".join("dtensor.UNSHARDED" if e is None else repr(e) for e in layout.spec)
        return (
            f"layout = dtensor.Layout([{specs}], mesh)\n"
            "# tensor = dtensor.call_with_layout(tf.zeros, layout, shape=...)"
        )

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """``tf.matmul`` with a replicated DTensor weight, relaid out as replicated."""
        import tensorflow as tf
        from tensorflow.experimental import dtensor

        mesh = dtensor.fetch_layout(array).mesh
        w = dtensor.copy_to_mesh(tf.constant(weight), dtensor.Layout.replicated(mesh, rank=2))
        product = tf.matmul(array, w)
        return dtensor.unpack(dtensor.relayout(product, dtensor.Layout.replicated(mesh, 2)))[0]

    def transport(self) -> Transport:
        """One process, blocks on the host (the default), with DTensor's own ``relayout``."""
        return _Transport(self)

    def local_shards(self, array: Any) -> dict[int, Any]:
        """``{logical device id: numpy block}`` from ``dtensor.unpack``."""
        dtensor = _dtensor()
        mesh = self._mesh_from_native(dtensor.fetch_layout(array).mesh)
        ids = mesh.device_ids.ravel().tolist()
        return {ids[i]: part.numpy() for i, part in enumerate(dtensor.unpack(array))}


class _Transport(Transport):
    """The default transport (one process, host blocks) with DTensor's own move."""

    backend: TensorFlowBackend

    def native(
        self, array: Any, source: Layout | None, target: Layout, shape: tuple[int, ...]
    ) -> tuple[Any, dict[str, int] | None] | None:
        """On the same mesh: ``dtensor.relayout`` (DTensor's own move), with the plan's bytes;
        another mesh: None (the plan, through each device's block: one process, host copies,
        as TF's CPU devices share the host). Inside ``tf.function`` (where DTensor's gradients
        work, and where a tensor's layout cannot be read): ``relayout`` to the target, TF's own
        differentiable move, on the tensor's own mesh: a traced tensor's layout is unknown
        (``source`` None; another mesh then fails in TF at run time, with its own error); a
        DVariable's or a held DTensor's is read, and another mesh is refused by name."""
        tf = _tf()
        if source is None:
            if tf.executing_eagerly():
                return None  # a plain tensor: distribute() lays it out
            native = self.backend.layout_to_native(target, rank=len(shape))
            try:
                return _dtensor().relayout(array, native), None
            except (ValueError, TypeError, tf.errors.OpError) as exc:
                raise UnsupportedError(
                    f"inside tf.function, reshard() is dtensor.relayout, which keeps a tensor on "
                    f"its mesh; {target!r} is refused by TensorFlow ({str(exc).splitlines()[0]}): "
                    "reshard onto another mesh eagerly, outside tf.function",
                    backend=self.name,
                ) from None
        if source.mesh != target.mesh:
            if not tf.executing_eagerly():  # the plan unpacks and packs: eager only
                raise UnsupportedError(
                    f"inside tf.function, reshard() is dtensor.relayout, which keeps a tensor "
                    f"on its mesh; {source!r} -> {target!r} changes mesh: reshard onto another "
                    "mesh eagerly, outside tf.function",
                    backend=self.name,
                )
            return None
        native = self.backend.layout_to_native(target, rank=len(shape))
        return _dtensor().relayout(array, native), None
