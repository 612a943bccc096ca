"""A deliberately wrong variant: it swaps devices 0 and 1 in every mesh it builds. The
conformance suite must catch it."""

from typing import Any

import numpy as np

from unimesh import Mesh
from unimesh.plugin import hookimpl

from .backend import ExampleBackend, ExampleMesh


class BrokenBackend(ExampleBackend):
    name = "example_broken"

    def mesh_to_native(self, mesh: Mesh, **options: Any) -> ExampleMesh:
        ids = np.array(mesh.device_ids)
        flat = ids.reshape(-1)
        a, b = np.flatnonzero(flat == 0), np.flatnonzero(flat == 1)
        if a.size and b.size:
            flat[a[0]], flat[b[0]] = 1, 0
        return ExampleMesh(ids, mesh.axis_names)


@hookimpl
def unimesh_backend() -> BrokenBackend:
    return BrokenBackend()
