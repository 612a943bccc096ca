"""The torch backend: neutral Mesh <-> ``DeviceMesh``, Layout <-> DTensor placements, and
programs on torch.distributed, in three layers (``runtime.py``, ``translate.py``,
``programs.py``); this module holds the declarations.

torch is imported inside the methods, never at module import. Device ids are torch ranks (one
device per process). The meaning of every object comes from the core; the backend translates and
refuses, with :class:`unimesh.UnsupportedError`, what DTensor would silently do differently.
"""

from __future__ import annotations

from typing import ClassVar

from unimesh.launchers import LauncherSign

from .programs import TorchGroup, TorchPrograms
from .translate import TorchLayout, axis_mesh

__all__ = ["TorchBackend", "TorchLayout", "axis_mesh"]


class TorchBackend(TorchPrograms):
    """PyTorch: ``DeviceMesh`` and DTensor placements (torch >= 2.6)."""

    name = "torch"
    launcher_name = "torchrun, gloo"
    launcher_signs = (
        LauncherSign(
            "torchrun",
            any_set=("TORCHELASTIC_RUN_ID",),
            all_set=("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
            rank_var="RANK",
            size_var="WORLD_SIZE",
        ),
    )
    framework = "torch"
    extra = "torch"
    native_modules = ("torch", "unimesh_torch")
    features = frozenset({"multi_process", "partial", "tuple_axes", "uneven_shards"})
    max_mesh_axes = 32  # DeviceMesh builds its groups with numpy, 32 dims at most
    native_primitives = frozenset(
        {
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "permute",
            "broadcast",
            "split",
        }
    )
    group_type = TorchGroup  # the DeviceMesh's process groups, with their collectives
    check_vma = True  # a TorchFunctionMode sees every operation: JAX's check_vma rules
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "torch.distributed.device_mesh.DeviceMesh",
        "layout": "DTensor placements: Shard(d), Replicate(), Partial(op), _StridedShard",
        "distribute": "torch.distributed.tensor.distribute_tensor",
        "axis_groups": "DeviceMesh.get_group(axis)",
        "shard_map": "DTensor.to_local / DTensor.from_local around the function",
        "psum": "_functional_collectives.all_reduce(x, 'sum', group)",
        "all_gather": "_functional_collectives.all_gather_single (reordered to coordinates)",
        "axis_index": "the rank's mesh coordinate (like DeviceMesh.get_local_rank(axis))",
        "shard_params": "nn.Parameter(distribute_tensor(param, mesh, placements))",
        "launch": "torchrun --standalone --nproc-per-node N (gloo)",
    }

    def __init__(self) -> None:
        """The backend's whole state (its layers hold none of their own)."""
        super().__init__()  # the engine's
        # DeviceMeshes built in this process under the current world group:
        # (device type, mesh[, backend override]) -> DeviceMesh. Sub-meshes are sliced from
        # these, so that no rank-dependent group is ever created. A new world group empties it.
        self._meshes = {}
        self._world_group = None
        # (layout, global shape, dtype) -> DTensorSpec of shard_map results (wrap_result)
        self._specs = {}
        # Layout -> TorchLayout of programs' arguments and results, under the current world
        self._native_layouts = {}
