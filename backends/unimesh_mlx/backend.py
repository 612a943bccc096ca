"""The MLX backend, in three layers (``runtime.py``, ``translate.py``, ``programs.py``); this
module holds the declarations. A device id is the rank of the process (MLX gives each process
one device). Split groups are released at exit, before MPI finalizes. mlx is imported inside the
functions, never at module import.
"""

from __future__ import annotations

from typing import ClassVar

from unimesh.launchers import LauncherSign

from .programs import MLXGroup, MLXPrograms, shard_linear
from .translate import AxisGroup, MLXArray, MLXLayout, MLXMesh

__all__ = ["AxisGroup", "MLXArray", "MLXBackend", "MLXLayout", "MLXMesh", "shard_linear"]


class MLXBackend(MLXPrograms):
    """MLX: one device per process, groups per mesh axis."""

    name = "mlx"
    launcher_name = "mlx.launch, ring"
    #: generic (names_framework=False): each yields to a framework's own launcher around it
    launcher_signs = (
        LauncherSign(
            "mlx.launch",
            any_set=("MLX_RANK",),
            rank_var="MLX_RANK",
            size_var="MLX_WORLD_SIZE",
            evidence=("MLX_RANK", "MLX_WORLD_SIZE", "MLX_HOSTFILE"),
            names_framework=False,
        ),
        LauncherSign(
            "mpirun",
            any_set=("OMPI_COMM_WORLD_SIZE",),
            rank_var="OMPI_COMM_WORLD_RANK",
            size_var="OMPI_COMM_WORLD_SIZE",
            evidence=("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            names_framework=False,
        ),
        LauncherSign(
            "mpirun",
            any_set=("PMI_SIZE",),
            rank_var="PMI_RANK",
            size_var="PMI_SIZE",
            evidence=("PMI_RANK", "PMI_SIZE"),
            names_framework=False,
        ),
    )
    lazy = True  # collectives run when evaluated: the engine chains them in program order
    sum_derivative_is_identity = True  # all_sum's own vjp passes the cotangent through
    framework = "mlx"
    extra = "mlx"
    native_modules = ("mlx", "unimesh_mlx")
    features = frozenset({"multi_process", "tuple_axes", "uneven_shards"})
    # mx.distributed.sum_scatter raises "not yet implemented" on MPI: the engine builds it
    native_primitives = frozenset({"all_reduce", "all_gather", "split"})
    group_type = MLXGroup  # the world and its split groups, with their collectives
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "unimesh_mlx.MLXMesh (mx.distributed world group + this mx.Device)",
        "layout": "unimesh_mlx.MLXLayout",
        "distribute": "this process's block (unimesh_mlx.MLXArray)",
        "axis_groups": "mx.distributed.Group.split (MPI); emulated on ring",
        "shard_map": "the function on this process's blocks",
        "psum": "mx.distributed.all_sum(x, group=axis group)",
        "all_gather": "mx.distributed.all_gather(x, group=axis group)",
        "axis_index": "the process's mesh coordinate (its axis group rank on MPI)",
        "shard_params": "model.update(blocks)",
        "launch": "mlx.launch -n N --backend ring, or mpirun -np N",
    }
