"""The MLX backend's translator layer. MLX has no mesh type: ``to_native(mesh)`` gives an
:class:`MLXMesh` (the world group, this process's ``mx.Device``, its coordinates, and an
:class:`AxisGroup` per mesh axis whose members are the neutral group holding this rank, in the
neutral order); a layout is this process's block (:class:`MLXLayout`, :class:`MLXArray`)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from unimesh import (
    ConversionError,
    Layout,
    Mesh,
    MeshMismatchError,
    PartitionSpec,
    UnsupportedError,
)
from unimesh.messages import short

from .process import PROCESS
from .runtime import MLXRuntime, host_to_mx, import_mx, mx_to_host
from .tracing import TRACING

if TYPE_CHECKING:
    from unimesh.groups import Group, GroupComm


class AxisGroup:
    """This rank's communication group along some mesh axes, as the SPMD engine holds it:
    ``members`` in the neutral order, and the engine's collectives on it
    (:class:`unimesh.groups.GroupComm`: MLX's own on a split group, else built over the world
    group, as in a program).
    """

    def __init__(self, axes: tuple[str, ...], comm: GroupComm, group: Group) -> None:
        self.axes = axes
        self.members = group.members
        self._comm = comm
        self._group = group

    @property
    def world(self) -> Any:
        """The world ``mx.distributed.Group``."""
        world: Any = self._comm.world()  # the backend's MLXGroup
        return world.group

    @property
    def group(self) -> Any:
        """The split ``mx.distributed.Group`` (None when emulated)."""
        handle: Any = self._group.handle  # the backend's MLXGroup
        return None if handle is None else handle.group

    @property
    def emulated(self) -> bool:
        return self.group is None

    def rank(self) -> int:
        return self._group.index

    def size(self) -> int:
        return self._group.size

    def all_sum(self, x: Any) -> Any:
        return self._comm.all_reduce(x, self._group, "sum")

    def all_max(self, x: Any) -> Any:
        return self._comm.all_reduce(x, self._group, "max")

    def all_min(self, x: Any) -> Any:
        return self._comm.all_reduce(x, self._group, "min")

    def all_gather(self, x: Any) -> Any:
        """The members' arrays concatenated along axis 0, in the neutral member order."""
        if self._group.size == 1:
            return x
        return self._comm.all_gather_dim(x, self.axes, 0, tiled=True)

    def __repr__(self) -> str:
        how = "emulated over the world group" if self.emulated else "split group"
        return f"AxisGroup(axes={self.axes}, members={self.members}, {how})"


