"""unimesh backend for TensorFlow DTensor: ``tf.experimental.dtensor`` Mesh and Layout.

Importing this package does not import tensorflow; the backend imports it on first use.
"""

from __future__ import annotations

from .backend import TensorFlowBackend, configure_cpu_devices

__all__ = ["TensorFlowBackend", "configure_cpu_devices"]
