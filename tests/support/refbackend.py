"""A small in-repo backend used by the registry tests: its "framework" is numpy and its native
objects are the plain classes below. It translates only; the meaning comes from the core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import unimesh
from unimesh import Backend, Layout, Mesh


@dataclass
class NativeMesh:
    ids: np.ndarray
    names: tuple[str, ...]


@dataclass
class NativeLayout:
    mesh: NativeMesh
    placements: tuple[Any, ...]
    ndim: int


class RefBackend(Backend):
    name = "ref"
    framework = "numpy"
    extra = "ref"
    native_modules = (__name__.split(".")[0],)
    features = frozenset({"uneven_shards"})

    def mesh_to_native(self, mesh: Mesh, **options: Any) -> NativeMesh:
        return NativeMesh(np.array(mesh.device_ids), mesh.axis_names)

    def layout_to_native(self, layout: Layout, **options: Any) -> NativeLayout:
        return NativeLayout(self.mesh_to_native(layout.mesh), layout.placements(), len(layout.spec))

    def from_native(self, obj: Any) -> Any:
        if isinstance(obj, NativeMesh):
            return Mesh(obj.ids.shape, obj.names, obj.ids)
        if isinstance(obj, NativeLayout):
            return Layout.from_placements(self.from_native(obj.mesh), obj.placements, obj.ndim)
        raise unimesh.ConversionError(f"not a ref object: {obj!r}")

    def distribute(self, array: Any, layout: Layout, **options: Any) -> dict[int, np.ndarray]:
        return {d: np.asarray(array)[sl] for d, sl in layout.device_slices(array.shape).items()}

    def local_shards(self, array: Any) -> dict[int, Any]:
        return dict(array)
