"""The example backend: a 'native' mesh is an id array with names; a distributed array is a dict
of per-device numpy blocks. It translates only; the meaning comes from unimesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import unimesh
from unimesh import Backend, Layout, Mesh


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


class ExampleBackend(Backend):
    name = "example"
    framework = "numpy"
    extra = "example"
    native_modules = ("unimesh_example",)
    capabilities = frozenset({"mesh", "layout", "distribute", "uneven_shards", "tuple_axes"})

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
        return ExampleArray(native, {d: host[sl] for d, sl in
                                     as_laid.device_slices(host.shape).items()})

    def local_shards(self, array: Any) -> dict[int, Any]:
        return dict(array.blocks)
