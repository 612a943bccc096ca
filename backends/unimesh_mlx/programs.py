"""The MLX backend's program layer: the core's per-process engine on MLX groups (lazy
collectives chained in program order), ``value_and_grad`` with ``mx.value_and_grad``,
``shard_params`` and ``shard_linear`` for ``mlx.nn`` models."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from unimesh import ConversionError, Layout, LayoutError, Mesh, PartitionSpec, UnsupportedError
from unimesh.messages import short
from unimesh.parallel import host_float
from unimesh.spmd import ProcessGroup

from . import tracing
from .compiled import compiled
from .graph import BODY_GRAPH, MLXGraph
from .process import PROCESS, Split
from .runtime import host_to_mx, import_mx, mx_to_host
from .tracing import RULES, TRACING
from .translate import MLXArray, MLXMesh, MLXTranslator, fresh
from .transport import MLX_ARRAYS, MLXArrays, MLXTransport


class MLXPrograms(MLXTranslator):
    """The program layer, on the primitives of the core's SPMD engine."""

    #: how many unimesh.value_and_grad calls are running (MLX cannot say whether a transform
    #: traces an array, so only unimesh's own can refuse what would cut a gradient)
    _differentiating = 0

    def process_index(self) -> int:
        return int(self._world().rank())

    def world_group(self) -> MLXGroup:
        return MLXGroup(self._world())

    def split_group(
        self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int
    ) -> MLXGroup | None:
        """``Group.split`` (MPI): colour = the row, key = the place in it; None where the
        distributed backend cannot split (ring), and the engine emulates the group."""
        world = self._world()
        members = tuple(int(m) for m in rows[row])
        try:
            group = world.split(row, members.index(int(world.rank())))
        except RuntimeError:
            return None
        split = Split(members, group)
        PROCESS.splits.add(split)  # let go at exit, before MPI finalizes
        return MLXGroup(split)

    def arrays(self) -> MLXArrays:
        return MLX_ARRAYS

    def transport(self) -> MLXTransport:
        return MLXTransport(self)

    def custom_vjp(self, fwd: Any, bwd: Any) -> Any:
        function = import_mx().custom_function(fwd)

        def transpose(primals: Any, cotangent: Any, output: Any) -> Any:
            RULES.transposed += 1
            return bwd(cotangent)

        function.vjp(transpose)

        def apply(x: Any) -> Any:
            RULES.applied += 1
            return function(x)

        return apply

    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]:
        """An :class:`MLXArray`'s local block (gathered and cut again when laid out
        otherwise), or a global array (numpy and lists become ``mx.array``)."""
        mx = import_mx()
        if isinstance(arg, MLXArray):
            if arg.layout is layout or arg.layout == layout:
                return arg.local, False
            whole = None
            if arg.layout.mesh == layout.mesh:  # by collectives, so gradients flow back
                whole = self.axis_env(layout.mesh).whole(arg.local, arg.layout, arg.shape)
            if whole is not None:
                return whole, True
            # another mesh, or blocks of unequal size: unimesh.reshard moves only the pieces
            # this rank lacks (send/recv, differentiable; not inside mx.compile)
            if TRACING.compiling:  # refused on every rank alike, before any piece moves
                raise UnsupportedError(
                    f"an argument laid out as {arg.layout!r} goes to {layout!r} (another mesh, "
                    "or blocks of unequal size): MLX moves it with send/recv, whose rounds "
                    "mx.compile (and vmap) cannot evaluate; move it first, outside the "
                    "compiled step (unimesh.reshard(x, layout)), or call the step eagerly",
                    backend="mlx",
                    capability="reshard",
                )
            import unimesh

            return unimesh.reshard(arg, layout).local, False
        return (arg if isinstance(arg, mx.array) else fresh(host_to_mx(arg))), True

    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any:
        return MLXArray(block, layout, shape)

    def graph(self) -> MLXGraph | None:
        """While ``unimesh.compile`` traces a step that may take a gradient: MLX traces it
        once per argument signature, and the plan is made once per trace (the same caching
        as ``mx.compile``'s). Eager calls keep JAX's check_vma=False rules: a plan kept
        across eager calls could miss Python state that changed between them."""
        return BODY_GRAPH if TRACING.compiling and not RULES.forward_only else None

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Any:
        """``mx.value_and_grad`` over the local blocks of :class:`MLXArray` arguments (and the
        global ``mx.array`` ones); gradients come back as :class:`MLXArray` with the
        argument's layout, or global arrays."""
        import optree

        mx = import_mx()

        def run(*given: Any) -> Any:
            args = list(given)
            layouts = {}
            locals_ = []
            for i in argnums:
                flat, treedef = optree.tree_flatten(args[i])
                layouts[i] = (
                    treedef,
                    [(a.layout, a.shape) if isinstance(a, MLXArray) else None for a in flat],
                )
                locals_.append(
                    optree.tree_unflatten(treedef, [_differentiable(a, fn, i) for a in flat])
                )

            def inner(*chosen: Any) -> Any:
                full = list(args)
                for i, tree in zip(argnums, chosen):
                    treedef, kinds = layouts[i]
                    full[i] = optree.tree_unflatten(
                        treedef,
                        [
                            MLXArray(a, *kind) if kind is not None else a
                            for a, kind in zip(optree.tree_leaves(tree), kinds)
                        ],
                    )
                out = fn(*full)
                value, aux = out if has_aux else (out, None)
                value = value.local if isinstance(value, MLXArray) else value
                if not isinstance(value, mx.array) or value.size != 1:
                    raise ConversionError(
                        f"value_and_grad needs {getattr(fn, '__name__', 'fn')} to return a "
                        f"scalar, got {short(value)}"
                    )
                return (value.reshape(()), aux) if has_aux else value.reshape(())

            positions = tuple(range(len(argnums)))
            self._differentiating += 1
            try:
                if has_aux:
                    value, grads = _with_aux(mx, inner, positions, locals_)
                else:
                    value, grads = mx.value_and_grad(inner, argnums=positions)(*locals_)
            finally:
                self._differentiating -= 1
            if len(argnums) == 1 and not isinstance(grads, tuple):
                grads = (grads,)
            out = []
            for i, g in zip(argnums, grads):
                treedef, kinds = layouts[i]
                out.append(
                    optree.tree_unflatten(
                        treedef,
                        [
                            MLXArray(leaf, *kind) if kind is not None else leaf
                            for leaf, kind in zip(optree.tree_leaves(g), kinds)
                        ],
                    )
                )
            return value, tuple(out)

        return run

    def full_array(self, array: Any) -> Any:
        """numpy of an :class:`MLXArray`'s whole value, from every process's block (one world
        all_gather of blocks padded to the largest), or of an ``mx.array``."""
        probe = tracing.tracer_probe()
        if probe is not None and probe(array.local if isinstance(array, MLXArray) else array):
            raise UnsupportedError(
                f"full_array of {short(array)}, which an MLX transform (grad, vjp, compile, "
                "...) traces: numpy would cut its gradient (JAX refuses a tracer there too). "
                "Keep it an mx.array inside the function, or take full_array of the result",
                backend=self.name,
                capability="grad",
            )
        if not isinstance(array, MLXArray):
            return np.array(array)
        mx = import_mx()
        layout, shape = array.layout, array.shape
        if layout.spec.partial:
            raise UnsupportedError(
                f"full_array of a partial layout {layout.spec!r}: reduce it "
                "first (psum inside shard_map)",
                backend=self.name,
                capability="partial",
            )
        world = self._world()
        slices = [layout.shard_slices(shape, r) for r in range(int(world.size()))]
        widths = [[s.stop - s.start for s in sl] for sl in slices]
        biggest = tuple(max(w[d] for w in widths) for d in range(len(shape)))
        mine = mx_to_host(array.local)
        local = np.zeros(biggest, dtype=mine.dtype)
        local[tuple(slice(0, n) for n in mine.shape)] = mine
        every = np.array(
            mx.distributed.all_gather(mx.expand_dims(host_to_mx(local), 0), group=world)
        )
        out = np.zeros(shape, dtype=local.dtype)
        for r, sl in enumerate(slices):
            out[sl] = every[r][tuple(slice(0, n) for n in widths[r])]
        return out

    def param_paths(self, model: Any) -> list[tuple[str, tuple[int, ...]]]:
        """``tree_flatten(model.parameters())``'s names and shapes."""
        from mlx.utils import tree_flatten

        _mlx_module(model)
        flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        return [(path, tuple(value.shape)) for path, value in flat]

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """Every parameter of an MLX ``nn.Module`` becomes this process's block (paths as
        ``mlx.utils.tree_flatten`` names them, e.g. ``layers.0.weight``). In place."""
        from mlx.utils import tree_flatten, tree_unflatten

        _mlx_module(model)
        placed = []
        flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        for path, value in flat:
            host = np.array(value)
            placed.append((path, self.distribute(host, resolve(path, host.shape)).local))
        model.update(tree_unflatten(placed))
        return model

    def compile(self, fn: Any, options: dict[str, Any]) -> Any:
        """``mx.compile`` of ``fn`` with :class:`MLXArray` arguments and results handed over
        as their blocks (see :func:`unimesh_mlx.compiled`)."""
        return compiled(fn, options, self.own_chain)

    def stop_gradient(self, x: Any) -> Any:
        local = x.local if isinstance(x, MLXArray) else x
        stopped = import_mx().stop_gradient(local)
        return MLXArray(stopped, x.layout, x.shape) if isinstance(x, MLXArray) else stopped

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


