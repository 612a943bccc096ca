"""The MLX backend. A device id is the rank of the process (MLX gives each process one device).

``to_native(mesh)`` gives an :class:`MLXMesh`: the world group, this process's ``mx.Device``, its
coordinates, and an :class:`AxisGroup` per mesh axis (or tuple of axes) whose members are exactly
the neutral group holding this rank, in the neutral order. Split groups are released at exit,
before MPI finalizes. mlx is imported inside the functions, never at module import.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import weakref
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
    UnsupportedError,
)
from unimesh._validate import short
from unimesh.parallel import AxisEnv

__all__ = ["AxisGroup", "MLXArray", "MLXAxisEnv", "MLXBackend", "MLXLayout", "MLXMesh",
           "shard_linear"]

_LIVE: weakref.WeakSet[AxisGroup] = weakref.WeakSet()
_LAYERS: list[weakref.ref[Any]] = []  # mlx Modules are dicts: unhashable, but weakly referable
_REGISTERED = False
_STARTED: list[Any] = []  # the world group, once initialize() checked it


_MX: Any = None


def _mx() -> Any:
    global _MX
    if _MX is None:
        import mlx.core as mx

        _MX = mx
    return _MX


def _release_groups() -> None:
    """Drop every split group before the interpreter (and MPI) shuts down: a split group still
    alive at MPI_Finalize makes every rank abort."""
    for group in list(_LIVE):
        group._group = None
    for ref in _LAYERS:
        layer = ref()
        if layer is not None and "group" in vars(layer):
            vars(layer)["group"] = None
    import sys

    distributed = sys.modules.get("mlx.nn.layers.distributed")
    cached: Any = getattr(distributed, "sum_gradients", None)
    if hasattr(cached, "cache_clear"):  # MLX memoises a gradient hook per group: let it go
        cached.cache_clear()
    import gc

    gc.collect()


def _init_world() -> Any:
    """``mx.distributed.init()``, then (once) the exit hook that releases split groups. It is
    registered after MLX's own, and exit hooks run last-registered first, so it runs before
    MPI is finalized."""
    global _REGISTERED
    world = _mx().distributed.init()
    if not _REGISTERED:
        atexit.register(_release_groups)
        _REGISTERED = True
    return world


def launcher_world_size() -> tuple[int, str] | None:
    """How many processes the launcher says it started, and the variable that says so:
    mpirun's ``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE``, ``MLX_WORLD_SIZE``, or the number of
    hosts in mlx.launch's ring ``MLX_HOSTFILE``. None outside a launcher."""
    import json

    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_WORLD_SIZE"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value), f"{var}={value}"
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            with open(path) as fh:
                text = fh.read().strip()
            hosts = json.loads(text) if text else []
        except (OSError, ValueError):
            return None
        if isinstance(hosts, list) and hosts:
            return len(hosts), f"MLX_HOSTFILE lists {len(hosts)} hosts"
    return None


@contextlib.contextmanager
def watchdog(seconds: float, what: str) -> Iterator[None]:
    """MLX collectives cannot be interrupted: if ``what`` does not finish within ``seconds``,
    say so on stderr and end this process (status 1) instead of hanging."""
    import sys
    import threading

    def fire() -> None:
        sys.stderr.write(f"unimesh: {what} did not finish within {seconds:.0f} s: a peer process "
                         "is gone or stuck; MLX collectives cannot be interrupted, so this "
                         "process exits (status 1)\n")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # no thread of ours may still run when MPI is finalized at exit


