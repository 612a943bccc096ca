"""The example backend: a 'native' mesh is an id array with names; a distributed array is a dict
of per-device numpy blocks. It translates only; the meaning comes from unimesh."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import unimesh
from unimesh import Layout, Mesh
from unimesh.spmd import ProcessBackend, ProcessGroup


@dataclass
class ExampleMesh:
    ids: np.ndarray
    names: tuple[str, ...]


@dataclass
class ExampleLayout:
    mesh: ExampleMesh
    entries: tuple[Any, ...]


@dataclass
class ExampleArray:
    layout: ExampleLayout
    blocks: dict[int, np.ndarray]
    shape: tuple[int, ...] = ()

    @property
    def dtype(self) -> Any:
        return next(iter(self.blocks.values())).dtype if self.blocks else np.dtype("float32")


class ExampleBackend(ProcessBackend):
    name = "example"
    framework = "numpy"
    extra = "example"
    native_modules = ("unimesh_example",)
    features = frozenset({"tuple_axes", "uneven_shards"})
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "unimesh_example.Mesh (ids and names)",
        "layout": "unimesh_example.Layout (mesh and spec entries)",
        "distribute": "a dict of numpy blocks by device",
    }

    def prepare_devices(self, count: int) -> int:
        return count

    def mesh_to_native(self, mesh: Mesh, **options: Any) -> ExampleMesh:
        return ExampleMesh(np.array(mesh.device_ids), mesh.axis_names)

    def layout_to_native(self, layout: Layout, **options: Any) -> ExampleLayout:
        return ExampleLayout(self.mesh_to_native(layout.mesh), tuple(layout.spec))

    def from_native(self, obj: Any) -> Any:
        if isinstance(obj, ExampleMesh):
            return Mesh(obj.ids.shape, obj.names, obj.ids)
        if isinstance(obj, ExampleLayout):
            return Layout(self.from_native(obj.mesh), obj.entries)
        if isinstance(obj, ExampleArray):
            return self.from_native(obj.layout)
        raise unimesh.ConversionError(f"not an example object: {obj!r}")

    def distribute(self, array: Any, layout: Layout, **options: Any) -> ExampleArray:
        native = self.layout_to_native(layout)
        mesh = self.from_native(native.mesh)  # the blocks follow the native mesh
        as_laid = Layout(mesh, layout.spec)
        host = np.asarray(array)
        return ExampleArray(
            native, {d: host[sl] for d, sl in as_laid.device_slices(host.shape).items()}, host.shape
        )

    def local_shards(self, array: Any) -> dict[int, Any]:
        return dict(array.blocks)

    def from_local(
        self,
        blocks: dict[int, Any],
        layout: Layout,
        shape: tuple[int, ...],
        dtype: Any = None,
        **options: Any,
    ) -> ExampleArray:
        """The blocks as they are (the core checked their shapes): with ``local_shards``, what
        ``unimesh.save`` and ``unimesh.load`` need (the ``checkpoint`` capability)."""
        return ExampleArray(self.layout_to_native(layout), dict(blocks), shape)

    # -- what the command line and the docs ask of a backend --------------------------------------
    def native_code(self, of: Mesh | Layout) -> str | None:
        if isinstance(of, Layout):
            return None  # no layout object to write
        mesh = of
        return (
            "import numpy as np\nfrom unimesh_example.backend import ExampleMesh\n\n"
            f"mesh = ExampleMesh(np.array({mesh.device_ids.tolist()}), "
            f"{tuple(mesh.axis_names)})"
        )

    def demo_compute(self, array: Any, weight: Any) -> np.ndarray:
        """Each block times its rows of the weight, added into its rows of the product once
        per distinct block."""
        layout = self.from_native(array.layout)
        out = np.zeros((array.shape[0], weight.shape[1]), dtype=np.float64)
        seen = set()
        for d, block in array.blocks.items():
            rows, cols = layout.shard_slices(array.shape, d)
            key = (rows.start, rows.stop, cols.start, cols.stop)
            if key not in seen:
                seen.add(key)
                out[rows] += block @ weight[cols]
        return out


# -- programs: the core's per-process engine, with one thread per device ------------------------
class _Board:
    """Where the members of one group meet: a slot each and a barrier."""

    def __init__(self, size: int) -> None:
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def exchange(self, index: int, x: np.ndarray) -> np.ndarray:
        self.slots[index] = x
        self.barrier.wait()
        out = np.stack(self.slots)
        self.barrier.wait()  # nobody writes the next round before everyone has read this one
        return out


@dataclass
class _Group(ProcessGroup):
    """A group of threads: its members, their board, and the backend (whose thread is which
    member), with the two collectives the engine needs."""

    members: tuple[int, ...]
    board: _Board
    backend: ThreadedExampleBackend

    def all_gather(self, x: Any) -> Any:
        return self.board.exchange(self.members.index(self.backend.process_index()), np.asarray(x))

    def all_reduce(self, x: Any, op: str) -> Any:
        return self.backend.arrays().reduce(self.all_gather(x), op)


class ThreadedExampleBackend(ExampleBackend):
    """The example backend with programs: a thread per device runs the core's engine, and the
    only primitives written here are all-gather and all-reduce on a group (:class:`_Group`; the
    engine builds reduce-scatter, all-to-all, permute and broadcast from them)."""

    native_primitives = frozenset({"all_reduce", "all_gather", "split"})
    group_type = _Group

    def __init__(self) -> None:
        super().__init__()  # the engine's state
        self._local = threading.local()
        self._lock = threading.Lock()
        self._boards: dict[tuple[int, ...], _Board] = {}

    def _board(self, members: tuple[int, ...]) -> _Board:
        with self._lock:
            return self._boards.setdefault(members, _Board(len(members)))

    # the "process" is the thread
    def process_index(self) -> int:
        return int(self._local.device)

    def process_devices(self, mesh: Mesh) -> tuple[int, ...]:
        """Inside a program, the thread's device; outside (save, load, from_local), this one
        process holds every device of the mesh."""
        if not hasattr(self._local, "device"):
            return tuple(sorted(mesh.device_ids.ravel().tolist()))
        return super().process_devices(mesh)

    def group_cache_key(self) -> Any:
        return self._local.device  # one engine (and set of groups) per device, i.e. thread

    def world_group(self) -> Any:
        members = tuple(range(self._local.world))
        return _Group(members, self._board(members), self)

    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        members = tuple(int(m) for m in rows[row])
        return _Group(members, self._board(members), self)

    # array operations: numpy's, the default (Backend.arrays; no autodiff)
    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]:
        if isinstance(arg, ExampleArray):
            if self.from_native(arg.layout) == layout:
                return arg.blocks[device], False
            return self.full_array(arg), True  # laid out otherwise: the engine cuts it again
        return np.asarray(arg), True

    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any:
        return block

    def shard_map(self, body: Any, mesh: Mesh, ins: Any, outs: Any) -> Any:
        """Runs the engine's program on a thread per device of the mesh; results are
        ExampleArrays of every device's block."""
        import optree

        from unimesh.spmd import ProcessBackend

        def run(*args: Any) -> Any:
            results: dict[int, Any] = {}
            errors: list[BaseException] = []

            def device(d: int) -> None:
                self._local.device, self._local.world = d, mesh.size
                try:
                    results[d] = program_for[d](*args)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                    errors.append(exc)
                    for board in list(self._boards.values()):
                        board.barrier.abort()

            program_for = {
                int(d): ProcessBackend.shard_map(self, body, mesh, ins, outs)
                for d in mesh.device_ids.ravel()
            }
            threads = [
                threading.Thread(target=device, args=(int(d),)) for d in mesh.device_ids.ravel()
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:  # the first real error; peers woken by the abort report a broken barrier
                for board in self._boards.values():
                    board.barrier.reset()  # every thread has ended: the boards serve again
                raise next(
                    (e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                    errors[0],
                )
            first = results[int(mesh.device_ids.flat[0])]
            treedef = optree.tree_structure(first)
            layouts = outs.for_leaves(first, treedef)
            per_device = {d: optree.tree_leaves(r) for d, r in results.items()}
            return optree.tree_unflatten(
                treedef,
                [
                    ExampleArray(self.layout_to_native(lay), {d: per_device[d][i] for d in results})
                    for i, lay in enumerate(layouts)
                ],
            )

        return run

    def full_array(self, array: Any) -> Any:
        if not isinstance(array, ExampleArray):
            return np.asarray(array)
        layout = self.from_native(array.layout)
        first = next(iter(array.blocks.values()))
        shape = array.shape or layout.global_shape(first.shape)
        out = np.zeros(shape, first.dtype)
        for d, block in array.blocks.items():
            out[layout.shard_slices(shape, d)] = block
        return out