def _mlx_module(model: Any) -> None:
    import mlx.nn

    if not isinstance(model, mlx.nn.Module):  # type: ignore[attr-defined]
        raise ConversionError(
            f"the mlx backend shards the parameters of an mlx.nn.Module, not {short(model)}"
        )


def _differentiable(leaf: Any, fn: Any, i: int) -> Any:
    """What ``mx.value_and_grad`` is given for a leaf of argument ``i``: an :class:`MLXArray`'s
    block, an ``mx.array``, floating numpy (or a float, in MLX's default float32) as an
    ``mx.array`` (JAX and torch take numpy there too); MLX differentiates nothing else, so
    anything else is refused by name (it raised MLX's own tree_flatten error)."""
    mx = import_mx()
    if isinstance(leaf, MLXArray):
        return leaf.local
    if isinstance(leaf, mx.array):
        return leaf
    if host_float(leaf):
        return mx.array(leaf) if type(leaf) is float else host_to_mx(np.array(leaf))
    raise ConversionError(
        f"value_and_grad of {getattr(fn, '__name__', 'fn')} with respect to argument {i}: "
        f"its leaf {short(leaf)} is not a floating-point array, and MLX differentiates only "
        "arrays (jax.grad refuses integer inputs too); pass it as an mx.array or float numpy, "
        "or leave it out of argnums"
    )