class AxisGroup:
    """This rank's communication group along some mesh axes: ``members`` in the neutral order.

    With a real split group the collectives go to MLX directly; without one (ring backend, or a
    single process) they run over the world group and keep the members' contributions.
    """

    def __init__(self, axes: tuple[str, ...], members: tuple[int, ...], world: Any,
                 group: Any) -> None:
        self.axes = axes
        self.members = members
        self.world = world
        self._group = group
        _LIVE.add(self)

    @property
    def emulated(self) -> bool:
        return self._group is None

    @property
    def group(self) -> Any:
        """The ``mx.distributed.Group`` (None when emulated)."""
        return self._group

    def rank(self) -> int:
        return self.members.index(self.world.rank())

    def size(self) -> int:
        return len(self.members)

    def _gathered(self, x: Any) -> Any:
        mx = _mx()
        every = mx.distributed.all_gather(mx.expand_dims(x, 0), group=self.world)
        return every[mx.array(list(self.members))]

    def _reduce(self, x: Any, collective: str, local: str) -> Any:
        """``mx.distributed.<collective>`` on the split group, or ``mx.<local>`` over the
        members' contributions gathered from the world group."""
        mx = _mx()
        if self._group is not None:
            return getattr(mx.distributed, collective)(x, group=self._group)
        return getattr(mx, local)(self._gathered(x), axis=0)

    def all_sum(self, x: Any) -> Any:
        return self._reduce(x, "all_sum", "sum")

    def all_max(self, x: Any) -> Any:
        return self._reduce(x, "all_max", "max")

    def all_min(self, x: Any) -> Any:
        return self._reduce(x, "all_min", "min")

    def all_gather(self, x: Any) -> Any:
        """The members' arrays concatenated along axis 0, in the neutral member order."""
        mx = _mx()
        if self._group is not None:
            return mx.distributed.all_gather(x, group=self._group)
        return mx.concatenate(list(self._gathered(x)), axis=0)

    def __repr__(self) -> str:
        how = "emulated over the world group" if self.emulated else "split group"
        return f"AxisGroup(axes={self.axes}, members={self.members}, {how})"


class MLXMesh:
    """The MLX form of a neutral mesh for this process."""

    def __init__(self, mesh: Mesh, world: Any, device: Any) -> None:
        self.mesh = mesh
        self.world = world
        self.device = device
        self.rank = int(world.rank())
        self.coords = mesh.coords(self.rank)
        self._groups: dict[tuple[str, ...], AxisGroup] = {}
        self._can_split: bool | None = None

    def axis_group(self, axes: str | tuple[str, ...]) -> AxisGroup:
        """The group along ``axes`` holding this rank (built on first use, by every rank)."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if names in self._groups:
            return self._groups[names]
        rows = self.mesh.groups_array(names)  # validates the names
        row = int(np.flatnonzero((rows == self.rank).any(axis=1))[0])
        members = tuple(int(d) for d in rows[row])
        group = None
        if self._can_split is not False and self.world.size() > 1:
            try:  # collective: every rank splits, colour = which group, key = place in it
                group = self.world.split(row, members.index(self.rank))
                self._can_split = True
            except RuntimeError:
                self._can_split = False  # MLX's ring backend has no split: emulate
        made = AxisGroup(names, members, self.world, group)
        self._groups[names] = made
        return made

    @property
    def uses_split_groups(self) -> bool | None:
        """True (MPI), False (emulated, e.g. ring), None (no group built yet)."""
        return self._can_split

    def __repr__(self) -> str:
        return f"MLXMesh({self.mesh!r}, rank={self.rank}, coords={self.coords}, {self.device})"


class MLXLayout:
    """The MLX form of a layout: this process's mesh view and the block it holds."""

    def __init__(self, native_mesh: MLXMesh, layout: Layout) -> None:
        self.native_mesh = native_mesh
        self.layout = layout

    def local_slices(self, global_shape: tuple[int, ...]) -> tuple[slice, ...]:
        """The block of a global array that this process holds."""
        return self.layout.shard_slices(global_shape, self.native_mesh.rank)

    def __repr__(self) -> str:
        return f"MLXLayout({self.layout.spec!r} on {self.native_mesh!r})"


