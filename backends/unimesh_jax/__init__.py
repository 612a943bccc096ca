"""unimesh backend for JAX: ``jax.sharding.Mesh``, ``NamedSharding``, ``jax.Array``.

Importing this package does not import jax; the backend imports it on first use.
"""

from __future__ import annotations

from .backend import JaxAxisEnv, JaxBackend, global_devices, key_path, request_cpu_devices, use_mesh

__all__ = [
    "JaxAxisEnv",
    "JaxBackend",
    "global_devices",
    "key_path",
    "request_cpu_devices",
    "use_mesh",
]
