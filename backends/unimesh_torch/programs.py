"""The torch backend's program layer: the core's per-process engine on gloo/NCCL process
groups (DeviceMesh groups), DTensors in and out, JAX's check_vma gradient rules through a
``TorchFunctionMode``, and ``shard_params``; ``value_and_grad`` is torch autograd's
(``grad.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from unimesh import ConversionError, Layout, Mesh, MeshMismatchError
from unimesh.messages import short
from unimesh.spmd import ProcessGroup

from . import compiled, grad
from .autograd import (
    BLOCK,
    LEAF,
    OPS,
    dtensor,
    from_local_function,
    vjp_function,
    vma_mode,
)
from .compiled import compiling, funcol, real_mesh, traced_permute
from .runtime import import_dist, import_torch
from .translate import TorchLayout, TorchTranslator, global_stride, to_host
from .transport import hot


class TorchPrograms(TorchTranslator):
    """The program layer, on the primitives of the core's SPMD engine."""

    def program_entry(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as one opaque call to dynamo (:func:`.compiled.program_entry`)."""
        return compiled.program_entry(fn)

    def compile(self, fn: Any, options: dict[str, Any]) -> Any:
        """``torch.compile(fn, **options)`` (:func:`.compiled.compile_step`)."""
        return compiled.compile_step(fn, options)

    def stop_gradient(self, x: Any) -> Any:
        return x.detach()

    def process_index(self) -> int:
        return int(import_dist().get_rank())

    def world_group(self) -> TorchGroup:
        return TorchGroup(import_dist().group.WORLD, tuple(range(import_dist().get_world_size())))

    def group_cache_key(self) -> Any:
        return import_dist().group.WORLD

    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        """The DeviceMesh's own group along ``axes`` (``get_group``; for several axes the
        group of the dims flattened with ``_flatten``), so torch makes and names it as for
        any DeviceMesh. Made for real when torch.compile traces the first call (a new process
        group is a collective of its own, which neither dynamo nor aot_autograd can trace):
        outside dynamo's frame and outside the fake and functional tensor modes."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            made: Any = import_torch().compiler.disable(self._split_group)(mesh, axes, rows, row)
        return made

    def _split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        device_mesh = self.mesh_to_native(mesh)
        ordered = tuple(sorted(axes, key=mesh.axis_names.index))
        if len(ordered) == 1:
            pg = device_mesh.get_group(ordered[0])
        else:
            pg = device_mesh[ordered]._flatten("unimesh_" + "_".join(ordered)).get_group()
        return TorchGroup(pg, tuple(int(m) for m in rows[row]))

    def vma_mode(self, env: Any) -> Any:
        """A ``TorchFunctionMode`` that tags every result with the union of its arguments'
        axes of variation and passes a gradient-carrying argument that lacks some of them
        through ``env.pvary`` (JAX inserts the same pvary). None while dynamo traces the
        program's Python (dynamo does not keep the tags the mode sets), but a mode where
        aot_autograd traces it (``program_entry``): there it runs as Python, as in eager."""
        if not compiled.in_twin() and import_torch().compiler.is_compiling():
            return None
        return vma_mode()(env)

    def unwatched(self, fn: Any, x: Any) -> Any:
        with hot()[1]():
            return fn(x)

    def custom_vjp(self, fwd: Any, bwd: Any) -> Any:
        function = vjp_function()
        return lambda x: function.apply(x, fwd, bwd)

    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]:
        """A DTensor's local tensor (moved to ``layout`` first when it is laid out otherwise:
        by ``unimesh.reshard``, or under torch.compile by ``DTensor.redistribute``), or a
        global tensor (numpy and lists become tensors) for the engine to cut."""
        torch = import_torch()
        from torch.distributed.tensor import DTensor

        if isinstance(arg, DTensor):
            native = self._native_layout(layout)
            if (
                real_mesh(arg.device_mesh) is native.device_mesh
                and tuple(arg.placements) == native.placements
            ):  # the usual case, no conversions
                leaf = getattr(arg, LEAF, None)
                if leaf is not None:  # a parameter value_and_grad differentiates
                    return leaf, False
                if arg.requires_grad and torch.is_grad_enabled():
                    return arg.to_local(), False
                local = arg._local_tensor  # what to_local() gives without autograd, as a new
                return local.view_as(local), False  # object (the engine tags it)
            have = self.from_native(arg)
            if have == layout:
                return arg.to_local(), False
            if not torch.compiler.is_compiling():  # unimesh.reshard: only the missing pieces,
                # from any mesh, right where redistribute is not (uneven blocks), differentiable
                import unimesh

                return unimesh.reshard(arg, layout).to_local(), False
            if have.mesh != layout.mesh:
                raise ConversionError(
                    f"a shard_map argument is a DTensor on {have.mesh!r}, not on the "
                    f"shard_map's {layout.mesh!r}, and under torch.compile only "
                    "DTensor.redistribute (one mesh) can move it: unimesh.reshard it to the "
                    "program's layout before the compiled function"
                )
            arg = arg.redistribute(native.device_mesh, list(native.placements))
            return arg.to_local(), False
        device = self._native_layout(layout).device_mesh.device_type  # "cuda" under NCCL
        if not torch.is_tensor(arg):
            arg = torch.as_tensor(np.asarray(arg), device=device)
        elif arg.device.type != device:
            arg = arg.to(device)
        return arg, True

    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any:
        """A DTensor of the layout's placements and the global shape: what
        ``DTensor.from_local(block, ..., run_check=False, shape=..., stride=...)`` makes, with
        its spec built once per (layout, shape, dtype) instead of per call."""
        torch = import_torch()

        native = self._native_layout(layout)  # a new world empties the spec cache too
        if torch.compiler.is_compiling():  # what dynamo traces (a cached spec is guarded by id)
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                block,
                native.device_mesh,
                native.placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=global_stride(block, shape, native.device_mesh, native.placements),
            )
        key: tuple[Any, ...] = (layout, shape, block.dtype)
        if not block.is_contiguous():
            key += (block.stride(),)
        spec = self._specs.get(key)
        if spec is None:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

            stride = global_stride(block, shape, native.device_mesh, native.placements)
            spec = self._specs[key] = DTensorSpec(
                native.device_mesh,
                tuple(native.placements),
                tensor_meta=TensorMeta(torch.Size(shape), stride, block.dtype),
            )
        if block.requires_grad and torch.is_grad_enabled():
            out = from_local_function().apply(block, spec)
        else:
            out = dtensor(block.view_as(block), spec, requires_grad=False)
        setattr(out, BLOCK, block)
        return out

    def _native_layout(self, layout: Layout) -> TorchLayout:
        cache: dict[Layout, TorchLayout] = self._native_layouts
        if self._world_group is not import_dist().group.WORLD:  # a new world: rebuild everything
            cache.clear()
            self._specs.clear()
        native = cache.get(layout)
        if native is None:  # layout_to_native records the world it was built in
            native = cache[layout] = self.layout_to_native(layout)
        return native

    def prepare_program(self, mesh: Mesh, layouts: tuple[Layout, ...]) -> None:
        """The DeviceMesh and placements of every in/out layout, built by every rank together
        before the first run (DTensor needs them; building one is collective)."""
        for layout in layouts:
            self._check_order(layout)
        for layout in layouts:
            self._native_layout(layout)

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Any:
        """torch autograd (:func:`.grad.value_and_grad`)."""
        return grad.value_and_grad(fn, argnums, has_aux)

    def full_array(self, array: Any) -> Any:
        """numpy of a DTensor's whole value (``full_tensor()``, a collective) or of a tensor."""
        from torch.distributed.tensor import DTensor

        if isinstance(array, DTensor):
            array = array.full_tensor()
        return to_host(array.detach().cpu())  # bfloat16 and float8 as ml_dtypes

    def param_paths(self, model: Any) -> list[tuple[str, tuple[int, ...]]]:
        """``named_parameters``' names and shapes."""
        _module(import_torch(), model)
        return [(path, tuple(p.shape)) for path, p in model.named_parameters()]

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """Every parameter of an ``nn.Module`` becomes a DTensor parameter laid out as
        ``resolve(name, shape)`` says (names from ``named_parameters``; tied parameters stay
        tied). In place; returns the module."""
        torch = import_torch()
        _module(torch, model)
        new: dict[int, Any] = {}
        for path, param in model.named_parameters():
            layout = resolve(path, tuple(param.shape))
            placed = self.distribute(param.detach(), layout)
            new[id(param)] = torch.nn.Parameter(placed, requires_grad=param.requires_grad)
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) in new:
                    module.register_parameter(name, new[id(param)])
        return model

    def model_state(self, model: Any) -> dict[str, Any] | None:
        """An ``nn.Module``'s state_dict: DTensors as they are (FSDP2 and TP layouts), plain
        tensors as numpy."""
        torch = import_torch()
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
        torch = import_torch()
        from torch.distributed.tensor import DTensor

        from .translate import from_host

        live = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in values.items():
                into = live[name]
                if isinstance(into, DTensor):
                    into.to_local().copy_(value.to_local())
                else:
                    into.copy_(from_host(value))