class MLXBackend(Backend):
    """MLX: one device per process, groups per mesh axis."""

    name = "mlx"
    framework = "mlx"
    extra = "mlx"
    native_modules = ("mlx", "unimesh_mlx")
    capabilities = frozenset({"mesh", "layout", "distribute", "uneven_shards", "tuple_axes",
                              "axis_groups", "multi_process", "shard_map"})
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "unimesh_mlx.MLXMesh (mx.distributed world group + this mx.Device)",
        "layout": "unimesh_mlx.MLXLayout",
        "distribute": "this process's block (unimesh_mlx.MLXArray)",
        "axis_group": "mx.distributed.Group.split (MPI); emulated on ring",
        "shard_map": "the function on this process's blocks",
        "psum": "mx.distributed.all_sum(x, group=axis group)",
        "all_gather": "mx.distributed.all_gather(x, group=axis group)",
        "axis_index": "the process's mesh coordinate (its axis group rank on MPI)",
        "shard_params": "model.update(blocks)",
        "launch": "mlx.launch -n N --backend ring, or mpirun -np N",
    }

    def _world(self) -> Any:
        if _STARTED:
            return _STARTED[0]
        self.initialize(300.0)
        return _STARTED[0]

    def initialize(self, timeout: float) -> tuple[int, int]:
        """``mx.distributed.init()`` (within ``timeout`` seconds, see :func:`watchdog`), checked
        against the process count the launcher says it started: MLX silently falls back to a
        1-process group when it finds no distributed backend."""
        if not _STARTED:
            rank_hint = next((os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "MLX_RANK")
                              if v in os.environ), "?")
            with watchdog(timeout, f"mx.distributed.init() on rank {rank_hint}"):
                world = _init_world()
            expected = launcher_world_size()
            if expected is not None and expected[0] != int(world.size()):
                raise LaunchError(
                    f"the launcher started {expected[0]} processes ({expected[1]}) but "
                    f"mx.distributed.init() gave a group of {int(world.size())}: MLX found no "
                    "distributed backend for this launcher (mpirun: is openmpi's libmpi "
                    "installed, apt-get install libopenmpi-dev; mlx.launch: is the ring "
                    "hostfile readable?)")
            _STARTED.append(world)
        world = _STARTED[0]
        return int(world.rank()), int(world.size())

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """``mx.distributed.all_gather`` of the lengths, then of the padded bytes, over the
        world group, under :func:`watchdog`."""
        mx = _mx()
        rank, world_size = self.initialize(timeout)
        if world_size == 1:
            return [payload]
        world = _STARTED[0]
        with watchdog(timeout, f"the mesh check on rank {rank} of {world_size}"):
            try:
                sizes = mx.distributed.all_gather(mx.array([len(payload)], dtype=mx.int32),
                                                  group=world)
                longest = int(mx.max(sizes).item())
                mine = np.zeros(longest, dtype=np.int32)
                mine[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
                every = mx.distributed.all_gather(mx.array(mine), group=world)
                mx.eval(every)
            except RuntimeError as exc:
                raise MeshMismatchError(f"rank {rank} of {world_size}: a peer process is gone "
                                        f"({exc})") from exc
        rows = np.array(every).reshape(world_size, longest)
        return [bytes(rows[r, :int(n)].astype(np.uint8)) for r, n in enumerate(np.array(sizes))]

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]]:
        """``mlx.launch -n N --backend ring -- python`` (the ring backend needs no MPI)."""
        import sys
        from pathlib import Path

        launch = Path(sys.executable).with_name("mlx.launch")
        return [str(launch), "-n", str(processes), "--backend", "ring", "--", sys.executable], {}

    def prepare_devices(self, count: int) -> int:
        return self.initialize(300.0)[1]

    def mesh_to_native(self, mesh: Mesh, **options: Any) -> MLXMesh:
        self.reject_options(options)
        world = self._world()
        n = int(world.size())
        if mesh.size < n and int(mesh.device_ids.max()) < n:
            raise UnsupportedError(
                f"{mesh!r} uses {mesh.size} of the {n} MLX processes; an MLX mesh spans the whole "
                "world (every process builds the same groups): launch as many processes as the "
                "mesh has devices", backend=self.name, capability="mesh")
        if mesh.size != n or sorted(mesh.device_ids.ravel().tolist()) != list(range(n)):
            raise MeshMismatchError(
                f"{mesh!r} needs {mesh.size} MLX processes holding devices 0..{mesh.size - 1}, "
                f"but this MLX world has {n}; start them with: mpirun --allow-run-as-root -np "
                f"{mesh.size} python script.py (MPI) or mlx.launch -n {mesh.size} --backend ring "
                "-- python script.py")
        return MLXMesh(mesh, world, _mx().default_device())

    def layout_to_native(self, layout: Layout, **options: Any) -> MLXLayout:
        """An :class:`MLXLayout`: which block of each global array this process holds."""
        return MLXLayout(self.mesh_to_native(layout.mesh, **options), layout)

    def from_native(self, obj: Any) -> Any:
        mx = _mx()
        if isinstance(obj, MLXMesh):
            return obj.mesh
        if isinstance(obj, MLXLayout):
            return obj.layout
        if isinstance(obj, mx.Device):
            return Mesh((1,), ("device",))
        raise ConversionError(f"the mlx backend converts MLXMesh and mx.Device, not {short(obj)} "
                              f"({type(obj).__module__}.{type(obj).__qualname__})")

    def distribute(self, array: Any, layout: Layout, **options: Any) -> MLXArray:
        """An :class:`MLXArray` holding this process's block,
        ``array[layout.shard_slices(shape, rank)]`` (its ``local`` mx.array)."""
        native = self.mesh_to_native(layout.mesh, **options)
        host = np.asarray(array)
        block = _mx().array(host[layout.shard_slices(host.shape, native.rank)])
        return MLXArray(block, layout, tuple(host.shape))

    def local_shards(self, array: Any) -> dict[int, Any]:
        local = array.local if isinstance(array, MLXArray) else array
        return {int(self._world().rank()): np.array(local)}

    def axis_groups(self, native_mesh: Any, axis: str) -> dict[int, tuple[int, ...]]:
        return {native_mesh.rank: native_mesh.axis_group(axis).members}


    # -- programs --------------------------------------------------------------------------------
    def _program_mesh(self, mesh: Mesh) -> MLXMesh:
        """One MLXMesh per neutral mesh for shard_map programs, so that its axis groups are split
        once (every rank builds them in the same order: on first use inside the program)."""
        cache: dict[Mesh, MLXMesh] = self.__dict__.setdefault("_programs", {})
        if mesh not in cache:
            cache[mesh] = self.mesh_to_native(mesh)
        return cache[mesh]

    def _block(self, array: Any, layout: Layout, rank: int) -> Any:
        mx = _mx()
        if isinstance(array, MLXArray):
            if array.layout is layout or array.layout == layout:
                return array.local
            array = self.full_array(array)
        host = np.asarray(array)
        if host.ndim < len(layout.spec):
            raise ConversionError(f"a shard_map argument of shape {host.shape} has fewer dims "
                                  f"than its in_spec {layout.spec!r}")
        return mx.array(host[layout.shard_slices(host.shape, rank)])

    def shard_map(self, body: Any, mesh: Mesh, in_layouts: tuple[Layout, ...],
                  out_layouts: tuple[Layout, ...], single_out: bool) -> Any:
        """Runs ``body`` on this process's blocks (arguments: global arrays, the same on every
        process, or :class:`MLXArray`), with the axis groups; returns :class:`MLXArray`."""

        envs: list[MLXAxisEnv] = []
        shapes: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}  # (output, block) -> global

        def run(*args: Any) -> Any:
            mx = _mx()
            if not envs:
                native = self._program_mesh(mesh)
                envs.append(MLXAxisEnv(mesh, native.rank, native))
            env = envs[0]
            blocks = [self._block(a, lay, env.native.rank) for a, lay in zip(args, in_layouts)]
            result = body(env, *blocks)
            results = (result,) if single_out else result
            outs = []
            for i, (block, layout) in enumerate(zip(results, out_layouts)):
                block = block if isinstance(block, mx.array) else mx.array(block)
                key = (i, tuple(block.shape))
                shape = shapes.get(key)
                if shape is None:
                    shape = shapes[key] = layout.global_shape(key[1])
                outs.append(MLXArray(block, layout, shape))
            return outs[0] if single_out else tuple(outs)

        return run

    def full_array(self, array: Any) -> Any:
        """numpy of an :class:`MLXArray`'s whole value, from every process's block (one world
        all_gather of blocks padded to the largest), or of an ``mx.array``."""
        if not isinstance(array, MLXArray):
            return np.array(array)
        mx = _mx()
        layout, shape = array.layout, array.shape
        if layout.spec.partial:
            raise UnsupportedError(f"full_array of a partial layout {layout.spec!r}: reduce it "
                                   "first (psum inside shard_map)", backend=self.name,
                                   capability="partial")
        world = self._world()
        slices = [layout.shard_slices(shape, r) for r in range(int(world.size()))]
        widths = [[s.stop - s.start for s in sl] for sl in slices]
        biggest = tuple(max(w[d] for w in widths) for d in range(len(shape)))
        local = np.zeros(biggest, dtype=np.array(array.local).dtype)
        local[tuple(slice(0, n) for n in array.local.shape)] = np.array(array.local)
        every = np.array(mx.distributed.all_gather(mx.expand_dims(mx.array(local), 0),
                                                   group=world))
        out = np.zeros(shape, dtype=local.dtype)
        for r, sl in enumerate(slices):
            out[sl] = every[r][tuple(slice(0, n) for n in widths[r])]
        return out

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """Every parameter of an MLX ``nn.Module`` becomes this process's block (paths as
        ``mlx.utils.tree_flatten`` names them, e.g. ``layers.0.weight``). In place."""
        import mlx.nn
        from mlx.utils import tree_flatten, tree_unflatten

        if not isinstance(model, mlx.nn.Module):  # type: ignore[attr-defined]
            raise ConversionError(f"the mlx backend shards the parameters of an mlx.nn.Module, "
                                  f"not {short(model)}")
        placed = []
        flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        for path, value in flat:
            host = np.array(value)
            placed.append((path, self.distribute(host, resolve(path, host.shape)).local))
        model.update(tree_unflatten(placed))
        return model


