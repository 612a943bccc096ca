"""unimesh backend for Keras 3: ``keras.distribution`` DeviceMesh, TensorLayout, LayoutMap.

Importing this package does not import keras; the backend imports it on first use.
"""

from __future__ import annotations

from .backend import KerasBackend, distribution

__all__ = ["CheckpointCallback", "KerasBackend", "distribution"]


def __getattr__(name: str) -> object:
    # CheckpointCallback subclasses keras.callbacks.Callback: its module imports keras
    if name == "CheckpointCallback":
        from .callbacks import CheckpointCallback

        return CheckpointCallback
    raise AttributeError(f"module 'unimesh_keras' has no attribute {name!r}")
