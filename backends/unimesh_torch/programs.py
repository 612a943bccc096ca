"""The torch backend's program layer: the core's per-process engine on gloo/NCCL process
groups (DeviceMesh groups), DTensors in and out, JAX's check_vma gradient rules through a
``TorchFunctionMode``, ``value_and_grad`` with torch autograd, and ``shard_params``."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from unimesh import ConversionError, Layout, Mesh, MeshMismatchError, UnimeshError
from unimesh.messages import short

from .runtime import _dist, _torch
from .translate import TorchLayout, TorchTranslator, global_stride, to_host


class TorchPrograms(TorchTranslator):
    """The program layer, on the primitives of the core's SPMD engine."""

    def program_entry(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as one opaque call to dynamo: inside ``torch.compile`` it runs through its
        ``torch._dynamo.nonstrict_trace`` twin, whose Python (pytree flattening, the engine,
        autograd) dynamo does not trace; aot_autograd traces the tensor operations and the
        functional collectives it calls, so a unimesh step compiles with ``fullgraph=True``.
        Importing dynamo costs a second or more, so the twin is made once dynamo is loaded:
        at once if it is, else when ``torch._dynamo`` is imported (``_DynamoWatch``), by
        :func:`unimesh.compile` or at the first eager call after dynamo loads. Arguments
        nonstrict_trace refuses (a namedtuple) run the program eagerly (a graph break)."""
        compiling = _torch().compiler.is_compiling
        twin: list[Callable[..., Any]] = []

        def mark() -> None:
            if not twin:
                from torch._dynamo import nonstrict_trace

                def traced(*args: Any) -> Any:
                    _INSIDE[0] += 1  # traced by aot_autograd: the check_vma tags hold
                    try:
                        return fn(*args)
                    except UnimeshError as exc:  # dynamo reports it as its own Unsupported
                        REFUSED[:] = [exc]
                        raise
                    finally:
                        _INSIDE[0] -= 1

                traced.__name__ = getattr(fn, "__name__", "traced")
                twin.append(nonstrict_trace(traced))
                # arguments nonstrict_trace does not take: run eagerly, a clean graph break
                # (dynamo tracing the program's own Python fails and then skips its code)
                twin.append(_torch().compiler.disable(fn))

        def run(*args: Any) -> Any:
            if twin and compiling():
                return twin[0](*args) if _plain(args, 0) else twin[1](*args)
            if not twin and "torch._dynamo" in sys.modules and not compiling():
                mark()
            return fn(*args)

        run.__name__ = getattr(fn, "__name__", "run")
        run.__doc__ = getattr(fn, "__doc__", None)
        if "torch._dynamo" in sys.modules:
            mark()
        else:
            _unmarked(mark)
        return run

    def process_index(self) -> int:
        return int(_dist().get_rank())

    def world_group(self) -> Any:
        return _TorchGroup(_dist().group.WORLD, tuple(range(_dist().get_world_size())))

    def group_cache_key(self) -> Any:
        return _dist().group.WORLD

    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        """The DeviceMesh's own group along ``axes`` (``get_group``; for several axes the
        group of the dims flattened with ``_flatten``), so torch makes and names it as for
        any DeviceMesh. Made for real when torch.compile traces the first call (a new process
        group is a collective of its own, which neither dynamo nor aot_autograd can trace):
        outside dynamo's frame and outside the fake and functional tensor modes."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            made: Any = _torch().compiler.disable(self._split_group)(mesh, axes, rows, row)
        return made

    def _split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        device_mesh = self.mesh_to_native(mesh)
        ordered = tuple(sorted(axes, key=mesh.axis_names.index))
        if len(ordered) == 1:
            pg = device_mesh.get_group(ordered[0])
        else:
            pg = device_mesh[ordered]._flatten("unimesh_" + "_".join(ordered)).get_group()
        return _TorchGroup(pg, tuple(int(m) for m in rows[row]))

    def group_all_reduce(self, x: Any, group: Any, op: str) -> Any:
        if _compiling():
            return _funcol().all_reduce(x.detach(), op, group.pg)
        dist = _dist()
        out = x.detach().clone(memory_format=_torch().contiguous_format)
        dist.all_reduce(out, op=_OPS[op](), group=group.pg)
        return out

    def group_all_gather(self, x: Any, group: Any) -> Any:
        torch = _torch()
        flat = x.detach().contiguous().reshape(-1)  # gloo gathers into one flat buffer
        if _compiling():
            out = _funcol().all_gather_tensor(flat, 0, group.pg).reshape((group.size, *x.shape))
            return out if group.order is None else out[group.order]
        out = torch.empty(group.size * flat.numel(), dtype=x.dtype, device=x.device)
        dist = _dist()  # all_gather_into_tensor is deprecated from torch 2.13 on
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, flat, group=group.pg)
        out = out.reshape((group.size,) + tuple(x.shape))
        return out if group.order is None else out[group.order]

    def group_reduce_scatter(self, x: Any, group: Any) -> Any:
        torch = _torch()
        x = x.detach()
        if group.inverse is not None:
            x = x[group.inverse]
        flat = x.contiguous().reshape(-1)
        if _compiling():
            return _funcol().reduce_scatter_tensor(flat, "sum", 0, group.pg).reshape(x.shape[1:])
        out = torch.empty(flat.numel() // group.size, dtype=x.dtype, device=x.device)
        dist = _dist()  # reduce_scatter_tensor is deprecated from torch 2.13 on
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(
            out, flat, group=group.pg
        )
        return out.reshape(tuple(x.shape[1:]))

    def group_all_to_all(self, x: Any, group: Any) -> Any:
        torch = _torch()
        x = x.detach()
        if group.inverse is not None:
            x = x[group.inverse]
        x = x.contiguous()
        if _compiling():
            out = _funcol().all_to_all_single(x, None, None, group.pg)
            return out if group.order is None else out[group.order]
        out = torch.empty_like(x)
        _dist().all_to_all_single(out, x, group=group.pg)
        return out if group.order is None else out[group.order]

    def group_permute(self, x: Any, group: Any, sources: tuple[int | None, ...]) -> Any:
        """Point to point: ``x`` sent to the member that takes it, the source's received
        (``batch_isend_irecv``; only the pairs of the permutation talk). While torch.compile
        traces, ``funcol.permute_tensor`` instead, which dynamo compiles (torch does not
        compile point-to-point ops)."""
        torch = _torch()
        if _compiling():
            return _traced_permute(x, group, sources)
        dist = _dist()
        peers = group.peers.get(sources)
        if peers is None:  # (whether it keeps its own, the rank it sends to, receives from)
            me = group.members.index(group.rank)
            dest = next((i for i, s in enumerate(sources) if s == me), None)
            src = sources[me]
            peers = group.peers[sources] = (
                src == me,
                None if dest is None else group.members[dest],
                None if src is None else group.members[src],
            )
        keep, to, source = peers
        if keep:
            return x.detach().clone()
        ops = []
        if to is not None:
            ops.append(dist.P2POp(dist.isend, x.detach().contiguous(), to, group.pg))
        if source is None:
            out = torch.zeros_like(x)
        else:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            ops.append(dist.P2POp(dist.irecv, out, source, group.pg))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        return out

    def group_broadcast(self, x: Any, group: Any, root: int) -> Any:
        if _compiling():
            return _funcol().broadcast(x.detach().contiguous(), group.members[root], group.pg)
        out = x.detach().clone(memory_format=_torch().contiguous_format)
        _dist().broadcast(out, src=group.members[root], group=group.pg)
        return out

    def as_array(self, value: Any) -> Any:
        torch = _torch()
        if isinstance(value, torch.Tensor):
            return value
        # numbers go where the collectives run: the GPU under NCCL
        device = self._device_type(None) if _dist().is_initialized() else None
        return torch.as_tensor(value, device=device)

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        return _torch().movedim(x, source, destination)

    def take(self, x: Any, index: list[int]) -> Any:
        return x[index]

    def reduce_stack(self, x: Any, op: str) -> Any:
        """``op`` over dim 0 in ``x``'s dtype (``sum`` widens integers to int64)."""
        if op != "sum":
            return x.amax(0) if op == "max" else x.amin(0)
        return x.sum(0, dtype=x.dtype)

    def zeros_like(self, x: Any) -> Any:
        return _torch().zeros_like(x)

    def to_host(self, x: Any) -> np.ndarray:
        return x.detach().cpu().numpy()  # type: ignore[no-any-return]

    def needs_grad(self, x: Any) -> bool:
        return bool(x.requires_grad) and _torch().is_grad_enabled()

    def vma_mode(self, env: Any) -> Any:
        """A ``TorchFunctionMode`` that tags every result with the union of its arguments'
        axes of variation and passes a gradient-carrying argument that lacks some of them
        through ``env.pvary`` (JAX inserts the same pvary)."""
        return _vma_mode()(env)

    def vma_watched(self) -> bool:
        """Not while dynamo traces the program's Python (dynamo does not keep the tags the
        mode sets), but yes where aot_autograd traces it (``program_entry``): there it runs
        as Python, as in eager."""
        return _INSIDE[0] > 0 or not _torch().compiler.is_compiling()

    def vma_of(self, x: Any) -> frozenset[str]:
        return getattr(x, _VMA, _NONE)

    def tag(self, x: Any, vma: frozenset[str]) -> Any:
        setattr(x, _VMA, vma)
        return x

    def unwatched(self, fn: Any, x: Any, vma: frozenset[str] | None = None) -> Any:
        with _torch()._C.DisableTorchFunction():
            out = fn(x)
        return out if vma is None else self.tag(out, vma)

    def custom_vjp(self, fwd: Any, bwd: Any) -> Any:
        function = _vjp_function()
        return lambda x: function.apply(x, fwd, bwd)

    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]:
        """A DTensor's local tensor (moved to ``layout`` first when it is laid out otherwise:
        by ``unimesh.reshard``, or under torch.compile by ``DTensor.redistribute``), or a
        global tensor (numpy and lists become tensors) for the engine to cut."""
        torch = _torch()
        from torch.distributed.tensor import DTensor

        if isinstance(arg, DTensor):
            native = self._native_layout(layout)
            if (
                _real(arg.device_mesh) is native.device_mesh
                and tuple(arg.placements) == native.placements
            ):  # the usual case, no conversions
                leaf = getattr(arg, _LEAF, None)
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
        torch = _torch()

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
            out = _from_local_function().apply(block, spec)
        else:
            out = _dtensor(block.view_as(block), spec, requires_grad=False)
        setattr(out, _BLOCK, block)
        return out

    def _native_layout(self, layout: Layout) -> TorchLayout:
        cache: dict[Layout, TorchLayout] = self._native_layouts
        if self._world_group is not _dist().group.WORLD:  # a new world: rebuild everything
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
        """torch autograd: the differentiated leaves are detached copies that require grad;
        ``torch.autograd.grad`` of the scalar value gives their gradients (DTensors for DTensor
        arguments).

        A DTensor leaf also carries a plain tensor leaf for its local block, which shard_map
        takes as the block (no ``to_local``/``from_local`` round trip through autograd); its
        gradient is added to whatever reaches the DTensor itself through DTensor operations.
        """
        import optree

        torch = _torch()
        from torch.distributed.tensor import DTensor

        def fresh_leaf(leaf: Any) -> tuple[Any, Any]:
            """(the copy the function gets, its block leaf or None)."""
            if isinstance(leaf, DTensor):
                local = leaf._local_tensor.detach()
                copy = _dtensor(local, leaf._spec, requires_grad=True)
                block = local.view_as(local).requires_grad_(True)
                setattr(copy, _LEAF, block)
                return copy, block
            return leaf.detach().requires_grad_(True), None

        def run(*given: Any) -> Any:
            args = list(given)
            leaves: list[Any] = []
            trees = []
            for i in argnums:
                flat, treedef = optree.tree_flatten(args[i])
                fresh = [
                    fresh_leaf(leaf)
                    if torch.is_tensor(leaf) and (leaf.is_floating_point() or leaf.is_complex())
                    else (leaf, False)
                    for leaf in flat
                ]
                trees.append((treedef, fresh))
                for copy, block in fresh:
                    if block is not False:
                        leaves += [copy] if block is None else [copy, block]
                args[i] = optree.tree_unflatten(treedef, [copy for copy, _ in fresh])
            with torch.enable_grad():
                out = fn(*args)
                value, aux = out if has_aux else (out, None)
                scalar = value
                if isinstance(value, DTensor):
                    if any(not p.is_replicate() for p in value.placements):
                        scalar = value.full_tensor()
                    else:  # a shard_map result: its block, else the local tensor
                        scalar = getattr(value, _BLOCK, None)
                        scalar = value.to_local() if scalar is None else scalar
                if not torch.is_tensor(scalar) or scalar.numel() != 1:
                    raise ConversionError(
                        f"value_and_grad needs {getattr(fn, '__name__', 'fn')} to return a "
                        f"scalar, got {short(value)}"
                    )
                found = torch.autograd.grad(scalar.reshape(()), leaves, allow_unused=True)
            # the gradients in the order their leaves were listed: a copy, then its block where
            # it has one (positions, not ids: ids are guards torch.compile cannot keep)
            taken: Iterator[Any] = iter(found)
            per_tree: list[Any] = []
            for treedef, fresh in trees:
                out_leaves: list[Any] = []
                for copy, block in fresh:
                    if block is False:
                        out_leaves.append(None)
                        continue
                    whole = next(taken)
                    local = None if block is None else next(taken)
                    if local is not None:
                        if local.dtype != copy.dtype:  # pragma: no cover - autograd keeps dtypes
                            local = local.to(copy.dtype)
                        part = _dtensor(local, copy._spec, requires_grad=False)
                        whole = part if whole is None else whole + part
                    out_leaves.append(torch.zeros_like(copy) if whole is None else whole)
                per_tree.append(optree.tree_unflatten(treedef, out_leaves))
            grads = tuple(per_tree)
            value = value.detach()
            return ((value, aux) if has_aux else value), grads

        return run

    def full_array(self, array: Any) -> Any:
        """numpy of a DTensor's whole value (``full_tensor()``, a collective) or of a tensor."""
        from torch.distributed.tensor import DTensor

        if isinstance(array, DTensor):
            array = array.full_tensor()
        return to_host(array.detach().cpu())  # bfloat16 and float8 as ml_dtypes

    def param_paths(self, model: Any) -> list[tuple[str, tuple[int, ...]]]:
        """``named_parameters``' names and shapes."""
        _module(_torch(), model)
        return [(path, tuple(p.shape)) for path, p in model.named_parameters()]

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """Every parameter of an ``nn.Module`` becomes a DTensor parameter laid out as
        ``resolve(name, shape)`` says (names from ``named_parameters``; tied parameters stay
        tied). In place; returns the module."""
        torch = _torch()
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