@functools.cache
def _all_reduce(op: str) -> Any:
    """``mx.distributed.all_sum`` (``all_max``, ``all_min``)."""
    return getattr(import_mx().distributed, "all_" + op)


def _native_group(group: Any) -> Any:
    """The ``mx.distributed.Group`` of a handle (a :class:`.process.Split` or the world)."""
    return group.group if isinstance(group, Split) else group


class MLXGroup(ProcessGroup):
    """An MLX group as the engine holds it, ``handle``: the world ``mx.distributed.Group`` or
    a :class:`.process.Split` (let go at exit), and the collectives on it."""

    __slots__ = ("handle",)

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    @property
    def group(self) -> Any:
        """The ``mx.distributed.Group`` (None once a split one is let go at exit)."""
        return _native_group(self.handle)

    def all_reduce(self, x: Any, op: str) -> Any:
        return _all_reduce(op)(x, group=_native_group(self.handle))

    def all_gather(self, x: Any) -> Any:
        mx = import_mx()
        return mx.distributed.all_gather(mx.expand_dims(x, 0), group=_native_group(self.handle))


def _with_aux(mx: Any, inner: Any, positions: tuple[int, ...], locals_: list[Any]) -> Any:
    """``mx.value_and_grad`` of a function returning (value, aux): aux rides along as the
    second output, which MLX does not differentiate."""
    box: list[Any] = []

    def value_only(*chosen: Any) -> Any:
        value, aux = inner(*chosen)
        box.append(aux)
        return value

    value, grads = mx.value_and_grad(value_only, argnums=positions)(*locals_)
    return (value, box[-1]), grads


