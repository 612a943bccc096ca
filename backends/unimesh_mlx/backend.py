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
        groups = ", ".join(f"{axis}_group" for axis in mesh.axis_names)
        lines.append(
            f"# before the process ends: del {groups} (MPI aborts a group freed after finalize)"
        )
        return "\n".join(lines)

    def native_layout_code(self, layout: Layout) -> str:
        """MLX has no layout object: a function giving each rank its block of a global array
        (nested ``torch.chunk`` splits, the reference), used with ``world.rank()``."""
        spec = [
            None if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in layout.spec
        ]
        mesh = layout.mesh
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        return "\n".join(
            [
                "import numpy as np",
                "",
                f"# {layout.spec!r}: MLX has no layout object; each process keeps its block",
                f"SPEC = {spec!r}  # mesh axes splitting each dim, major first",
                f"SIZES = {sizes!r}",
                f"IDS = np.array({mesh.device_ids.tolist()})  # the rank at each mesh coordinate",
                "",
                "",
                "def block(x, rank):",
                '    """This rank\'s block of the global array x: chunks of ceil(n / size)."""',
                "    coords = dict(zip(SIZES, np.argwhere(IDS == rank)[0].tolist()))",
                "    index = []",
                "    for dim, axes in enumerate(SPEC):",
                "        lo, hi = 0, x.shape[dim]",
                "        for axis in axes or ():",
                "            step = -(-(hi - lo) // SIZES[axis])",
                "            k = coords[axis]",
                "            lo, hi = min(lo + k * step, hi), min(lo + (k + 1) * step, hi)",
                "        index.append(slice(lo, hi))",
                "    return x[tuple(index)]",
                "",
                "",
                "# local = mx.array(block(x, world.rank()))",
            ]
        )

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