class MLXArray:
    """What a shard_map returns on MLX, which has no global array type: this process's block
    (``local``, an ``mx.array``), the layout it follows, and the global ``shape``.
    :func:`unimesh.full_array` gathers the whole value."""

    def __init__(self, local: Any, layout: Layout, shape: tuple[int, ...]) -> None:
        self.local = local
        self.layout = layout
        self.shape = shape

    def __repr__(self) -> str:
        return (f"MLXArray(shape={self.shape}, block={tuple(self.local.shape)}, "
                f"spec={self.layout.spec!r})")


class MLXAxisEnv(AxisEnv):
    """Axis collectives on this process's :class:`AxisGroup` for the axes."""

    def __init__(self, mesh: Mesh, device: int, native: MLXMesh) -> None:
        super().__init__(mesh, device)
        self.native = native
        self._ops: dict[tuple[tuple[str, ...], str], Any] = {}

    def reduce(self, x: Any, axes: tuple[str, ...], op: str) -> Any:
        mx = _mx()
        x = x if isinstance(x, mx.array) else mx.array(x)
        try:
            collective = self._ops[axes, op]
        except KeyError:  # once per (axes, op): the group's collective, bound
            group = self.native.axis_group(axes)
            if group.group is not None:
                collective = functools.partial(getattr(mx.distributed, "all_" + op),
                                               group=group.group)
            else:
                collective = getattr(group, "all_" + op)
            self._ops[axes, op] = collective
        return collective(x)

    def all_gather(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        mx = _mx()
        stacked = self.native.axis_group(axes).all_gather(mx.expand_dims(x, 0))
        moved = mx.moveaxis(stacked, 0, dim)
        if not tiled:
            return moved
        shape = list(moved.shape)
        return moved.reshape(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2:])


