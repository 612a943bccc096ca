"""The torch backend: neutral Mesh <-> ``DeviceMesh``, Layout <-> DTensor placements, and
programs on torch.distributed, in three layers (``runtime.py``, ``translate.py``,
``programs.py``); this module holds the declarations.

torch is imported inside the methods, never at module import. Device ids are torch ranks (one
device per process). The meaning of every object comes from the core; the backend translates and
refuses, with :class:`unimesh.UnsupportedError`, what DTensor would silently do differently.
"""

from __future__ import annotations

from typing import Any, ClassVar

from unimesh import Layout, Mesh, Partial, Shard, StridedShard
from unimesh.launchers import LauncherSign

from .programs import TorchPrograms
from .runtime import _torch
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

    def native_code(self, mesh: Mesh) -> str:
        """``init_device_mesh`` where the ranks are in the default order, else ``DeviceMesh``
        over the rank tensor; every rank runs it."""
        head = (
            "# every rank runs this under torchrun, after torch.distributed.init_process_group\n"
            '# ("cpu" with gloo; "cuda" with nccl)\n'
        )
        names = tuple(mesh.axis_names)
        if mesh.is_default_order:
            return (
                "from torch.distributed.device_mesh import init_device_mesh\n\n"
                + head
                + f'mesh = init_device_mesh("cpu", {mesh.shape}, mesh_dim_names={names})'
            )
        return (
            "import torch\nfrom torch.distributed.device_mesh import DeviceMesh\n\n"
            + head
            + "# the ranks are not in row-major order, which init_device_mesh cannot express\n"
            f'mesh = DeviceMesh("cpu", torch.tensor({mesh.device_ids.tolist()}), '
            f"mesh_dim_names={names})"
        )

    def native_layout_code(self, layout: Layout) -> str:
        """DTensor placements, one per mesh dim, for ``distribute_tensor``."""
        text = []
        for p in layout.placements():
            if isinstance(p, StridedShard):
                text.append(f"_StridedShard({p.dim}, split_factor={p.split_factor})")
            elif isinstance(p, Shard):
                text.append(f"Shard({p.dim})")
            elif isinstance(p, Partial):
                text.append(f"Partial({p.op!r})")
            else:
                text.append("Replicate()")
        used = [n for n in ("Partial", "Replicate", "Shard") if any(t.startswith(n) for t in text)]
        lines = ["from torch.distributed.tensor import " + ", ".join([*used, "distribute_tensor"])]
        if any(t.startswith("_StridedShard") for t in text):
            lines.append("from torch.distributed.tensor.placement_types import _StridedShard")
        lines += [
            "",
            f"# {layout.spec!r}: one placement per mesh dim {tuple(layout.mesh.axis_names)}",
            f"placements = ({', '.join(text)}{',' if len(text) == 1 else ''})",
            "# dtensor = distribute_tensor(tensor, mesh, placements)",
        ]
        return "\n".join(lines)

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """DTensor matmul with a replicated weight, then ``full_tensor()``."""
        torch = _torch()
        from torch.distributed.tensor import Replicate, distribute_tensor

        device_mesh = array.device_mesh
        w = distribute_tensor(
            torch.from_numpy(weight), device_mesh, [Replicate()] * device_mesh.ndim
        )
        return (array @ w).full_tensor().numpy()

    def stop_gradient(self, x: Any) -> Any:
        return x.detach()

    def compile(self, fn: Any, options: dict[str, Any]) -> Any:
        """``torch.compile(fn, **options)``. The step's unimesh programs reach dynamo as single
        calls (``TorchPrograms.program_entry``), so ``fullgraph=True`` holds. A step made by
        :func:`unimesh.value_and_grad` (or ``grad``) is that step around the compiled
        function: torch.compile traces the forward and aot_autograd its backward, and
        autograd runs them outside the graph, as torch.compile users take gradients (dynamo
        does not trace ``torch.autograd.grad``). Shapes are static unless ``dynamic`` is
        given (a program's blocks follow from its arguments' shapes)."""
        import torch

        from .programs import mark_entries, surfacing

        mark_entries()
        # shapes specialize, as under jax.jit: a program's blocks and groups follow from them
        options = {"dynamic": False, **options}
        grad_of = getattr(fn, "unimesh_grad_of", None)
        if grad_of is not None:
            inner, around = grad_of
            return around(surfacing(torch.compile(inner, **options)))
        return surfacing(torch.compile(fn, **options))

    # -- models: unimesh.save(path, module) / unimesh.load(path, module) -----------------------
    def model_state(self, model: Any) -> dict[str, Any] | None:
        """An ``nn.Module``'s state_dict: DTensors as they are (FSDP2 and TP layouts), plain
        tensors as numpy."""
        torch = _torch()
        if not isinstance(model, torch.nn.Module):
            return None
        from torch.distributed.tensor import DTensor

        from .translate import to_host

        return {
            name: t if isinstance(t, DTensor) else to_host(t.detach().cpu())
            for name, t in model.state_dict().items()
        }

    def model_assign(self, model: Any, values: dict[str, Any]) -> None:
        """Copy each loaded value into the module's own parameter or buffer (shard by shard for
        a DTensor, in its layout)."""
        torch = _torch()
        from torch.distributed.tensor import DTensor

        from .translate import _from_host

        live = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in values.items():
                into = live[name]
                if isinstance(into, DTensor):
                    into.to_local().copy_(value.to_local())
                else:
                    into.copy_(_from_host(value))
