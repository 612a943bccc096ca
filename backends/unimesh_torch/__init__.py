"""unimesh backend for PyTorch: DeviceMesh and DTensor placements.

Importing this package does not import torch; the backend imports it on first use.
"""

from __future__ import annotations

from .backend import TorchBackend, TorchLayout, axis_mesh
from .tp_plan import layout_map_from_plan, plan_from_layout_map

__all__ = [
    "CheckpointReader",
    "TorchBackend",
    "TorchLayout",
    "axis_mesh",
    "layout_map_from_plan",
    "plan_from_layout_map",
]


def __getattr__(name: str) -> object:
    # CheckpointReader subclasses torch's StorageReader: its module imports torch, on first use
    if name == "CheckpointReader":
        from .dcp import CheckpointReader

        return CheckpointReader
    raise AttributeError(f"module 'unimesh_torch' has no attribute {name!r}")
