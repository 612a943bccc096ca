"""The JAX backend's declarations, over its three layers (``runtime.py``, ``translate.py``,
``programs.py``; ``rendezvous.py`` is the TCP rendezvous of a multi-process exchange). jax is
imported inside the functions, never at module import."""

from __future__ import annotations

from typing import ClassVar

from unimesh.launchers import LauncherSign

from .programs import JaxAxisEnv, JaxPrograms, key_path, use_mesh
from .runtime import JAX_ENV, global_devices, request_cpu_devices

__all__ = [
    "JaxAxisEnv",
    "JaxBackend",
    "global_devices",
    "key_path",
    "request_cpu_devices",
    "use_mesh",
]


class JaxBackend(JaxPrograms):
    """JAX (>= 0.5): ``jax.sharding.Mesh``, ``NamedSharding`` and ``jax.Array``."""

    name = "jax"
    framework = "jax"
    launcher_signs = (
        LauncherSign(
            "jax.distributed",
            any_set=("JAX_COORDINATOR_ADDRESS",),
            rank_var="JAX_PROCESS_ID",
            size_var="JAX_NUM_PROCESSES",
            evidence=JAX_ENV,
        ),
    )
    extra = "jax"
    native_modules = ("jax",)
    features = frozenset({"axis_types", "multi_process", "partial", "tuple_axes"})
    #: XLA's host platform: 4096 CPU devices start in ~1 s; 8192 take ~30 s and 1 GB
    max_simulated_devices = 4096
    max_mesh_axes = 32  # jax.sharding.Mesh flattens its device array with numpy, 32 dims at most
    native_layouts_immutable = True
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "jax.sharding.Mesh (AbstractMesh from_native)",
        "layout": "jax.sharding.NamedSharding(mesh, PartitionSpec)",
        "distribute": "jax.make_array_from_callback",
        "axis_groups": "named axis inside shard_map (no group object)",
        "shard_map": "jax.shard_map",
        "psum": "jax.lax.psum",
        "psum_scatter": "jax.lax.psum_scatter",
        "all_to_all": "jax.lax.all_to_all",
        "ppermute": "jax.lax.ppermute",
        "value_and_grad": "jax.value_and_grad",
        "all_gather": "jax.lax.all_gather(tiled=...)",
        "axis_index": "jax.lax.axis_index",
        "shard_params": "tree_map_with_path + distribute per leaf",
        "launch": "jax.distributed.initialize (JAX_COORDINATOR_ADDRESS, ...)",
    }