def _module(torch: Any, model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ConversionError(
            f"the torch backend shards the parameters of an nn.Module, not {short(model)}"
        )


def _traced_permute(x: Any, group: Any, sources: tuple[int | None, ...]) -> Any:
    """``group_permute`` as ``funcol.permute_tensor``, which takes a whole permutation (each
    rank sends to one and receives from one, in the group's ranks): a member that sends
    nothing is paired with one that receives nothing, and what that one gets is zeros."""
    funcol = _funcol()
    n = group.size
    dest: list[int | None] = [None] * n
    for i, s in enumerate(sources):
        if s is not None:
            dest[s] = i
    idle = iter([i for i, s in enumerate(sources) if s is None])
    rank_of = group.ranks.index  # a member's rank within the process group
    src_dst = [0] * n
    for i, d in enumerate(dest):
        src_dst[rank_of(group.members[i])] = rank_of(group.members[next(idle) if d is None else d])
    # its split sizes are numel() along dim 0, so it permutes flat tensors: flattened here
    flat = funcol.permute_tensor(x.detach().contiguous().reshape(-1), src_dst, group.pg)
    out = flat.reshape(x.shape)
    if sources[group.members.index(group.rank)] is None:
        return _torch().zeros_like(out)
    return out


class _TorchGroup:
    """A process group with its members in the neutral order. torch has its own order of a
    group's ranks (by global rank), so ``order`` / ``inverse`` re-index the pieces when the
    two differ."""

    __slots__ = ("inverse", "members", "order", "peers", "pg", "rank", "ranks", "size")

    def __init__(self, pg: Any, members: tuple[int, ...]) -> None:
        self.pg = pg
        self.members = members
        self.size = len(members)
        self.ranks = tuple(int(r) for r in _dist().get_process_group_ranks(pg))
        if sorted(self.ranks) != sorted(members):  # pragma: no cover - a torch change
            raise MeshMismatchError(
                f"torch's group has ranks {self.ranks}, unimesh expects {members}"
            )
        self.rank = int(_dist().get_rank())
        self.peers: dict[tuple[int | None, ...], tuple[bool, int | None, int | None]] = {}
        if self.ranks == members:
            self.order: list[int] | None = None
            self.inverse: list[int] | None = None
        else:  # piece k in torch's order is member ranks[k]
            self.order = [self.ranks.index(m) for m in members]
            self.inverse = [members.index(r) for r in self.ranks]


_VMA = "_unimesh_vma"
_LEAF = "_unimesh_leaf"  # on a DTensor value_and_grad made: the plain leaf of its local block
_BLOCK = "_unimesh_block"  # on a shard_map result: the block it was made from
_NONE: frozenset[str] = frozenset()
_MODE: list[Any] = []


def _vma_mode() -> Any:
    """The TorchFunctionMode class of :meth:`TorchBackend.vma_mode` (made once, on first use)."""
    if _MODE:
        return _MODE[0]
    torch = _torch()
    from torch.overrides import TorchFunctionMode

    tensor = torch.Tensor
    grad_enabled = torch.is_grad_enabled

    def scan(values: Any, acc: list[Any]) -> None:
        """Into ``acc`` = [union of the tensors' axes, the first tensor's axes, whether two
        tensors differ, whether one needs a gradient], for tensors in lists/tuples too."""
        for v in values:
            if isinstance(v, tensor):
                have = getattr(v, _VMA, _NONE)
                if acc[1] is None:
                    acc[1] = have
                elif have != acc[1]:
                    acc[2] = True
                if have:
                    acc[0] = acc[0] | have
                if v.requires_grad:
                    acc[3] = True
            elif isinstance(v, (list, tuple)):
                scan(v, acc)

    class VmaMode(TorchFunctionMode):
        def __init__(self, env: Any) -> None:
            super().__init__()
            self.env = env

        def lift(self, v: Any, vma: frozenset[str]) -> Any:
            """``v`` (or the tensors in a list/tuple) made varying along all of ``vma``."""
            if isinstance(v, tensor):
                have = getattr(v, _VMA, _NONE)
                if have != vma and v.requires_grad:
                    return self.env.pvary(v, vma - have)
                return v
            if isinstance(v, (list, tuple)):
                return type(v)(self.lift(u, vma) for u in v)
            return v

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            # the common case (tensors and scalars as positional arguments): scan's work
            # inline, as a call and an accumulator per torch operation cost measurably
            vma = first = _NONE
            tensors = differ = grad = False
            for v in args:
                if isinstance(v, tensor):
                    have = getattr(v, _VMA, _NONE)
                    if not tensors:
                        tensors, first = True, have
                    elif have is not first and have != first:
                        differ = True
                    if have and have is not vma:
                        vma = have if not vma else vma | have
                    if v.requires_grad:
                        grad = True
                elif isinstance(v, (list, tuple)):
                    break
            else:
                if not kwargs:
                    if not vma:
                        return func(*args)
                    if differ and grad and grad_enabled():  # a pvary is needed somewhere
                        args = tuple(self.lift(a, vma) for a in args)
                    return tag_all(func(*args), vma)
            acc: list[Any] = [_NONE, None, False, False]
            scan(args, acc)
            if kwargs:
                scan(kwargs.values(), acc)
            else:
                kwargs = {}
            vma = acc[0]
            if not vma:
                return func(*args, **kwargs)
            if acc[2] and acc[3] and grad_enabled():  # a pvary is needed somewhere
                args = tuple(self.lift(a, vma) for a in args)
                kwargs = {k: self.lift(v, vma) for k, v in kwargs.items()}
            return tag_all(func(*args, **kwargs), vma)

    def tag_all(out: Any, vma: frozenset[str]) -> Any:
        """``out`` (a tensor, or tensors in a list/tuple) tagged with ``vma``."""
        if isinstance(out, tensor):
            setattr(out, _VMA, vma)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, tensor):
                    setattr(o, _VMA, vma)
        return out

    _MODE.append(VmaMode)
    return VmaMode