class MLXMesh:
    """The MLX form of a neutral mesh for this process."""

    def __init__(self, mesh: Mesh, world: Any, device: Any, backend: MLXTranslator) -> None:
        self.mesh = mesh
        self.world = world
        self.device = device
        self.rank = int(world.rank())
        self.coords = mesh.coords(self.rank)
        self._groups: dict[tuple[str, ...], AxisGroup] = {}
        self._backend = backend

    def axis_group(self, axes: str | tuple[str, ...]) -> AxisGroup:
        """The group along ``axes`` holding this rank: the SPMD engine's group (made on first
        use, by every rank, once for this group and for the programs on this mesh)."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        made = self._groups.get(names)
        if made is None:
            comm = self._backend.axis_env(self.mesh).comm
            made = self._groups[names] = AxisGroup(names, comm, comm.group(names))
        return made

    @property
    def uses_split_groups(self) -> bool | None:
        """Whether the axis groups are MLX split groups (True: the MPI backend) or emulated
        over the world group (False: the ring backend, which cannot split, or a world of one
        process). Known before any group is built from the world and the launcher's
        environment (mpirun's, or mlx.launch's ring hostfile), and from the first split after;
        None only under a launcher neither names."""
        split: bool | None = self._backend.axis_env(self.mesh).can_split
        if split is not None:
            return split
        if self.world.size() == 1:
            return False
        return PROCESS.launcher.split

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


_FRESH: dict[int, weakref.ref[Any]] = {}


def fresh(array: Any) -> Any:
    """``array``, recorded as made here from host data: no gradient can reach it (MLX
    differentiates only the arrays its transforms were given, as new tracer objects), so a
    program skips its gradient rules at the edge where it enters."""
    key = id(array)

    def forget(ref: weakref.ref[Any]) -> None:
        if _FRESH.get(key) is ref:
            del _FRESH[key]

    _FRESH[key] = weakref.ref(array, forget)
    return array


def is_fresh(array: Any) -> bool:
    """Whether ``array`` is one :func:`fresh` recorded (and still alive)."""
    ref = _FRESH.get(id(array))
    return ref is not None and ref() is array


class MLXArray:
    """What a shard_map returns on MLX, which has no global array type: this process's block
    (``local``, an ``mx.array``), the layout it follows, and the global ``shape``.
    :func:`unimesh.full_array` gathers the whole value."""

    def __init__(self, local: Any, layout: Layout, shape: tuple[int, ...]) -> None:
        self.local = local
        self.layout = layout
        self.shape = shape

    @property
    def dtype(self) -> Any:
        """The block's ``mx.Dtype``."""
        return self.local.dtype

    def __repr__(self) -> str:
        return (
            f"MLXArray(shape={self.shape}, block={tuple(self.local.shape)}, "
            f"spec={self.layout.spec!r})"
        )


