"""unimesh backend for PyTorch: DeviceMesh and DTensor placements.

Importing this package does not import torch; the backend imports it on first use.
"""

from __future__ import annotations

from .backend import TorchBackend, TorchLayout, axis_mesh

__all__ = ["TorchBackend", "TorchLayout", "axis_mesh"]
