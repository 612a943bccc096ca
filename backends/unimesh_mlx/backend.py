"""The MLX backend, in three layers (``runtime.py``, ``translate.py``, ``programs.py``); this
module holds the declarations. A device id is the rank of the process (MLX gives each process
one device). Split groups are released at exit, before MPI finalizes. mlx is imported inside the
functions, never at module import.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from unimesh import Layout, Mesh, PartitionSpec

from .programs import MLXPrograms, shard_linear
from .runtime import _mx
from .translate import AxisGroup, MLXArray, MLXLayout, MLXMesh

__all__ = ["AxisGroup", "MLXArray", "MLXBackend", "MLXLayout", "MLXMesh", "shard_linear"]


class MLXBackend(MLXPrograms):
    """MLX: one device per process, groups per mesh axis."""

    name = "mlx"
    launcher_name = "mlx.launch, ring"
    lazy = True  # collectives run when evaluated: the engine chains them in program order
    framework = "mlx"
    extra = "mlx"
    native_modules = ("mlx", "unimesh_mlx")
    features = frozenset({"multi_process", "tuple_axes", "uneven_shards"})
    # mx.distributed.sum_scatter raises "not yet implemented" on MPI: the engine builds it
    native_primitives = frozenset({"all_reduce", "all_gather", "split"})
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

    def native_code(self, mesh: Mesh) -> str:
        """``mx.distributed.init()`` and a ``world.split`` per mesh axis."""
        lines = [
            "import mlx.core as mx\n",
            "world = mx.distributed.init()  # one process per device",
            "rank = world.rank()",
        ]
        for axis in mesh.axis_names:
            rows = mesh.groups(axis)
            lines += [
                f"# {axis!r} groups: {rows}",
                f"rows = {rows}",
                "row = next(i for i, g in enumerate(rows) if rank in g)",
                f"{axis}_group = world.split(row, rows[row].index(rank))  # MPI backend",
            ]
        return "\n".join(lines)

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """This process's block times its rows of the weight, summed over the group of the
        axes that split the columns (``all_sum``), assembled whole."""
        mx = _mx()
        layout, shape = array.layout, array.shape
        cols = layout.shard_slices(shape, int(self._world().rank()))[1]
        partial = array.local @ mx.array(np.asarray(weight)[cols])
        if layout.spec[1] is not None:
            native = self.mesh_to_native(layout.mesh)
            entry = layout.spec[1]
            partial = native.axis_group(entry if isinstance(entry, str) else tuple(entry)).all_sum(
                partial
            )
        out = Layout(layout.mesh, PartitionSpec(layout.spec[0], None))
        return self.full_array(MLXArray(partial, out, (shape[0], int(weight.shape[1]))))
