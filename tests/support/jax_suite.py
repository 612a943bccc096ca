"""Cases of JAX's own ``tests/shard_map_test.py``, ported to unimesh (the regression net of the
fidelity issue). Source: jax-ml/jax, tests/shard_map_test.py at commit
cec06d116c05f0d52adfceee3d3b730fdbcb0ce5 (2026-08-08). Each case keeps the JAX test's body,
specs and inputs; meshes of 8 devices are brought to 4 (torchrun 4 and mpirun 4 run every
device of the mesh), as each case says.

A case's body is written once against a ``lax`` namespace: ``jax.lax`` itself for JAX's own
run (:func:`native_lax`, the reference, ``check_vma`` on, float64), or unimesh's collectives
(:func:`unimesh_lax`) for the ported run on any backend. For every case the reference keeps
each output's global value and every device's block, and the gradient of a weighted sum of
the outputs (weights fixed per output) with respect to every float argument; the ports compare
all of it.

What unimesh cannot express (``axis_index_groups``, ``pcast``) stays in the list, marked
``expressible=False``: its test is a strict xfail that turns into a failure the day it works.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

SOURCE = "jax-ml/jax tests/shard_map_test.py @ cec06d116c05f0d52adfceee3d3b730fdbcb0ce5"


class Case:
    """One ported test: ``body(lax)`` gives the function shard_map runs."""

    def __init__(
        self,
        name: str,
        mesh: str,
        body: Callable[[Any], Callable[..., Any]],
        in_specs: Any,
        out_specs: Any,
        args: list[Any],
        *,
        grad: bool = True,
        expressible: bool = True,
        why: str = "",
        native: Callable[[Any], Callable[..., Any]] | None = None,
    ) -> None:
        self.name = name
        self.mesh = mesh
        self.body = body
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.args = args
        self.grad = grad
        self.expressible = expressible
        self.why = why
        #: the body of JAX's own run where it differs (a primitive JAX's CPU cannot lower)
        self.native = native or body

    def float_args(self) -> tuple[int, ...]:
        return tuple(
            i for i, a in enumerate(self.args) if isinstance(a, np.ndarray) and a.dtype.kind == "f"
        )


# -- the two lax namespaces --------------------------------------------------------------------
def _module(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def _sin(x: Any) -> Any:
    return _math("sin", x)


def _cos(x: Any) -> Any:
    return _math("cos", x)


def _math(name: str, x: Any) -> Any:
    mod = _module(x)
    if mod == "torch":
        import torch

        return getattr(torch, name)(x)
    if mod == "mlx":
        import mlx.core as mx

        return getattr(mx, name)(x)
    import jax.numpy as jnp

    return getattr(jnp, name)(x)


def _row(x: Any, ndim: int = 1) -> Any:
    """A scalar as an array of ``ndim`` dims of 1 (MLX's axis_index is a Python int)."""
    shape = (1,) * ndim
    if isinstance(x, int):
        import mlx.core as mx

        return mx.array(x).reshape(shape)
    return x.reshape(shape)


class _Lax:
    """What the bodies call beyond array methods: the collectives and a few helpers."""

    sin = staticmethod(_sin)
    cos = staticmethod(_cos)
    row = staticmethod(_row)

    def __init__(self, ops: Any, native: bool) -> None:
        self._ops = ops
        self.native = native

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def all_gather(
        self, x: Any, axis_name: Any, *, axis: int = 0, tiled: bool = False, to: str = "varying"
    ) -> Any:
        if self.native:
            return self._ops.all_gather(x, axis_name, axis=axis, tiled=tiled, to=to)
        return self._ops.all_gather(x, axis_name, dim=axis, tiled=tiled, to=to)


def native_lax() -> _Lax:
    import jax

    return _Lax(jax.lax, True)


def unimesh_lax() -> _Lax:
    import unimesh

    return _Lax(unimesh, False)


# -- the cases -----------------------------------------------------------------------------------
def _P(*entries: Any) -> Any:
    from unimesh import P

    return P(*entries)


def _arange(*shape: int) -> np.ndarray:
    return np.arange(math.prod(shape), dtype=np.float64).reshape(shape)


def _rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _identity(lax: Any) -> Callable[..., Any]:
    return lambda x: x


def _all_gather(lax: Any) -> Callable[..., Any]:
    return lambda a: (
        lax.all_gather(a, "z", axis=0, tiled=True),
        lax.all_gather(a, ("x", "y"), axis=-1, tiled=True),
    )


def _matmul_reduce_scatter(lax: Any) -> Callable[..., Any]:
    def fwd(a: Any, b: Any) -> Any:
        c = a @ b
        return (
            lax.psum_scatter(c, "y", scatter_dimension=0, tiled=True),
            lax.psum_scatter(c, ("z", "y"), scatter_dimension=0, tiled=True),
        )

    return fwd


def _permute_shift(lax: Any) -> Callable[..., Any]:
    def fwd(a: Any) -> Any:
        n = lax.axis_size("x")
        return lax.ppermute(a, "x", perm=[(j, (j + 1) % n) for j in range(n)])

    return fwd


def _permute_multiple_axes(lax: Any) -> Callable[..., Any]:
    def fwd(a: Any) -> Any:
        xy, yz = lax.axis_size(("x", "y")), lax.axis_size(("y", "z"))
        return (
            lax.ppermute(a, ("x", "y"), perm=[(j, (j + 1) % xy) for j in range(xy)]),
            lax.ppermute(a, ("y", "z"), perm=[(j, (j + 1) % yz) for j in range(yz)]),
        )

    return fwd


def _all_to_all(axis: Any, split: int, concat: int) -> Callable[[Any], Callable[..., Any]]:
    return lambda lax: (
        lambda a: lax.all_to_all(a, axis, split_axis=split, concat_axis=concat, tiled=True)
    )


def _pbroadcast(axes: Any) -> Callable[[Any], Callable[..., Any]]:
    def body(lax: Any) -> Callable[..., Any]:
        def fwd(x: Any) -> Any:
            x = x + 1.0 * (lax.axis_index(axes) == 0)
            return lax.pbroadcast(x, axes, source=0)

        return fwd

    return body


def _pbroadcast_on_cpu(axes: Any) -> Callable[[Any], Callable[..., Any]]:
    """JAX's pbroadcast (the source's value on every device) spelled with psum: JAX lowers
    no pbroadcast for CPU (its test runs on GPU only)."""

    def body(lax: Any) -> Callable[..., Any]:
        import jax.numpy as jnp

        def fwd(x: Any) -> Any:
            first = lax.axis_index(axes) == 0
            x = x + 1.0 * first
            return lax.psum(jnp.where(first, x, 0.0), axes)

        return fwd

    return body


def _reverse_mode_ad(lax: Any) -> Callable[..., Any]:
    return lambda x, y: lax.sin(x) + 3 + math.tan(2.0) * lax.cos(x) + y


def _axis_index(lax: Any) -> Callable[..., Any]:
    return lambda: lax.row(lax.axis_index("x"))


def _axis_index_two(lax: Any) -> Callable[..., Any]:
    return lambda: (
        lax.row(lax.axis_index("i"), 2),
        lax.row(lax.axis_index("j"), 2),
        lax.row(lax.axis_index(("i", "j")), 2),
    )


def _psum_non_zero_cts(lax: Any) -> Callable[..., Any]:
    return lambda x: (x, lax.psum(x, axis_name="x"))


def _psum(axis: Any) -> Callable[[Any], Callable[..., Any]]:
    return lambda lax: lambda x: lax.psum(x, axis)


def _repeated_psum(lax: Any) -> Callable[..., Any]:
    return lambda x: lax.psum(lax.psum(x, "i"), "i")


def _pmin(lax: Any) -> Callable[..., Any]:
    return lambda x: lax.pmin(x, "i")


def _pmax(lax: Any) -> Callable[..., Any]:
    return lambda x: lax.pmax(x, "i")


def _check_rep_false(lax: Any) -> Callable[..., Any]:
    return lambda q, k, v: q * k[None, :] + v[None, :]


def _all_gather_invariant(lax: Any) -> Callable[..., Any]:
    return lambda a: lax.all_gather(a, "x", axis=0, tiled=True, to="invarying")


def _all_gather_invariant_x(lax: Any) -> Callable[..., Any]:
    return lambda x: lax.all_gather(x, "x", axis=0, tiled=True, to="invarying")


_OBJ = object()


def _in_spec_none(lax: Any) -> Callable[..., Any]:
    def f(o: Any, x: Any) -> Any:
        assert o is _OBJ or o is None, o
        return lax.sin(x)

    return f


def _in_spec_none_nested(lax: Any) -> Callable[..., Any]:
    def f(o1: Any, o2: Any, x: Any, o3: Any, o4: Any) -> Any:
        assert o1 is None and o2 == (None, None) and o3 is None and o4 == {"a": None}
        return lax.sin(x)

    return f


def _in_spec_none_dict(lax: Any) -> Callable[..., Any]:
    def f(o: Any, x: Any) -> Any:
        assert o["a"] is _OBJ, o
        return lax.sin(x)

    return f


def _with_axis_index_groups(lax: Any) -> Callable[..., Any]:
    return lambda a: lax.all_to_all(
        a, "x", split_axis=1, concat_axis=0, axis_index_groups=((0, 1), (2, 3)), tiled=True
    )


def _pvary(lax: Any) -> Callable[..., Any]:
    return lambda x: lax.pcast(x, "x", to="varying")


def named_cases() -> list[Case]:
    P = _P
    return [
        Case("test_identity", "z=2,x=2,y=1", _identity, (P("z", ("x", "y")),),
             P("z", ("x", "y")), [_rand(1, 8, 8)]),
        Case("test_all_gather", "z=2,x=2,y=1", _all_gather, (P("z", ("x", "y")),),
             P("z", ("x", "y")), [_rand(2, 8, 8)]),
        Case("test_all_gather_invariant_basic", "x=4", _all_gather_invariant, P("x"), P(),
             [_arange(8)]),
        Case("test_matmul_reduce_scatter", "z=2,y=2", _matmul_reduce_scatter,
             (P("z", "y"), P("y", None)), P(("z", "y"), None), [_rand(3, 8, 8), _rand(4, 8, 8)]),
        # JAX: 8 devices along x
        Case("test_collective_permute", "x=4", _permute_shift, (P("x", None),), P("x", None),
             [_arange(8, 8)]),
        # JAX: a 2x2x2 mesh; here 1x2x2, so (x, y) has 2 devices and (y, z) 4
        Case("test_collective_permute_with_multiple_axis_names", "x=1,y=2,z=2",
             _permute_multiple_axes, (P("x", ("y", "z")),), P("x", ("y", "z")),
             [_arange(4, 16)]),
        # JAX: x=8
        Case("test_all_to_all_single_axis_name", "x=4", _all_to_all("x", 1, 1),
             (P("x", None),), P(None, "x"), [_arange(8, 8)]),
        # JAX: x=4, y=2
        Case("test_all_to_all_multiple_axis_names", "x=2,y=2", _all_to_all(("x", "y"), 1, 1),
             (P(("x", "y"), None),), P(None, ("x", "y")), [_arange(8, 8)]),
        # JAX: a 4x2 mesh, check_vma=False, on GPU only (its where() is arithmetic here)
        Case("test_pbroadcast_partial_replicated", "x=2,y=2", _pbroadcast("x"),
             (P("y", None),), P("y", None), [_arange(4, 4)], native=_pbroadcast_on_cpu("x")),
        Case("test_pbroadcast_fully_replicated", "x=2,y=2", _pbroadcast(("x", "y")),
             (P(None, None),), P(None, None), [_arange(4, 4)],
             native=_pbroadcast_on_cpu(("x", "y"))),
        Case("test_all_to_all_grad", "x=4", _all_to_all("x", 1, 0), (P("x", None),),
             P(None, "x"), [_arange(8, 8)]),
        Case("test_reverse_mode_ad", "x=2,y=2", _reverse_mode_ad, (P("x"), P(None)), P("x"),
             [_arange(8) / 10.0, _arange(4) / 10.0]),
        Case("test_axis_index", "x=4", _axis_index, (), P("x"), [], grad=False),
        # JAX: a 4x2 mesh
        Case("test_axis_index_twoaxes", "i=2,j=2", _axis_index_two, (), P("i", "j"), [],
             grad=False),
        # JAX: x=8
        Case("test_psum_transpose_non_zero_cts", "x=4", _psum_non_zero_cts, P("x"),
             (P("x"), P()), [_arange(16)]),
        Case("test_fanout_specs_transpose_to_psum", "x=4", _identity, P(), P("x"),
             [_arange(1)]),
        Case("test_fanin_psum_transposes_to_fanout", "x=4", _psum("x"), P("x"), P(),
             [_arange(4)]),
        Case("test_psum_with_implicit_fanout_self_transposes", "x=4", _psum("x"), P("x"),
             P("x"), [_arange(4)]),
        Case("test_all_reduce_rgv3", "x=2,y=2", _psum("x"), P("x", "y"), P("x", "y"),
             [_rand(5, 2, 2)]),
        Case("test_all_gather_rgv3", "x=2,y=2", _all_gather_invariant_x, P("x", "y"),
             P(None, "y"), [_rand(6, 2, 2)]),
        # JAX: x=2
        Case("test_all_to_all_rgv3", "x=4", _all_to_all("x", 1, 1), P("x", None),
             P(None, "x"), [_rand(7, 8, 8)]),
        Case("test_repeated_psum_allowed", "i=4", _repeated_psum, P("i"), P(), [_arange(4)]),
        Case("test_pmin", "i=4", _pmin, P("i"), P(), [_arange(8)], grad=False),
        Case("test_pmax", "i=4", _pmax, P("i"), P(), [_arange(8)], grad=False),
        Case("test_check_rep_false_grads", "heads=4", _check_rep_false,
             (P("heads", None), P(None), P(None)), P("heads", None),
             [_arange(4, 8), _arange(8), _arange(8)]),
        # JAX: a 4x2 mesh
        Case("test_in_spec_none", "i=2,j=2", _in_spec_none, (None, P("i")), P("i"),
             [_OBJ, _arange(4, 2)]),
        Case("test_in_spec_none_is_none", "i=2,j=2", _in_spec_none, (None, P("i")), P("i"),
             [None, _arange(4, 2)]),
        Case("test_in_spec_none_dict", "i=2,j=2", _in_spec_none_dict, ({"a": None}, P("i")),
             P("i"), [{"a": _OBJ}, _arange(4, 2)]),
        Case("test_in_spec_none_nested", "i=2,j=2", _in_spec_none_nested,
             (None, (None, None), P("i"), None, {"a": None}), P("i"),
             [None, (None, None), _arange(4, 2), None, {"a": None}]),
        Case("test_all_to_all_with_axis_index_groups", "x=4", _with_axis_index_groups,
             (P("x", None),), P(None, "x"), [_arange(4, 4)], expressible=False,
             why="unimesh's collectives take no axis_index_groups"),
        Case("test_pvary", "x=4", _pvary, P(), P("x"), [_arange(8)], expressible=False,
             why="unimesh has no pcast (JAX's explicit pvary); shard_map inserts it where "
             "needed"),
    ]  # fmt: skip


# -- the systematic cases (ShardMapSystematicTest.test_grads), on a 2x2 mesh --------------------
def _fun(name: str) -> tuple[int, Callable[[Any], Callable[..., Any]], Callable[..., Any]]:
    """(inputs, body, replication rule) of JAX's fun_specs."""
    if name == "id":
        return 1, lambda lax: lambda x: x, lambda r: r
    if name == "flip":
        return 2, lambda lax: lambda x, y: (y, x), lambda rx, ry: (ry, rx)
    if name == "transpose":
        return 1, lambda lax: lambda x: x.T, lambda r: r
    if name == "ravel":
        return 1, lambda lax: lambda x: x.reshape(-1), lambda r: r
    if name == "dot":
        return 2, lambda lax: lambda x, y: x @ y, lambda r1, r2: r1 & r2
    if name == "sin_dot_sin":
        return 2, lambda lax: lambda x, y: lax.sin(lax.sin(x) @ y), lambda r1, r2: r1 & r2
    return 1, lambda lax: lambda x: (x + 1) * ((x + 1) > 0) - 1, lambda r: r  # relu


def _partitions(axes: tuple[str, ...], ndim: int) -> list[tuple[Any, ...]]:
    out = []
    for where in itertools.product(range(ndim), repeat=len(axes)):
        dims: list[list[str]] = [[] for _ in range(ndim)]
        for d, a in zip(where, axes):
            dims[d].append(a)
        out.append(tuple(tuple(d) if d else None for d in dims))
    return out


def _specs_over(names: tuple[str, ...], ndim: int, needed: set[str] | None = None) -> list[Any]:
    """JAX's make_in_spec / make_out_spec: a subset of the axes (containing ``needed``), each
    put on one dim, in mesh order within a dim."""
    specs = []
    for r in range(len(names) + 1):
        for subset in itertools.combinations(names, r):
            if needed is not None and not needed <= set(subset):
                continue
            specs.extend(_P(*entries) for entries in _partitions(subset, ndim))
    return specs


def systematic_cases(count: int = 36, seed: int = 0) -> list[Case]:
    """``count`` cases drawn (with a fixed seed) from every function, input spec and valid
    output spec on mesh ``i=2,j=2``, block shapes (2, 3) and (3, 2) as JAX's input_shapes."""
    names = ("i", "j")
    sizes = {"i": 2, "j": 2}
    pool: list[Case] = []
    for fun in ("id", "flip", "transpose", "ravel", "dot", "sin_dot_sin", "relu"):
        n, body, rule = _fun(fun)
        blocks = [(2, 3)] if n == 1 else ([(2, 3), (2, 3)] if fun == "flip" else [(2, 3), (3, 2)])
        for ins in itertools.product(*(_specs_over(names, len(b)) for b in blocks)):
            args = []
            for k, (block, spec) in enumerate(zip(blocks, ins)):
                shape = tuple(
                    b * math.prod(sizes[a] for a in (e if isinstance(e, tuple) else (e,)) if a)
                    if e
                    else b
                    for b, e in zip(block, tuple(spec) + (None,) * (len(block) - len(spec)))
                )
                args.append(_rand(100 + k, *shape))
            reps = [set(names) - set(spec.axes()) for spec in ins]
            out_rep = rule(*reps)
            out_reps = out_rep if isinstance(out_rep, tuple) else (out_rep,)
            out_dims = [1] if fun == "ravel" else ([2, 2] if fun == "flip" else [2])
            choices = [_specs_over(names, d, set(names) - r) for d, r in zip(out_dims, out_reps)]
            for outs in itertools.product(*choices):
                out_specs = tuple(outs) if fun == "flip" else outs[0]
                label = "_".join(repr(s) for s in ins) + "->" + repr(out_specs)
                pool.append(Case(f"systematic_{fun}_{label}", "i=2,j=2", body, tuple(ins),
                                 out_specs, args))  # fmt: skip
    rng = np.random.default_rng(seed)
    picked = sorted(rng.choice(len(pool), size=min(count, len(pool)), replace=False))
    return [pool[int(i)] for i in picked]


def cases() -> list[Case]:
    return named_cases() + systematic_cases()


# -- running a case -----------------------------------------------------------------------------
def weights(shape: tuple[int, ...], k: int) -> np.ndarray:
    """The weights of output ``k`` in the loss (distinct per element and output)."""
    return 1.0 + np.random.default_rng(1000 + k).random(shape)


def reference(case: Case) -> dict[str, np.ndarray]:
    """JAX's own run: ``jax.shard_map`` (check_vma on) of the body with ``jax.lax``, float64
    (the caller enables x64). Output values and every device's block, and the gradient of
    the weighted sum of the outputs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh as JMesh
    from jax.sharding import PartitionSpec as JP

    import unimesh

    mesh = unimesh.Mesh.from_string(case.mesh)
    devices = np.array(jax.devices()[: mesh.size], dtype=object).reshape(mesh.shape)
    jmesh = JMesh(devices, mesh.axis_names)

    def jspec(s: Any) -> Any:
        return None if s is None else JP(*s)

    import optree

    def conv(tree: Any) -> Any:
        return optree.tree_map(
            jspec, tree, is_leaf=lambda s: s is None or isinstance(s, unimesh.P), none_is_leaf=True
        )

    f = jax.shard_map(
        case.native(native_lax()),
        mesh=jmesh,
        in_specs=conv(case.in_specs),
        out_specs=conv(case.out_specs),
    )
    args = [jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in case.args]
    # jitted where every argument is an array (as most of JAX's own cases run): one XLA
    # computation per case, not the eager shard_map's compile per primitive
    arrays = all(isinstance(a, jax.Array) for a in args)
    run = jax.jit(f) if arrays else f
    out: dict[str, np.ndarray] = {}
    leaves = jax.tree_util.tree_leaves(run(*args))
    for k, leaf in enumerate(leaves):
        out[f"out{k}"] = np.asarray(leaf, np.float64)
        for shard in leaf.addressable_shards:
            d = jax.devices().index(shard.device)
            out[f"out{k}/block{d}"] = np.asarray(shard.data, np.float64)
    nums = case.float_args()
    if case.grad and nums:

        def loss(*xs: Any) -> Any:
            full = list(args)
            for i, x in zip(nums, xs):
                full[i] = x
            total = 0.0
            for k, leaf in enumerate(jax.tree_util.tree_leaves(f(*full))):
                total = total + (leaf * weights(leaf.shape, k)).sum()
            return total

        gradient = jax.grad(loss, argnums=tuple(range(len(nums))))
        grads = (jax.jit(gradient) if arrays else gradient)(*(args[i] for i in nums))
        for i, g in zip(nums, grads):
            out[f"grad{i}"] = np.asarray(g, np.float64)
    return out


def _spec_axes(spec: Any) -> tuple[str, ...]:
    return tuple(spec.axes()) if spec is not None else ()


def ported(case: Case, backend: str) -> dict[str, np.ndarray]:
    """The same through ``unimesh.shard_map`` on ``backend``; blocks of this process's
    devices only (all of them on JAX)."""
    import optree

    import unimesh

    mesh = unimesh.Mesh.from_string(case.mesh)
    program = unimesh.shard_map(
        case.body(unimesh_lax()), mesh, case.in_specs, case.out_specs, backend=backend
    )
    in_layouts = _in_layouts(case, mesh)

    def dist(i: int, a: Any) -> Any:
        if not isinstance(a, np.ndarray):
            return a
        return unimesh.distribute(a, in_layouts[i], backend=backend)

    args = [dist(i, a) for i, a in enumerate(case.args)]
    result = program(*args)
    leaves, _ = optree.tree_flatten(result)
    out_specs = _out_specs(case, len(leaves))
    out: dict[str, np.ndarray] = {}
    for k, leaf in enumerate(leaves):
        out[f"out{k}"] = np.asarray(unimesh.full_array(leaf, backend=backend), np.float64)
        for d, block in unimesh.local_shards(leaf, backend=backend).items():
            out[f"out{k}/block{d}"] = np.asarray(block, np.float64)
    nums = case.float_args()
    if case.grad and nums:
        spec_tree = tuple(out_specs)
        total = unimesh.shard_map(
            _weighted_sum([_spec_axes(spec) for spec in out_specs]),
            mesh,
            (spec_tree, spec_tree),
            unimesh.P(),
            backend=backend,
        )
        wts = tuple(weights(tuple(int(n) for n in leaf.shape), k) for k, leaf in enumerate(leaves))

        def loss(*xs: Any) -> Any:
            full = list(args)
            for i, x in zip(nums, xs):
                full[i] = x
            return total(tuple(optree.tree_leaves(program(*full))), wts)

        step = unimesh.value_and_grad(loss, argnums=tuple(range(len(nums))), backend=backend)
        _, grads = step(*(args[i] for i in nums))
        for i, g in zip(nums, grads):
            out[f"grad{i}"] = np.asarray(unimesh.full_array(g, backend=backend), np.float64)
        if backend == "mlx":  # as unimesh.compile traces it, the gradient follows the body's
            import mlx.core as mx  # graph (vmaplan); MLX's own compilation off (no kernels)

            mx.disable_compile()
            try:
                _, again = unimesh.compile(step, backend=backend)(*(args[i] for i in nums))
            finally:
                mx.enable_compile()
            for i, g in zip(nums, again):
                got = np.asarray(unimesh.full_array(g, backend=backend), np.float64)
                np.testing.assert_allclose(
                    got, out[f"grad{i}"], rtol=1e-6, atol=1e-6, err_msg="compiled gradient"
                )
    return out


def _weighted_sum(axes: list[tuple[str, ...]]) -> Callable[..., Any]:
    """The body summing ``o * w`` over every output, whole: each block once (a psum over the
    axes an output is split on; it is the same along the others)."""
    import unimesh

    def body(outs: tuple[Any, ...], ws: tuple[Any, ...]) -> Any:
        total = None
        for o, w, a in zip(outs, ws, axes):
            local = (o * w).sum()
            part = unimesh.psum(local, a) if a else local
            total = part if total is None else total + part
        return total

    return body


def _in_layouts(case: Case, mesh: Any) -> list[Any]:
    import optree

    import unimesh

    specs = case.in_specs if isinstance(case.in_specs, tuple) else (case.in_specs,) * len(case.args)
    out = []
    for spec in specs:
        leaf = optree.tree_leaves(
            spec, is_leaf=lambda s: s is None or isinstance(s, unimesh.P), none_is_leaf=True
        )
        first = leaf[0] if leaf else None
        out.append(unimesh.Layout(mesh, first if isinstance(first, unimesh.P) else unimesh.P()))
    return out


def _out_specs(case: Case, n: int) -> list[Any]:
    import unimesh

    specs = case.out_specs
    if isinstance(specs, unimesh.P):
        return [specs] * n
    return list(specs)


def compare(want: dict[str, np.ndarray], got: dict[str, np.ndarray], tol: float) -> str | None:
    """None when ``got`` (a process's view: its own blocks) agrees with JAX's ``want``;
    else what differs. Relative to the size of the value, at least 1."""
    keys = [k for k in got]
    missing = sorted(k for k in want if "/block" not in k and k not in got)
    if missing:
        return f"missing {missing}"
    for k in keys:
        if k not in want:
            return f"unexpected output {k}"
        w, g = want[k], got[k]
        if w.shape != g.shape:
            return f"{k}: shape {g.shape}, JAX {w.shape}"
        err = float(np.max(np.abs(g - w) / np.maximum(1.0, np.abs(w)), initial=0.0))
        if not err <= tol:
            return f"{k}: differs from JAX by {err:.3g} (got {g.ravel()[:6]}, JAX {w.ravel()[:6]})"
    return None
