"""The torch backend: neutral Mesh <-> ``DeviceMesh``, Layout <-> DTensor placements, and
programs on torch.distributed, in three layers (``runtime.py``, ``translate.py``,
``programs.py``); this module holds the declarations.

torch is imported inside the methods, never at module import. Device ids are torch ranks (one
device per process). The meaning of every object comes from the core; the backend translates and
refuses, with :class:`unimesh.UnsupportedError`, what DTensor would silently do differently.
"""

from __future__ import annotations

from typing import Any, ClassVar

from unimesh import Mesh

from .programs import TorchPrograms
from .runtime import _torch
from .translate import TorchLayout, axis_mesh

__all__ = ["TorchBackend", "TorchLayout", "axis_mesh"]


class TorchBackend(TorchPrograms):
    """PyTorch: ``DeviceMesh`` and DTensor placements (torch >= 2.6)."""

    name = "torch"
    launcher_name = "torchrun, gloo"
    framework = "torch"
    extra = "torch"
    native_modules = ("torch", "unimesh_torch")
    features = frozenset({"multi_process", "partial", "tuple_axes", "uneven_shards"})
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
    typed = True  # TorchFunctionMode sees every operation: JAX's check_vma gradient rules
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

    def native_code(self, mesh: Mesh) -> str:
        """``DeviceMesh("cpu", ids, mesh_dim_names=...)``, run by every rank."""
        return (
            "import torch\nfrom torch.distributed.device_mesh import DeviceMesh\n\n"
            "# every rank runs this, after torch.distributed.init_process_group\n"
            f'mesh = DeviceMesh("cpu", torch.tensor({mesh.device_ids.tolist()}), '
            f"mesh_dim_names={tuple(mesh.axis_names)})"
        )

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """DTensor matmul with a replicated weight, then ``full_tensor()``."""
        torch = _torch()
        from torch.distributed.tensor import Replicate, distribute_tensor

        device_mesh = array.device_mesh
        w = distribute_tensor(
            torch.from_numpy(weight), device_mesh, [Replicate()] * device_mesh.ndim
        )
        return (array @ w).full_tensor().numpy()