class MLXTranslator(MLXRuntime):
    """The translator layer (and ``axis_groups``, the groups of an :class:`MLXMesh`)."""

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
        return MLXMesh(mesh, world, import_mx().default_device(), self)

    def layout_to_native(self, layout: Layout, **options: Any) -> MLXLayout:
        """An :class:`MLXLayout`: which block of each global array this process holds."""
        return MLXLayout(self.mesh_to_native(layout.mesh, **options), layout)

    def from_native(self, obj: Any) -> Any:
        mx = import_mx()
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
        block = fresh(host_to_mx(host[layout.shard_slices(host.shape, native.rank)]))
        return MLXArray(block, layout, tuple(host.shape))

    def from_local(
        self,
        blocks: Mapping[int, Any],
        layout: Layout,
        shape: tuple[int, ...],
        dtype: Any = None,
        **options: Any,
    ) -> MLXArray:
        """An :class:`MLXArray` holding this process's block as it is (an ``mx.array`` is kept,
        anything else becomes one)."""
        mx = import_mx()
        native = self.mesh_to_native(layout.mesh, **options)
        block = blocks[native.rank]
        local = block if isinstance(block, mx.array) else fresh(host_to_mx(block))
        return MLXArray(local, layout, shape)

    def local_shards(self, array: Any) -> dict[int, Any]:
        local = array.local if isinstance(array, MLXArray) else array
        return {int(self._world().rank()): mx_to_host(local)}

    def axis_groups(self, native_mesh: Any, axis: str) -> dict[int, tuple[int, ...]]:
        return {native_mesh.rank: native_mesh.axis_group(axis).members}

    # -- live reshard (the transport: .transport.MLXTransport) ----------------------------------
    def native_blocks(self, array: Any) -> dict[int, Any]:
        """``{rank: the block}`` of an :class:`MLXArray` (no copy)."""
        local = array.local if isinstance(array, MLXArray) else array
        return {int(self._world().rank()): local}

    def check_reshard(
        self, array: Any, source: Layout, target: Layout, shape: tuple[int, ...]
    ) -> None:
        """Under an MLX transform, a pending max or min is refused (its gradient is not a
        move); while ``unimesh.compile`` traces a step, a move that sends between processes
        (its rounds run as they are called, which a trace cannot); the rest is as the
        default. ``array`` None: the reverse move of a gradient."""
        super().check_reshard(array, source, target, shape)
        from unimesh.moves import crosses
        from unimesh.transfer import addends, process_map, refuse_gradient_of_extreme

        if TRACING.compiling and any(
            crosses(part, target, shape, process_map(self, source, target))
            for part in addends(source)
        ):
            what = "the gradient of a reshard, the reverse move" if array is None else "the move"
            raise UnsupportedError(
                f"{what} {source!r} -> {target!r} under unimesh.compile: MLX sends its "
                "pieces between processes in rounds that run as they are called, which "
                "mx.compile cannot trace; reshard outside the compiled step (before it, or on "
                "its results), or call the step eagerly",
                backend=self.name,
                capability="reshard",
            )
        local = array.local if isinstance(array, MLXArray) else array
        if self.arrays().needs_grad(local):
            refuse_gradient_of_extreme(self.name, source)

    def move_with_gradient(
        self, blocks: Any, forward: Any, backward: Any, like: Any
    ) -> dict[int, Any]:
        """An ``mx.custom_function`` whose gradient rule is the reverse move of the
        cotangents (every rank holds a block of every MLX mesh, so every rank that moved data
        forward runs it)."""
        mx = import_mx()
        devices = sorted(blocks)
        if not devices:
            return dict(forward({}))
        box: dict[str, Any] = {}

        def move(given: list[Any]) -> list[Any]:
            out = forward(dict(zip(devices, given)))
            box["out"] = sorted(out)
            return [out[d] for d in box["out"]]

        def reverse(primals: Any, cotangents: Any, outputs: Any) -> Any:
            got = backward(dict(zip(box["out"], cotangents)))
            return ([got[d] for d in devices],)

        function = mx.custom_function(move)
        function.vjp(reverse)
        moved = function([blocks[d] for d in devices])
        return dict(zip(box["out"], moved))

    def native_code(self, of: Mesh | Layout) -> str:
        """``mx.distributed.init()`` and a ``world.split`` per mesh axis. A layout:
        :meth:`_layout_code`."""
        if isinstance(of, Layout):
            return self._layout_code(of)
        mesh = of
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
        groups = ", ".join(f"{axis}_group" for axis in mesh.axis_names)
        lines.append(
            f"# before the process ends: del {groups} (MPI aborts a group freed after finalize)"
        )
        return "\n".join(lines)

    def _layout_code(self, layout: Layout) -> str:
        """MLX has no layout object: a function giving each rank its block of a global array
        (nested ``torch.chunk`` splits, the reference), used with ``world.rank()``."""
        spec = [
            None if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in layout.spec
        ]
        mesh = layout.mesh
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        return "\n".join(
            [
                "import numpy as np",
                "",
                f"# {layout.spec!r}: MLX has no layout object; each process keeps its block",
                f"SPEC = {spec!r}  # mesh axes splitting each dim, major first",
                f"SIZES = {sizes!r}",
                f"IDS = np.array({mesh.device_ids.tolist()})  # the rank at each mesh coordinate",
                "",
                "",
                "def block(x, rank):",
                '    """This rank\'s block of the global array x: chunks of ceil(n / size)."""',
                "    coords = dict(zip(SIZES, np.argwhere(IDS == rank)[0].tolist()))",
                "    index = []",
                "    for dim, axes in enumerate(SPEC):",
                "        lo, hi = 0, x.shape[dim]",
                "        for axis in axes or ():",
                "            step = -(-(hi - lo) // SIZES[axis])",
                "            k = coords[axis]",
                "            lo, hi = min(lo + k * step, hi), min(lo + (k + 1) * step, hi)",
                "        index.append(slice(lo, hi))",
                "    return x[tuple(index)]",
                "",
                "",
                "# local = mx.array(block(x, world.rank()))",
            ]
        )

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """This process's block times its rows of the weight, summed over the group of the
        axes that split the columns (``all_sum``), assembled whole."""
        mx = import_mx()
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