_OPS = {
    "sum": lambda: _dist().ReduceOp.SUM,
    "max": lambda: _dist().ReduceOp.MAX,
    "min": lambda: _dist().ReduceOp.MIN,
}
_VJP: list[Any] = []


def _vjp_function() -> Any:
    """One ``torch.autograd.Function`` running a forward and a backward given per call."""
    if not _VJP:
        torch = _torch()

        class Vjp(torch.autograd.Function):  # type: ignore[name-defined,misc]
            @staticmethod
            def forward(ctx: Any, x: Any, fwd: Any, bwd: Any) -> Any:
                ctx.bwd = bwd
                y = fwd(x)
                return y.view_as(y) if y is x else y

            @staticmethod
            def backward(ctx: Any, ct: Any) -> Any:
                return ctx.bwd(ct), None, None

        _VJP.append(Vjp)
    return _VJP[0]


_FROM_LOCAL: list[Any] = []


def _dtensor(local: Any, spec: Any, requires_grad: bool) -> Any:
    """The DTensor of ``local`` with a spec built in advance: the constructor
    ``DTensor.from_local`` ends in, without building the spec on every call."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=requires_grad)  # type: ignore[no-untyped-call]


def _from_local_function() -> Any:
    """``DTensor.from_local``'s autograd function for a spec built in advance: the gradient
    of the block is the cotangent's local tensor, laid out as the result (a Partial result's
    cotangent is made Replicate, as ``from_local`` does)."""
    if not _FROM_LOCAL:
        torch = _torch()
        from torch.distributed.tensor import DTensor, Replicate

        class FromLocal(torch.autograd.Function):  # type: ignore[name-defined,misc]
            @staticmethod
            def forward(ctx: Any, block: Any, spec: Any) -> Any:
                ctx.spec = spec
                ctx.set_materialize_grads(False)
                return _dtensor(block.view_as(block), spec, requires_grad=block.requires_grad)

            @staticmethod
            def backward(ctx: Any, ct: Any) -> Any:
                if isinstance(ct, DTensor):
                    want = tuple(Replicate() if p.is_partial() else p for p in ctx.spec.placements)
                    if tuple(ct.placements) != want:
                        ct = ct.redistribute(ctx.spec.mesh, want)
                    ct = ct.to_local()
                return ct, None

        _FROM_LOCAL.append(FromLocal)
    return _FROM_LOCAL[0]


#: the UnimeshError a program's twin raised while torch.compile traced it (see ``surfacing``)
REFUSED: list[BaseException] = []
#: how many programs' twins are running (traced by aot_autograd, not by dynamo)
_INSIDE = [0]
#: the ``mark`` of every program made before dynamo was loaded (``TorchPrograms.program_entry``)
_UNMARKED: list[weakref.ref[Callable[[], None]]] = []


def surfacing(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (a torch.compile'd function) raising the UnimeshError a program refused
    with while dynamo traced it, instead of dynamo's report of that error (which names
    neither the value nor the fix)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        REFUSED.clear()
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:
            if REFUSED and not isinstance(exc, UnimeshError):
                raise REFUSED.pop() from exc
            raise

    call.__name__ = getattr(compiled, "__name__", "compiled")
    call.__wrapped__ = compiled  # type: ignore[attr-defined]
    return call


def mark_entries() -> None:
    """Give every program made so far its nonstrict_trace twin (dynamo is loaded now)."""
    while _UNMARKED:
        mark = _UNMARKED.pop()()
        if mark is not None:
            mark()


def _unmarked(mark: Callable[[], None]) -> None:
    """Keep ``mark`` until dynamo loads. The first time, watch for ``import torch._dynamo``
    (``torch.compile`` imports it on its first call), so that a program made before it gets
    its twin before dynamo traces it, whoever calls ``torch.compile``; dead references are
    dropped as the list grows."""
    if not _UNMARKED and not any(isinstance(f, _DynamoWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoWatch())
    if len(_UNMARKED) >= 64 and len(_UNMARKED) & (len(_UNMARKED) - 1) == 0:
        _UNMARKED[:] = [ref for ref in _UNMARKED if ref() is not None]
    _UNMARKED.append(weakref.ref(mark))


class _DynamoWatch:
    """A finder on ``sys.meta_path`` that finds nothing itself: when ``torch._dynamo`` is
    imported it takes itself off the path, has the import system find the module as before,
    and runs :func:`mark_entries` once the module has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class Marking(importlib.abc.Loader):
            def __getattr__(self, attr: str) -> Any:  # get_source and the rest: the loader's
                return getattr(loader, attr)

            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                try:
                    mark_entries()
                except Exception as exc:  # noqa: BLE001 - never break the import of dynamo
                    import warnings

                    warnings.warn(
                        f"unimesh could not prepare its programs for torch.compile ({exc!r}); "
                        "programs made before torch._dynamo was imported are traced by "
                        "dynamo (with graph breaks). Call unimesh.compile, or import "
                        "torch._dynamo before making them",
                        RuntimeWarning,
                        stacklevel=2,
                    )

        spec.loader = Marking()
        return spec