def _module(torch: Any, model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ConversionError(
            f"the torch backend shards the parameters of an nn.Module, not {short(model)}"
        )


class TorchGroup(ProcessGroup):
    """A process group with its members in the neutral order, and the collectives on it.
    torch has its own order of a group's ranks (by global rank), so ``order`` / ``inverse``
    re-index the pieces when the two differ."""

    __slots__ = ("inverse", "members", "order", "peers", "pg", "rank", "ranks", "size")

    def __init__(self, pg: Any, members: tuple[int, ...]) -> None:
        self.pg = pg
        self.members = members
        self.size = len(members)
        self.ranks = tuple(int(r) for r in import_dist().get_process_group_ranks(pg))
        if sorted(self.ranks) != sorted(members):  # pragma: no cover - a torch change
            raise MeshMismatchError(
                f"torch's group has ranks {self.ranks}, unimesh expects {members}"
            )
        self.rank = int(import_dist().get_rank())
        self.peers: dict[tuple[int | None, ...], tuple[bool, int | None, int | None]] = {}
        if self.ranks == members:
            self.order: list[int] | None = None
            self.inverse: list[int] | None = None
        else:  # piece k in torch's order is member ranks[k]
            self.order = [self.ranks.index(m) for m in members]
            self.inverse = [members.index(r) for r in self.ranks]

    def all_reduce(self, x: Any, op: str) -> Any:
        if compiling():
            return funcol().all_reduce(x.detach(), op, self.pg)
        dist = import_dist()
        out = x.detach().clone(memory_format=import_torch().contiguous_format)
        dist.all_reduce(out, op=OPS[op](), group=self.pg)
        return out

    def all_gather(self, x: Any) -> Any:
        torch = import_torch()
        flat = x.detach().contiguous().reshape(-1)  # gloo gathers into one flat buffer
        if compiling():
            out = funcol().all_gather_tensor(flat, 0, self.pg).reshape((self.size, *x.shape))
            return out if self.order is None else out[self.order]
        out = torch.empty(self.size * flat.numel(), dtype=x.dtype, device=x.device)
        dist = import_dist()  # all_gather_into_tensor is deprecated from torch 2.13 on
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, flat, group=self.pg)
        out = out.reshape((self.size,) + tuple(x.shape))
        return out if self.order is None else out[self.order]

    def reduce_scatter(self, x: Any) -> Any:
        torch = import_torch()
        x = x.detach()
        if self.inverse is not None:
            x = x[self.inverse]
        flat = x.contiguous().reshape(-1)
        if compiling():
            return funcol().reduce_scatter_tensor(flat, "sum", 0, self.pg).reshape(x.shape[1:])
        out = torch.empty(flat.numel() // self.size, dtype=x.dtype, device=x.device)
        dist = import_dist()  # reduce_scatter_tensor is deprecated from torch 2.13 on
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, flat, group=self.pg)
        return out.reshape(tuple(x.shape[1:]))

    def all_to_all(self, x: Any) -> Any:
        torch = import_torch()
        x = x.detach()
        if self.inverse is not None:
            x = x[self.inverse]
        x = x.contiguous()
        if compiling():
            out = funcol().all_to_all_single(x, None, None, self.pg)
            return out if self.order is None else out[self.order]
        out = torch.empty_like(x)
        import_dist().all_to_all_single(out, x, group=self.pg)
        return out if self.order is None else out[self.order]

    def permute(self, x: Any, sources: tuple[int | None, ...]) -> Any:
        """Point to point: ``x`` sent to the member that takes it, the source's received
        (``batch_isend_irecv``; only the pairs of the permutation talk). While torch.compile
        traces, ``funcol.permute_tensor`` instead, which dynamo compiles (torch does not
        compile point-to-point ops)."""
        torch = import_torch()
        if compiling():
            return traced_permute(x, self, sources)
        dist = import_dist()
        peers = self.peers.get(sources)
        if peers is None:  # (whether it keeps its own, the rank it sends to, receives from)
            me = self.members.index(self.rank)
            dest = next((i for i, s in enumerate(sources) if s == me), None)
            src = sources[me]
            peers = self.peers[sources] = (
                src == me,
                None if dest is None else self.members[dest],
                None if src is None else self.members[src],
            )
        keep, to, source = peers
        if keep:
            return x.detach().clone()
        ops = []
        if to is not None:
            ops.append(dist.P2POp(dist.isend, x.detach().contiguous(), to, self.pg))
        if source is None:
            out = torch.zeros_like(x)
        else:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            ops.append(dist.P2POp(dist.irecv, out, source, self.pg))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        return out

    def broadcast(self, x: Any, root: int) -> Any:
        if compiling():
            return funcol().broadcast(x.detach().contiguous(), self.members[root], self.pg)
        out = x.detach().clone(memory_format=import_torch().contiguous_format)
        import_dist().broadcast(out, src=self.members[root], group=self.pg)
        return out
