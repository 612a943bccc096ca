"""The MLX backend. A device id is the rank of the process (MLX gives each process one device).

``to_native(mesh)`` gives an :class:`MLXMesh`: the world group, this process's ``mx.Device``, its
coordinates, and an :class:`AxisGroup` per mesh axis (or tuple of axes) whose members are exactly
the neutral group holding this rank, in the neutral order. Split groups are released at exit,
before MPI finalizes. mlx is imported inside the functions, never at module import.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from unimesh import (
    ConversionError,
    LaunchError,
    Layout,
    LayoutError,
    Mesh,
    MeshMismatchError,
    PartitionSpec,
    UnsupportedError,
)
from unimesh._validate import short
from unimesh.spmd import ProcessBackend

__all__ = ["AxisGroup", "MLXArray", "MLXBackend", "MLXLayout", "MLXMesh", "shard_linear"]

_LIVE: weakref.WeakSet[AxisGroup] = weakref.WeakSet()
_LAYERS: list[weakref.ref[Any]] = []  # mlx Modules are dicts: unhashable, but weakly referable
_REGISTERED = False
_ENGINES: weakref.WeakSet[MLXBackend] = weakref.WeakSet()  # their programs' pending results
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
    for engine in list(_ENGINES):
        engine.forget_pending()
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
        sys.stderr.write(
            f"unimesh: {what} did not finish within {seconds:.0f} s: a peer process "
            "is gone or stuck; MLX collectives cannot be interrupted, so this "
            "process exits (status 1)\n"
        )
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

    def __init__(
        self, axes: tuple[str, ...], members: tuple[int, ...], world: Any, group: Any
    ) -> None:
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


class MLXBackend(ProcessBackend):
    """MLX: one device per process, groups per mesh axis."""

    name = "mlx"
    launcher_name = "mlx.launch, ring"
    lazy = True  # collectives run when evaluated: the engine chains them in program order
    framework = "mlx"
    extra = "mlx"
    native_modules = ("mlx", "unimesh_mlx")
    capabilities = frozenset(
        {
            "mesh",
            "layout",
            "distribute",
            "uneven_shards",
            "tuple_axes",
            "axis_groups",
            "multi_process",
            "shard_map",
            "grad",
        }
    )
    # mx.distributed.sum_scatter raises "not yet implemented" on MPI: the engine builds it
    native_primitives = frozenset({"all_reduce", "all_gather", "split"})
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
        _ENGINES.add(self)
        if _STARTED:
            return _STARTED[0]
        self.initialize(300.0)
        return _STARTED[0]

    def initialize(self, timeout: float) -> tuple[int, int]:
        """``mx.distributed.init()`` (within ``timeout`` seconds, see :func:`watchdog`), checked
        against the process count the launcher says it started: MLX silently falls back to a
        1-process group when it finds no distributed backend."""
        if not _STARTED:
            rank_hint = next(
                (os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "MLX_RANK") if v in os.environ),
                "?",
            )
            with watchdog(timeout, f"mx.distributed.init() on rank {rank_hint}"):
                world = _init_world()
            expected = launcher_world_size()
            if expected is not None and expected[0] != int(world.size()):
                raise LaunchError(
                    f"the launcher started {expected[0]} processes ({expected[1]}) but "
                    f"mx.distributed.init() gave a group of {int(world.size())}: MLX found no "
                    "distributed backend for this launcher (mpirun: is openmpi's libmpi "
                    "installed, apt-get install libopenmpi-dev; mlx.launch: is the ring "
                    "hostfile readable?)"
                )
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
                sizes = mx.distributed.all_gather(
                    mx.array([len(payload)], dtype=mx.int32), group=world
                )
                longest = int(mx.max(sizes).item())
                mine = np.zeros(longest, dtype=np.int32)
                mine[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
                every = mx.distributed.all_gather(mx.array(mine), group=world)
                mx.eval(every)
            except RuntimeError as exc:
                raise MeshMismatchError(
                    f"rank {rank} of {world_size}: a peer process is gone ({exc})"
                ) from exc
        rows = np.array(every).reshape(world_size, longest)
        return [bytes(rows[r, : int(n)].astype(np.uint8)) for r, n in enumerate(np.array(sizes))]

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]]:
        """``mlx.launch -n N --backend ring -- python`` (the ring backend needs no MPI)."""
        import sys
        from pathlib import Path

        launch = Path(sys.executable).with_name("mlx.launch")
        return [str(launch), "-n", str(processes), "--backend", "ring", "--", sys.executable], {}

    def prepare_devices(self, count: int) -> int:
        return self.initialize(300.0)[1]

    def native_code(self, mesh: Mesh) -> str:
        """``mx.distributed.init()`` and a ``world.split`` per mesh axis."""
        lines = [
            "import mlx.core as mx\n",
            "world = mx.distributed.init()  # one process per device",
            "rank = world.rank()",
        ]
        for axis in mesh.axis_names:
            rows = mesh.groups(axis)
            lines += [
                f"# {axis!r} groups: {rows}",
                f"rows = {rows}",
                "row = next(i for i, g in enumerate(rows) if rank in g)",
                f"{axis}_group = world.split(row, rows[row].index(rank))  # MPI backend",
            ]
        return "\n".join(lines)

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """This process's block times its rows of the weight, summed over the group of the
        axes that split the columns (``all_sum``), assembled whole."""
        mx = _mx()
        layout, shape = array.layout, array.shape
        cols = layout.shard_slices(shape, int(self._world().rank()))[1]
        partial = array.local @ mx.array(np.asarray(weight)[cols])
        if layout.spec[1] is not None:
            native = self.mesh_to_native(layout.mesh)
            entry = layout.spec[1]
            partial = native.axis_group(entry if isinstance(entry, str) else tuple(entry)).all_sum(
                partial
            )
        out = Layout(layout.mesh, PartitionSpec(layout.spec[0], None))
        return self.full_array(MLXArray(partial, out, (shape[0], int(weight.shape[1]))))

    def mesh_to_native(self, mesh: Mesh, **options: Any) -> MLXMesh:
        self.reject_options(options)
        world = self._world()
        n = int(world.size())
        if mesh.size < n and int(mesh.device_ids.max()) < n:
            raise UnsupportedError(
                f"{mesh!r} uses {mesh.size} of the {n} MLX processes; an MLX mesh spans the whole "
                "world (every process builds the same groups): launch as many processes as the "
                "mesh has devices",
                backend=self.name,
                capability="mesh",
            )
        if mesh.size != n or sorted(mesh.device_ids.ravel().tolist()) != list(range(n)):
            raise MeshMismatchError(
                f"{mesh!r} needs {mesh.size} MLX processes holding devices 0..{mesh.size - 1}, "
                f"but this MLX world has {n}; start them with: mpirun --allow-run-as-root -np "
                f"{mesh.size} python script.py (MPI) or mlx.launch -n {mesh.size} --backend ring "
                "-- python script.py"
            )
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
        raise ConversionError(
            f"the mlx backend converts MLXMesh and mx.Device, not {short(obj)} "
            f"({type(obj).__module__}.{type(obj).__qualname__})"
        )

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

    # -- programs: the core's per-process engine on MLX groups -------------------------------------
    def process_index(self) -> int:
        return int(self._world().rank())

    def world_group(self) -> Any:
        return self._world()

    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        """``Group.split`` (MPI): colour = the row, key = the place in it; None where the
        distributed backend cannot split (ring), and the engine emulates the group."""
        world = self._world()
        members = tuple(int(m) for m in rows[row])
        try:
            group = world.split(row, members.index(int(world.rank())))
        except RuntimeError:
            return None
        return AxisGroup((), members, world, group)

    def group_all_reduce(self, x: Any, group: Any, op: str) -> Any:
        return getattr(_mx().distributed, "all_" + op)(x, group=_native_group(group))

    def group_all_gather(self, x: Any, group: Any) -> Any:
        mx = _mx()
        return mx.distributed.all_gather(mx.expand_dims(x, 0), group=_native_group(group))

    def as_array(self, value: Any) -> Any:
        mx = _mx()
        return value if isinstance(value, mx.array) else mx.array(value)

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        return _mx().moveaxis(x, source, destination)

    def take(self, x: Any, index: list[int]) -> Any:
        mx = _mx()
        return x[mx.array(index)] if len(index) > 1 else x[index[0] : index[0] + 1]

    def reduce_stack(self, x: Any, op: str) -> Any:
        return getattr(_mx(), op)(x, axis=0)

    def zeros_like(self, x: Any) -> Any:
        return _mx().zeros_like(x)

    def to_host(self, x: Any) -> np.ndarray:
        return np.array(x)

    def after(self, x: Any, done: Any) -> Any:
        return _mx().depends(x, done)

    def custom_vjp(self, fwd: Any, bwd: Any) -> Any:
        function = _mx().custom_function(fwd)

        def transpose(primals: Any, cotangent: Any, output: Any) -> Any:
            return bwd(cotangent)

        function.vjp(transpose)
        return function

    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]:
        """An :class:`MLXArray`'s local block (gathered and cut again when laid out
        otherwise), or a global array (numpy and lists become ``mx.array``)."""
        mx = _mx()
        if isinstance(arg, MLXArray):
            if arg.layout is layout or arg.layout == layout:
                return arg.local, False
            arg = self.full_array(arg)
        return (arg if isinstance(arg, mx.array) else mx.array(np.asarray(arg))), True

    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any:
        return MLXArray(block, layout, shape)

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Any:
        """``mx.value_and_grad`` over the local blocks of :class:`MLXArray` arguments (and the
        global ``mx.array`` ones); gradients come back as :class:`MLXArray` with the
        argument's layout, or global arrays."""
        import optree

        mx = _mx()

        def run(*given: Any) -> Any:
            args = list(given)
            layouts = {}
            locals_ = []
            for i in argnums:
                flat, treedef = optree.tree_flatten(args[i])
                layouts[i] = (
                    treedef,
                    [(a.layout, a.shape) if isinstance(a, MLXArray) else None for a in flat],
                )
                locals_.append(
                    optree.tree_unflatten(
                        treedef, [a.local if isinstance(a, MLXArray) else a for a in flat]
                    )
                )

            def inner(*chosen: Any) -> Any:
                full = list(args)
                for i, tree in zip(argnums, chosen):
                    treedef, kinds = layouts[i]
                    full[i] = optree.tree_unflatten(
                        treedef,
                        [
                            MLXArray(a, *kind) if kind is not None else a
                            for a, kind in zip(optree.tree_leaves(tree), kinds)
                        ],
                    )
                out = fn(*full)
                value, aux = out if has_aux else (out, None)
                value = value.local if isinstance(value, MLXArray) else value
                if not isinstance(value, mx.array) or value.size != 1:
                    raise ConversionError(
                        f"value_and_grad needs {getattr(fn, '__name__', 'fn')} to return a "
                        f"scalar, got {short(value)}"
                    )
                return (value.reshape(()), aux) if has_aux else value.reshape(())

            positions = tuple(range(len(argnums)))
            if has_aux:
                value, grads = _with_aux(mx, inner, positions, locals_)
            else:
                value, grads = mx.value_and_grad(inner, argnums=positions)(*locals_)
            if len(argnums) == 1 and not isinstance(grads, tuple):
                grads = (grads,)
            out = []
            for i, g in zip(argnums, grads):
                treedef, kinds = layouts[i]
                out.append(
                    optree.tree_unflatten(
                        treedef,
                        [
                            MLXArray(leaf, *kind) if kind is not None else leaf
                            for leaf, kind in zip(optree.tree_leaves(g), kinds)
                        ],
                    )
                )
            return value, tuple(out)

        return run

    def full_array(self, array: Any) -> Any:
        """numpy of an :class:`MLXArray`'s whole value, from every process's block (one world
        all_gather of blocks padded to the largest), or of an ``mx.array``."""
        if not isinstance(array, MLXArray):
            return np.array(array)
        mx = _mx()
        layout, shape = array.layout, array.shape
        if layout.spec.partial:
            raise UnsupportedError(
                f"full_array of a partial layout {layout.spec!r}: reduce it "
                "first (psum inside shard_map)",
                backend=self.name,
                capability="partial",
            )
        world = self._world()
        slices = [layout.shard_slices(shape, r) for r in range(int(world.size()))]
        widths = [[s.stop - s.start for s in sl] for sl in slices]
        biggest = tuple(max(w[d] for w in widths) for d in range(len(shape)))
        local = np.zeros(biggest, dtype=np.array(array.local).dtype)
        local[tuple(slice(0, n) for n in array.local.shape)] = np.array(array.local)
        every = np.array(mx.distributed.all_gather(mx.expand_dims(mx.array(local), 0), group=world))
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
            raise ConversionError(
                f"the mlx backend shards the parameters of an mlx.nn.Module, not {short(model)}"
            )
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
        return (
            f"MLXArray(shape={self.shape}, block={tuple(self.local.shape)}, "
            f"spec={self.layout.spec!r})"
        )


