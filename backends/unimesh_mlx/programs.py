"""The MLX backend's program layer: the core's per-process engine on MLX groups (lazy
collectives chained in program order), ``value_and_grad`` with ``mx.value_and_grad``,
``shard_params`` and ``shard_linear`` for ``mlx.nn`` models."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import numpy as np

from unimesh import ConversionError, Layout, LayoutError, Mesh, PartitionSpec, UnsupportedError
from unimesh.messages import short

from .runtime import _LAYERS, _mx, host_to_mx, mx_to_host
from .tracing import make_probe
from .translate import AxisGroup, MLXArray, MLXMesh, MLXTranslator, fresh, is_fresh


class MLXPrograms(MLXTranslator):
    """The program layer, on the primitives of the core's SPMD engine."""

    #: how many unimesh.value_and_grad calls are running (MLX cannot say whether a transform
    #: traces an array, so only unimesh's own can refuse what would cut a gradient)
    _differentiating = 0

    def process_index(self) -> int:
        return int(self._world().rank())

    def world_group(self) -> Any:
        return self._world()

    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        """``Group.split`` (MPI): colour = the row, key = the place in it; None where the
        distributed backend cannot split (ring), and the engine emulates the group."""
        world = self._world()
        members = tuple(int(m) for m in rows[row])
        try:
            group = world.split(row, members.index(int(world.rank())))
        except RuntimeError:
            return None
        return AxisGroup((), members, world, group)

    def group_all_reduce(self, x: Any, group: Any, op: str) -> Any:
        return _all_reduce(op)(x, group=_native_group(group))

    def group_all_gather(self, x: Any, group: Any) -> Any:
        mx = _mx()
        return mx.distributed.all_gather(mx.expand_dims(x, 0), group=_native_group(group))

    def as_array(self, value: Any) -> Any:
        mx = _mx()
        if isinstance(value, mx.array):
            return value
        return host_to_mx(value) if isinstance(value, (np.ndarray, np.generic)) else mx.array(value)

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        return _mx().moveaxis(x, source, destination)

    def take(self, x: Any, index: list[int]) -> Any:
        mx = _mx()
        return x[mx.array(index)] if len(index) > 1 else x[index[0] : index[0] + 1]

    def reduce_stack(self, x: Any, op: str) -> Any:
        """``op`` over dim 0 in ``x``'s dtype (``mx.sum`` widens small ints: int8 -> int32;
        MLX's ``all_sum`` and JAX's ``psum`` keep the dtype, wrapping as they do)."""
        out = getattr(_mx(), op)(x, axis=0)
        return out if out.dtype == x.dtype else out.astype(x.dtype)

    def zeros_like(self, x: Any) -> Any:
        return _mx().zeros_like(x)

    def to_host(self, x: Any) -> np.ndarray:
        return np.array(x)

    def after(self, x: Any, done: Any) -> Any:
        return _mx().depends(x, done)

    def custom_vjp(self, fwd: Any, bwd: Any) -> Any:
        function = _mx().custom_function(fwd)

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
        mx = _mx()
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
            import unimesh

            return unimesh.reshard(arg, layout).local, False
        return (arg if isinstance(arg, mx.array) else fresh(host_to_mx(arg))), True

    def needs_grad(self, x: Any) -> bool:
        """Whether an MLX transform may trace ``x`` (:func:`.tracing.make_probe`); where this MLX
        cannot be asked, False only for an array made from host data (an argument's block
        from ``distribute`` or numpy)."""
        if RULES.forward_only:
            return False
        probe = _probe()
        return not is_fresh(x) if probe is None else probe(x)

    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any:
        return MLXArray(block, layout, shape)

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Any:
        """``mx.value_and_grad`` over the local blocks of :class:`MLXArray` arguments (and the
        global ``mx.array`` ones); gradients come back as :class:`MLXArray` with the
        argument's layout, or global arrays."""
        import optree

        mx = _mx()

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
                    optree.tree_unflatten(
                        treedef, [a.local if isinstance(a, MLXArray) else a for a in flat]
                    )
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
        probe = _probe()
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
        mx = _mx()
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


def _mlx_module(model: Any) -> None:
    import mlx.nn

    if not isinstance(model, mlx.nn.Module):  # type: ignore[attr-defined]
        raise ConversionError(
            f"the mlx backend shards the parameters of an mlx.nn.Module, not {short(model)}"
        )


class _Rules:
    """What the gradient rules did, for ``unimesh.compile`` (:mod:`.compiled`): how many were
    put in a graph (``applied``) and how many MLX differentiated (``transposed``, while a
    trace takes a gradient through them); while ``forward_only`` is set (a trace that took
    none), programs put none in."""

    applied = 0
    transposed = 0
    forward_only = False


RULES = _Rules()

#: the tracer probe, made on first use (None: this MLX cannot be asked)
_PROBE: list[Any] = []


def _probe() -> Any:
    """:func:`.tracing.make_probe`'s function (or None), made once."""
    if not _PROBE:
        _PROBE.append(make_probe())
    return _PROBE[0]


@functools.cache
def _all_reduce(op: str) -> Any:
    """``mx.distributed.all_sum`` (``all_max``, ``all_min``)."""
    return getattr(_mx().distributed, "all_" + op)


def _native_group(group: Any) -> Any:
    """The ``mx.distributed.Group`` of a handle (a split :class:`AxisGroup` or the world)."""
    return group.group if isinstance(group, AxisGroup) else group


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
    _LAYERS.append(weakref.ref(layer))  # it holds the split group: released at exit too
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