def shard_linear(linear: Any, layout: Layout, native_mesh: MLXMesh) -> Any:
    """MLX's own tensor-parallel layer for a Linear whose weight (MLX's ``(out, in)``) is laid
    out as ``layout``: ``P(axis, None)`` shards the outputs (``"all-to-sharded"``),
    ``P(None, axis)`` the inputs (``"sharded-to-all"``), over ``axis``'s group."""
    from mlx.nn.layers.distributed import shard_linear as mlx_shard_linear

    spec = tuple(layout.spec) + (None,) * (2 - len(layout.spec))
    if len(spec) != 2 or (spec[0] is None) == (spec[1] is None) or any(
            isinstance(e, tuple) for e in spec):
        raise LayoutError(f"shard_linear takes P(axis, None) or P(None, axis) for a Linear "
                          f"weight, got {layout.spec!r}")
    axis = spec[0] if spec[0] is not None else spec[1]
    assert isinstance(axis, str)
    group = native_mesh.axis_group(axis)
    if group.emulated and group.size() != native_mesh.world.size():
        raise UnsupportedError(
            f"MLX's sharded Linear layers need a real group for axis {axis!r}, and this MLX "
            "distributed backend cannot split one (ring); use the MPI backend",
            backend="mlx", capability="axis_groups")
    sharding = "all-to-sharded" if spec[0] is not None else "sharded-to-all"
    layer = mlx_shard_linear(linear, sharding,
                             group=group.group if group.group is not None else native_mesh.world)
    _LAYERS.append(weakref.ref(layer))  # it holds the split group: released at exit too
    return layer