def _native_group(group: Any) -> Any:
    """The ``mx.distributed.Group`` of a handle (a split :class:`AxisGroup` or the world)."""
    return group.group if isinstance(group, AxisGroup) else group


def _with_aux(mx: Any, inner: Any, positions: tuple[int, ...], locals_: list[Any]) -> Any:
    """``mx.value_and_grad`` of a function returning (value, aux): aux rides along as the
    second output, which MLX does not differentiate."""
    box: list[Any] = []

    def value_only(*chosen: Any) -> Any:
        value, aux = inner(*chosen)
        box.append(aux)
        return value

    value, grads = mx.value_and_grad(value_only, argnums=positions)(*locals_)
    return (value, box[-1]), grads


def shard_linear(linear: Any, layout: Layout, native_mesh: MLXMesh) -> Any:
    """MLX's own tensor-parallel layer for a Linear whose weight (MLX's ``(out, in)``) is laid
    out as ``layout``: ``P(axis, None)`` shards the outputs (``"all-to-sharded"``),
    ``P(None, axis)`` the inputs (``"sharded-to-all"``), over ``axis``'s group."""
    from mlx.nn.layers.distributed import shard_linear as mlx_shard_linear

    spec = tuple(layout.spec) + (None,) * (2 - len(layout.spec))
    if (
        len(spec) != 2
        or (spec[0] is None) == (spec[1] is None)
        or any(isinstance(e, tuple) for e in spec)
    ):
        raise LayoutError(
            f"shard_linear takes P(axis, None) or P(None, axis) for a Linear "
            f"weight, got {layout.spec!r}"
        )
    axis = spec[0] if spec[0] is not None else spec[1]
    assert isinstance(axis, str)
    group = native_mesh.axis_group(axis)
    if group.emulated and group.size() != native_mesh.world.size():
        raise UnsupportedError(
            f"MLX's sharded Linear layers need a real group for axis {axis!r}, and this MLX "
            "distributed backend cannot split one (ring); use the MPI backend",
            backend="mlx",
            capability="axis_groups",
        )
    sharding = "all-to-sharded" if spec[0] is not None else "sharded-to-all"
    layer = mlx_shard_linear(
        linear, sharding, group=group.group if group.group is not None else native_mesh.world
    )
    _LAYERS.append(weakref.ref(layer))  # it holds the split group: released at exit too
    return layer
