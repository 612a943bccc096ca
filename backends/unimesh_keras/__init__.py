"""unimesh backend for Keras 3: ``keras.distribution`` DeviceMesh, TensorLayout, LayoutMap.

Importing this package does not import keras; the backend imports it on first use.
"""

from __future__ import annotations

from .backend import KerasBackend, distribution

__all__ = ["KerasBackend", "distribution"]