def shard_linear(
    linear: Any, layout: Layout, native_mesh: MLXMesh, *, segments: int | list[int] = 1
) -> Any:
    """MLX's own tensor-parallel layer for a Linear whose weight (MLX's ``(out, in)``) is laid
    out as ``layout``: ``P(axis, None)`` shards the outputs (``"all-to-sharded"``),
    ``P(None, axis)`` the inputs (``"sharded-to-all"``), over ``axis``'s group.

    ``segments`` is MLX's: a fused layer (QKV, as mlx-lm builds them) whose sharded dim is
    cut into that many equal segments (or at those split points), each sharded on its own,
    so every rank holds its slice of every segment. Such a weight's block is not one
    PartitionSpec block of the global weight, so ``unimesh.save`` of the model refuses it."""
    from mlx.nn.layers.distributed import shard_linear as mlx_shard_linear

    spec = tuple(layout.spec) + (None,) * (2 - len(layout.spec))
    if (
        len(spec) != 2
        or (spec[0] is None) == (spec[1] is None)
        or any(isinstance(e, tuple) for e in spec)
    ):
        raise LayoutError(
            f"shard_linear takes P(axis, None) or P(None, axis) for a Linear "
            f"weight, got {layout.spec!r}"
        )
    axis = spec[0] if spec[0] is not None else spec[1]
    assert isinstance(axis, str)
    group = native_mesh.axis_group(axis)
    if group.emulated and group.size() != native_mesh.world.size():
        raise UnsupportedError(
            f"MLX's sharded Linear layers need a real group for axis {axis!r}, and this MLX "
            "distributed backend cannot split one (ring); use the MPI backend",
            backend="mlx",
            capability="axis_groups",
        )
    sharding = "all-to-sharded" if spec[0] is not None else "sharded-to-all"
    _check_segments(segments, linear.weight.shape[0 if spec[0] is not None else 1])
    layer = mlx_shard_linear(
        linear,
        sharding,
        segments=segments,
        group=group.group if group.group is not None else native_mesh.world,
    )
    PROCESS.keep_layer(layer)  # it holds the split group: released at exit too
    # the weight's global layout, which the layer itself does not record (for unimesh.save)
    layer._unimesh_layout = Layout(layout.mesh, PartitionSpec(*spec))
    layer._unimesh_segments = segments
    return layer


def _check_segments(segments: object, size: int) -> None:
    """``segments`` as MLX takes it: a positive int dividing the sharded dim, or a list of
    increasing split points inside it."""
    if isinstance(segments, bool) or not isinstance(segments, (int, list)):
        raise LayoutError(
            f"shard_linear segments must be an int or a list of split points, got {short(segments)}"
        )
    if isinstance(segments, int):
        if segments < 1 or size % segments:
            raise LayoutError(
                f"shard_linear segments={segments} must be a positive int dividing the sharded "
                f"dim ({size})"
            )
    elif (
        not segments
        or not all(isinstance(p, int) and not isinstance(p, bool) for p in segments)
        or not all(a < b for a, b in zip([0, *segments], [*segments, size]))
    ):
        raise LayoutError(
            f"shard_linear segments {short(segments)} must be increasing split points "
            f"between 0 and the sharded dim ({size})"
        )


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
