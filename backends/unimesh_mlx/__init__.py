"""unimesh backend for MLX, which has no mesh type: this process's device, the world group, and
a communication group per mesh axis (``Group.split`` where the distributed backend has it,
emulated over world collectives where it does not, as on MLX's ring backend).

Importing this package does not import mlx; the backend imports it on first use.
"""

from __future__ import annotations

from .backend import (
    AxisGroup,
    MLXArray,
    MLXBackend,
    MLXLayout,
    MLXMesh,
    shard_linear,
)

__all__ = ["AxisGroup", "MLXArray", "MLXBackend", "MLXLayout", "MLXMesh", "shard_linear"]
