"""The Keras backend: neutral Mesh/Layout/LayoutMap <-> ``keras.distribution`` objects.

A neutral device id is a position in ``keras.distribution.list_devices()``. Keras's
``TensorLayout`` has no tuple-of-axes entries; such layouts are refused (``Mesh.flatten`` first).
keras is imported inside the functions, never at module import.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import numpy as np

from unimesh import (
    Backend,
    Config,
    ConversionError,
    Layout,
    LayoutError,
    LayoutMap,
    Mesh,
    MeshMismatchError,
    P,
    UnsupportedError,
)
from unimesh.backend import Reused
from unimesh.launchers import LauncherSign
from unimesh.messages import short
from unimesh.runtime import KERAS_VARS

__all__ = ["KerasBackend", "distribution"]


def _kd() -> Any:
    from keras import distribution as kd

    return kd


def _keras_backend() -> str:
    import keras

    return str(keras.backend.backend())


class KerasBackend(Backend):
    """Keras 3 ``keras.distribution`` (which runs on Keras's JAX backend)."""

    name = "keras"
    #: the variables keras.distribution.initialize reads (unimesh.initialize reads them too)
    launcher_signs = (
        LauncherSign(
            "keras.distribution",
            any_set=(KERAS_VARS[0],),
            rank_var=KERAS_VARS[2],
            size_var=KERAS_VARS[1],
            evidence=KERAS_VARS,
        ),
    )
    #: it simulates devices through JAX (XLA_FLAGS), with JAX's limit
    max_simulated_devices = 4096
    max_mesh_axes = 32  # Keras builds a jax.sharding.Mesh (32 dims at most)
    native_layouts_immutable = True
    requires = ("jax",)
    framework = "keras"
    extra = "keras"
    native_modules = ("keras",)
    wraps = ("jax", "tensorflow", "torch")
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "keras.distribution.DeviceMesh",
        "layout": "keras.distribution.TensorLayout",
        "layout_map": "keras.distribution.LayoutMap (ModelParallel)",
        "distribute": "keras.distribution.distribute_tensor",
        "shard_map": "the JAX backend's (KERAS_BACKEND=jax)",
        "psum": "jax.lax.psum (through the JAX backend)",
        "all_gather": "jax.lax.all_gather (through the JAX backend)",
        "axis_index": "jax.lax.axis_index (through the JAX backend)",
        "shard_params": "variable.assign(distributed value) per variable.path",
    }

    def _require_distribution(self, what: str) -> None:
        kb = _keras_backend()
        if kb != "jax":
            raise UnsupportedError(
                f"{what} needs keras.distribution support in the Keras backend, and Keras's "
                f"{kb!r} backend has none (Keras {_version()} supports it on 'jax'); set "
                "KERAS_BACKEND=jax",
                backend=self.name,
                capability="distribute",
            )

    def prepare_devices(self, count: int) -> int:
        """Keras on JAX with ``count`` virtual CPU devices (if neither is loaded yet)."""
        import os

        import unimesh

        os.environ.setdefault("KERAS_BACKEND", "jax")
        if os.environ["KERAS_BACKEND"] == "jax":  # the devices are JAX's
            unimesh.get_backend("jax").prepare_devices(count)
        if _keras_backend() != "jax":
            return 1
        return len(_kd().list_devices())

    # -- meshes --------------------------------------------------------------------------------
    def mesh_to_native(self, mesh: Mesh, **options: Any) -> Any:
        """``keras.distribution.DeviceMesh`` with ``list_devices()[id]`` at each position. A
        small mesh converted again gets the same DeviceMesh (it has no setters, and keeps the
        backend mesh it derives)."""
        self.reject_options(options)
        if mesh.size <= _CACHED_MESH_SIZE:
            return _cached_mesh(self, mesh, _keras_backend())
        return self._build_mesh(mesh)

    def _build_mesh(self, mesh: Mesh) -> Any:
        kd = _kd()
        top = int(mesh.device_ids.max())
        devices = _device_array(_keras_backend(), top + 1)
        if top >= len(devices):
            raise MeshMismatchError(
                f"{mesh!r} uses device {top}, but keras.distribution.list_devices() has "
                f"{len(devices)}; for CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{top + 1} before importing keras"
            )
        arr = devices[mesh.device_ids]
        return kd.DeviceMesh(mesh.shape, list(mesh.axis_names), devices=arr)

    def _mesh_from_native(self, device_mesh: Any) -> Mesh:
        devices = np.asarray(device_mesh.devices, dtype=object).reshape(device_mesh.shape)
        names = [str(d) for d in devices.ravel()]
        needed = 1 + max(
            (int(n.rsplit(":", 1)[-1]) for n in names if n.rsplit(":", 1)[-1].isdigit()), default=0
        )
        position = {d: i for i, d in enumerate(_devices(max(needed, devices.size)))}
        try:
            ids = np.vectorize(lambda d: position[str(d)], otypes=[np.int64])(devices)
        except KeyError as exc:
            raise MeshMismatchError(
                f"{device_mesh} holds device {exc}, which "
                "keras.distribution.list_devices() does not list"
            ) from exc
        return Mesh(tuple(device_mesh.shape), tuple(device_mesh.axis_names), ids)

    # -- layouts -------------------------------------------------------------------------------
    def layout_to_native(self, layout: Layout, *, device_mesh: Any = None, **options: Any) -> Any:
        """``keras.distribution.TensorLayout(spec entries, device_mesh)``."""
        mesh_native = (
            device_mesh if device_mesh is not None else self.mesh_to_native(layout.mesh, **options)
        )
        return _kd().TensorLayout(tuple(layout.spec), mesh_native)

    def layout_map_to_native(self, layout_map: LayoutMap, **options: Any) -> Any:
        """``keras.distribution.LayoutMap`` with the same keys (Keras matches them the same way)."""
        kd = _kd()
        device_mesh = self.mesh_to_native(layout_map.mesh, **options)
        out = kd.LayoutMap(device_mesh)
        for key, layout in layout_map.items():
            out[key] = self.layout_to_native(layout, device_mesh=device_mesh)
        return out

    def from_native(self, obj: Any) -> Any:
        kd = _kd()
        if isinstance(obj, kd.DeviceMesh):
            return self._mesh_from_native(obj)
        if isinstance(obj, kd.TensorLayout):
            if obj.device_mesh is None:
                raise LayoutError(f"{obj} has no device_mesh; a unimesh Layout needs its mesh")
            return Layout(self._mesh_from_native(obj.device_mesh), P(*obj.axes))
        if isinstance(obj, kd.LayoutMap):
            mesh = self._mesh_from_native(obj.device_mesh)
            return LayoutMap(mesh, [(k, P(*v.axes)) for k, v in obj.items()])
        raise ConversionError(
            f"the keras backend converts DeviceMesh, TensorLayout and LayoutMap, not "
            f"{short(obj)} ({type(obj).__module__}.{type(obj).__qualname__})"
        )

    def distribute(self, array: Any, layout: Layout, **options: Any) -> Any:
        """``keras.distribution.distribute_tensor(array, TensorLayout)``."""
        self._require_distribution("distribute()")
        return _kd().distribute_tensor(array, self.layout_to_native(layout, **options))

    def native_code(self, of: Mesh | Layout) -> str:
        """``keras.distribution.DeviceMesh`` over ``list_devices()``, reordered to unimesh's
        order only where the ids are not in the default order. A layout: :meth:`_layout_code`."""
        if isinstance(of, Layout):
            return self._layout_code(of)
        mesh = of
        head = "import keras\n"
        if mesh.is_default_order:
            return (
                head + "\n"
                f"mesh = keras.distribution.DeviceMesh({mesh.shape}, {list(mesh.axis_names)}, "
                "devices=keras.distribution.list_devices())"
            )
        return (
            head + "import numpy as np\n\n"
            "devices = keras.distribution.list_devices()\n"
            f"mesh = keras.distribution.DeviceMesh({mesh.shape}, {list(mesh.axis_names)}, "
            f"devices=np.array(devices, dtype=object)[np.array({mesh.device_ids.tolist()})])"
        )

    def _layout_code(self, layout: Layout) -> str:
        """``keras.distribution.TensorLayout(axes, mesh)``."""
        return (
            f"layout = keras.distribution.TensorLayout({list(layout.spec)!r}, mesh)\n"
            "# e.g. layout_map['dense.*kernel'] = layout, or distribute_tensor(x, layout)"
        )

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """``keras.ops.matmul`` on the distributed array."""
        import keras

        return keras.ops.matmul(array, weight)

    #: JAX's (Keras's arrays are JAX's, its device order JAX's)
    from_local = Reused("_jax")

    def local_shards(self, array: Any) -> dict[int, Any]:
        """``{logical device id: numpy block}`` of a distributed Keras (JAX) array or of a
        Keras variable's value."""
        self._require_distribution("local_shards()")
        if hasattr(array, "value") and not hasattr(array, "addressable_shards"):
            array = array.value  # a Keras variable
        position = {d: i for i, d in enumerate(_devices(0))}
        return {
            position[f"{s.device.platform}:{s.device.id}"]: np.asarray(s.data)
            for s in array.addressable_shards
        }

    # -- live reshard: Keras's arrays are JAX's, so JAX's transport moves them ---------------
    @staticmethod
    def _value(array: Any) -> Any:
        """A Keras variable's ``jax.Array`` (an array as it is)."""
        if hasattr(array, "value") and not hasattr(array, "addressable_shards"):
            return array.value
        return array

    def native_blocks(self, array: Any) -> dict[int, Any]:
        """JAX's: each shard's ``jax.Array`` on its device (no host copy)."""
        return self._jax("reshard()").native_blocks(self._value(array))

    #: JAX's (``jax.numpy``), and JAX's transport (its ``native`` moves a Keras variable as
    #: the ``jax.Array`` it holds)
    arrays = Reused("_jax")
    transport = Reused("_jax")

    def stop_gradient(self, x: Any) -> Any:
        import keras

        return keras.ops.stop_gradient(x)

    #: ``jax.jit`` (Keras on JAX, where its programs run)
    compile = Reused("_jax")

    # -- models: unimesh.save(path, model) / unimesh.load(path, model) ------------------------
    def model_state(self, model: Any) -> dict[str, Any] | None:
        """A Keras model's (or layer's) variables by their paths (``dense/kernel``): each a
        distributed array under a ``keras.distribution``, numpy where it has no layout."""
        import keras

        if not isinstance(model, keras.layers.Layer):
            return None
        from unimesh.convert import layout_of

        out: dict[str, Any] = {}
        for variable in model.variables:
            distributed = keras.backend.backend() == "jax" and layout_of(variable) is not None
            value = variable if distributed else keras.ops.convert_to_numpy(variable)
            out[_variable_name(model, variable)] = value
        return out

    def model_assign(self, model: Any, values: dict[str, Any]) -> None:
        """``variable.assign`` of each loaded value, which already has the variable's layout
        (Keras keeps it: no gather)."""
        for variable in model.variables:
            name = _variable_name(model, variable)
            if name in values:
                variable.assign(values[name])

    # -- programs: Keras distributes through JAX ----------------------------------------------
    def _jax(self, what: str) -> Backend:
        self._require_distribution(what)
        import unimesh

        return unimesh.get_backend("jax")

    def _runtime(self) -> Backend | None:
        """The backend of the framework Keras runs on, for the distributed runtime."""
        import keras

        import unimesh

        name = keras.backend.backend()
        return unimesh.get_backend(name) if name in ("jax", "torch") else None

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:
        """The runtime of the framework Keras runs on (JAX: ``jax.distributed``), with the
        launch parameters ``keras.distribution.initialize`` takes."""
        runtime = self._runtime()
        if runtime is None:
            return super().initialize(timeout, launch)
        if launch is None:
            return runtime.initialize(timeout)
        return runtime.initialize(timeout, launch=launch)

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        runtime = self._runtime()
        return [payload] if runtime is None else runtime.exchange(payload, timeout)

    #: ``jax.shard_map`` and ``jax.value_and_grad`` (Keras on JAX; the device order of
    #: ``list_devices()`` is JAX's)
    shard_map = Reused("_jax")
    value_and_grad = Reused("_jax")

    def full_array(self, array: Any) -> Any:
        if hasattr(array, "value") and not hasattr(array, "sharding"):
            array = array.value  # a Keras variable
        return self._jax("full_array").full_array(array)

    def param_paths(self, model: Any) -> list[tuple[str, tuple[int, ...]]]:
        """Each variable's ``path`` and shape."""
        _keras_model(model)
        return [(v.path, tuple(v.shape)) for v in model.variables]

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """Each variable of a built Keras model is re-placed with its layout
        (``variable.assign`` of the distributed value keeps the sharding); paths are Keras's
        ``variable.path`` (``sequential/dense/kernel``). For a model not built yet, build it
        under ``unimesh_keras.distribution(mesh, layout_map).scope()`` instead."""
        _keras_model(model)
        self._jax("shard_params")
        for variable in model.variables:
            host = np.asarray(variable.value)
            layout = resolve(variable.path, host.shape)
            # the variable keeps its layout as one made under a distribution scope does:
            # Keras re-distributes every later assign() by variable._layout
            variable._layout = self.layout_to_native(layout)
            variable.assign(host)
        return model