def _plain(x: Any, depth: int) -> bool:
    """Whether ``x`` is what a nonstrict_trace function takes: tensors, None, numbers and
    strings in dicts, lists and tuples (not namedtuples or other classes)."""
    if isinstance(x, (_torch().Tensor, int, float, bool, str)) or x is None:
        return True
    if depth > 50:
        return False
    if type(x) in (tuple, list):
        return all(_plain(v, depth + 1) for v in x)
    if type(x) is dict:
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in x.items())
    return False


def _compiling() -> bool:
    """Whether dynamo or aot_autograd traces this call: collectives are then torch's
    functional collectives (graph nodes naming their group by a string), not the c10d
    ones, which write in place into a tensor and carry the ProcessGroup object."""
    return bool(_torch().compiler.is_compiling())


def _funcol() -> Any:
    from torch.distributed import _functional_collectives

    return _functional_collectives


def _real(device_mesh: Any) -> Any:
    """The DeviceMesh itself: while aot_autograd traces, a DTensor's mesh is a
    ``FakeScriptObject`` around it (DeviceMesh is an opaque type, so not a copy)."""
    if not _INSIDE[0]:  # eager, or dynamo tracing (which fakes the mesh its own way)
        return device_mesh
    from torch._library.fake_class_registry import FakeScriptObject

    return device_mesh.real_obj if isinstance(device_mesh, FakeScriptObject) else device_mesh
