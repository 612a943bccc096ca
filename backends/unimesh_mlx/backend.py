"""The MLX backend, in three layers (``runtime.py``, ``translate.py``, ``programs.py``); this
module holds the declarations. A device id is the rank of the process (MLX gives each process
one device). Split groups are released at exit, before MPI finalizes. mlx is imported inside the
functions, never at module import.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from unimesh import Layout, Mesh, PartitionSpec
from unimesh.launchers import LauncherSign

from .programs import MLXPrograms, shard_linear
from .runtime import _mx
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

    def compile(self, fn: Any, options: dict[str, Any]) -> Any:
        """``mx.compile`` of ``fn`` with :class:`MLXArray` arguments and results handed over
        as their blocks (see :func:`unimesh_mlx.compiled`)."""
        from .compiled import compiled

        return compiled(fn, options)

    def stop_gradient(self, x: Any) -> Any:
        local = x.local if isinstance(x, MLXArray) else x
        stopped = _mx().stop_gradient(local)
        return MLXArray(stopped, x.layout, x.shape) if isinstance(x, MLXArray) else stopped

    # -- models: unimesh.save(path, module) / unimesh.load(path, module) -----------------------
    def model_state(self, model: Any) -> dict[str, Any] | None:
        """An ``mlx.nn.Module``'s parameters by path: the weights of MLX's sharded layers
        (``AllToShardedLinear``, ``ShardedToAllLinear``, from ``shard_linear``) and of
        ``fully_shard`` modules as distributed arrays of their global shape, everything else
        as numpy (held whole by every process)."""
        from mlx.nn.layers.base import Module
        from mlx.utils import tree_flatten

        if not isinstance(model, Module):
            return None
        from unimesh.convert import from_local

        from .runtime import mx_to_host

        layouts = _sharded_layouts(model, int(self._world().size()))
        rank = int(self._world().rank())
        out: dict[str, Any] = {}
        flat: Any = tree_flatten(model.parameters())  # type: ignore[no-untyped-call]
        for name, value in flat:
            found = layouts.get(name)
            if found is None:
                out[name] = mx_to_host(value)
                continue
            layout, dim = found
            shape = list(value.shape)
            shape[dim] *= _axis_size(layout, dim)
            out[name] = from_local({rank: value}, layout, tuple(shape), backend=self)
        return out

    def model_assign(self, model: Any, values: dict[str, Any]) -> None:
        """``model.update`` with each loaded value (this process's block of a sharded one)."""
        from mlx.utils import tree_unflatten

        from .runtime import host_to_mx

        items = [
            (name, value.local if isinstance(value, MLXArray) else host_to_mx(value))
            for name, value in values.items()
        ]
        model.update(tree_unflatten(items))


def _axis_size(layout: Layout, dim: int) -> int:
    entry = layout.spec[dim]
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return int(np.prod([layout.mesh.axis_size(a) for a in axes]))


def _sharded_layouts(model: Any, world: int) -> dict[str, tuple[Layout, int]]:
    """Parameter path -> (global layout, sharded dim) for the sharded layers of ``model``:
    MLX's sharded Linear layers (the layout unimesh's ``shard_linear`` recorded, else their
    group, which must then be the whole world: MLX does not say which ranks a split group
    holds) and ``FullyShardedModule`` (dim 0 over its group)."""
    from mlx.nn.layers import distributed as dist

    from unimesh import UnsupportedError

    out: dict[str, tuple[Layout, int]] = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        quantized = (dist.QuantizedAllToShardedLinear, dist.QuantizedShardedToAllLinear)
        if isinstance(module, quantized):
            raise UnsupportedError(
                f"{path or 'the model'} is a quantized sharded layer; unimesh saves and loads "
                "unquantized ones (quantize after loading)",
                backend="mlx",
            )
        sharded = isinstance(module, (dist.AllToShardedLinear, dist.ShardedToAllLinear))
        if not sharded and not isinstance(module, dist.FullyShardedModule):
            continue
        size = int(module.group.size()) if hasattr(module, "group") else world
        recorded = getattr(module, "_unimesh_layout", None)
        if getattr(module, "_unimesh_segments", 1) != 1:
            raise UnsupportedError(
                f"{path or 'the model'} is a fused layer sharded by segments "
                f"({module._unimesh_segments}): each process holds a slice of every segment, "
                "not one block of the weight; save the unfused layers (or the model before "
                "shard_linear)",
                backend="mlx",
            )
        if recorded is None and size != world:
            raise UnsupportedError(
                f"{path or 'the model'} is sharded over a group of {size} of the {world} "
                "processes, which MLX does not name; build it with unimesh_mlx.shard_linear "
                "(which records its layout) or over the whole world",
                backend="mlx",
            )
        mesh = Mesh((world,), ("shard",))
        if isinstance(module, dist.FullyShardedModule):
            for inner in module._paths:
                out[f"{prefix}module.{inner}"] = (Layout(mesh, PartitionSpec("shard")), 0)
            continue
        weight = recorded or Layout(
            mesh,
            PartitionSpec("shard", None)
            if isinstance(module, dist.AllToShardedLinear)
            else PartitionSpec(None, "shard"),
        )
        dim = 0 if weight.spec[0] is not None else 1
        out[f"{prefix}weight"] = (weight, dim)
        if "bias" in module and dim == 0:  # a sharded-to-all layer's bias is whole
            out[f"{prefix}bias"] = (Layout(weight.mesh, PartitionSpec(weight.spec[0])), 0)
    return out