def _keras_model(model: Any) -> None:
    import keras

    if not isinstance(model, (keras.Model, keras.layers.Layer)):
        raise ConversionError(
            f"the keras backend shards the variables of a keras Model or Layer, not {short(model)}"
        )


#: Meshes up to this size keep their DeviceMesh for the next conversion.
_CACHED_MESH_SIZE = 4096


@functools.lru_cache(maxsize=32)
def _cached_mesh(backend: KerasBackend, mesh: Mesh, keras_backend: str) -> Any:
    return backend._build_mesh(mesh)


@functools.lru_cache(maxsize=8)
def _device_array(keras_backend: str, needed: int) -> np.ndarray:
    """:func:`_devices` as an object array, listed once (the list is fixed once the runtime
    has started)."""
    names = _devices(needed)
    return np.fromiter(names, dtype=object, count=len(names))


def _devices(needed: int) -> list[str]:
    """``keras.distribution.list_devices()``; under a Keras backend without distribution
    support (where that call fails), logical CPU names, so that the objects still build."""
    if _keras_backend() == "jax":
        return [str(d) for d in _kd().list_devices()]
    return [f"cpu:{i}" for i in range(needed)]


def _version() -> str:
    import keras

    return str(keras.__version__)


def distribution(
    mesh: Mesh | Config,
    layout_map: LayoutMap | None = None,
    *,
    batch_dim_name: str | None = None,
    auto_shard_dataset: bool = True,
) -> Any:
    """The Keras distribution for a neutral mesh: ``DataParallel`` over a 1-axis mesh with no
    layout map, else ``ModelParallel(layout_map=..., batch_dim_name=...)`` (batch axis: the
    given name, else the mesh's first axis). A :class:`unimesh.Config` (from
    ``unimesh.load_config("dist.toml")``) gives the mesh, the layout rules and the batch axis.
    ``auto_shard_dataset`` goes to Keras as it is (False: the dataset is already sharded
    across processes). A mesh Keras refuses for this job (its size against the devices, its
    batch axis against the process count) is a :class:`~unimesh.MeshMismatchError`."""
    be = KerasBackend()
    if isinstance(mesh, Config):
        if layout_map is not None or batch_dim_name is not None:
            raise ConversionError(
                "distribution(config) takes the layout map and batch axis "
                "from the config; pass no layout_map/batch_dim_name with it"
            )
        config = mesh
        mesh, batch_dim_name = config.mesh, config.batch_axis
        layout_map = config.layout_map if len(config.layout_map) else None
    if not isinstance(mesh, Mesh):
        raise ConversionError(
            f"distribution() needs a unimesh.Mesh or unimesh.Config, got {short(mesh)}"
        )
    if layout_map is not None and layout_map.mesh != mesh:
        raise LayoutError(f"the layout map is on {layout_map.mesh!r}, not on {mesh!r}")
    if batch_dim_name is not None and batch_dim_name not in mesh.axis_names:
        raise LayoutError(f"batch_dim_name {batch_dim_name!r} is not an axis of {mesh!r}")
    if not isinstance(auto_shard_dataset, bool):
        raise ConversionError(
            f"auto_shard_dataset must be True or False, got {short(auto_shard_dataset)}"
        )
    be._require_distribution("a Keras distribution")
    kd = _kd()
    batch = batch_dim_name or mesh.axis_names[0]
    _check_processes(mesh, batch)
    try:
        if layout_map is None and mesh.ndim == 1:
            return kd.DataParallel(
                device_mesh=be.mesh_to_native(mesh), auto_shard_dataset=auto_shard_dataset
            )
        if layout_map is None:
            layout_map = LayoutMap(mesh)
        import unimesh

        native_map = unimesh.to_native(layout_map, be)
        return kd.ModelParallel(
            layout_map=native_map, batch_dim_name=batch, auto_shard_dataset=auto_shard_dataset
        )
    except ValueError as exc:  # what Keras checks beyond the above, in its words
        raise MeshMismatchError(
            f"Keras refuses a distribution over {mesh!r} (batch axis {batch!r}): "
            f"{str(exc).splitlines()[0]}"
        ) from exc


def _check_processes(mesh: Mesh, batch: str) -> None:
    """Keras's rule for a multi-process job, said before Keras says it: the mesh covers the
    devices of every process, and with more processes than batch replicas the process count
    is a multiple of the replicas."""
    import jax

    procs, devices = int(jax.process_count()), int(jax.device_count())
    if procs == 1:
        return
    if mesh.size != devices:
        raise MeshMismatchError(
            f"{mesh!r} has {mesh.size} devices, but this job of {procs} processes has {devices}: "
            "a Keras distribution spans every device; make the mesh's sizes multiply to "
            f"{devices}"
        )
    replicas = mesh.axis_size(batch)
    if procs > replicas and procs % replicas:
        raise MeshMismatchError(
            f"{mesh!r}: {procs} processes do not divide into its {replicas} batch replicas "
            f"(axis {batch!r}); Keras needs the process count to be a multiple of the batch "
            "axis's size when it is the larger"
        )


def _variable_name(model: Any, variable: Any) -> str:
    """A variable's path below its model (``up/kernel``, not ``sequential_3/up/kernel``: the
    model's own name is numbered by how many models the process built before)."""
    path = str(variable.path)
    prefix = f"{model.name}/"
    return path.removeprefix(prefix)
