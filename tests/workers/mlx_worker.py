"""One rank of a real MLX run, under mpirun (MPI backend) or mlx.launch (ring backend).
Started by tests/test_mlx_multiprocess.py:

    mpirun --allow-run-as-root --oversubscribe -np 4 python tests/workers/mlx_worker.py mpi
    mlx.launch -n 4 --backend ring -- python tests/workers/mlx_worker.py ring
"""

from __future__ import annotations

import os
import sys
import tempfile

import _support  # noqa: F401 - tests/support on sys.path, before its modules are imported
import mlx.core as mx
import numpy as np
import unimesh_mlx
from worker_checks import Checks

import unimesh
from unimesh import Layout, Mesh, P

backend_name = sys.argv[1]
world = mx.distributed.init(strict=True, backend=backend_name)
rank = world.rank()
check = Checks(f"rank {rank}")
be = unimesh.get_backend("mlx")
for mesh in (Mesh((2, 2), ("dp", "tp")), Mesh((2, 2), ("dp", "tp"), [[3, 1], [2, 0]])):
    native = unimesh.to_native(mesh, be)
    check(  # known before any group is built (issue 40)
        native.uses_split_groups is (backend_name == "mpi"),
        f"split groups known before the first group: {native.uses_split_groups}",
    )
    check(native.coords == mesh.coords(rank), f"{mesh!r}: coordinate {native.coords}")
    check(unimesh.from_native(native) == mesh, "from_native(to_native(mesh)) == mesh")
    for axes in ("dp", "tp", ("tp", "dp")):
        g = native.axis_group(axes)
        (want,) = [grp for grp in mesh.groups(axes) if rank in grp]
        check(
            g.members == want and g.rank() == want.index(rank),
            f"{axes} group {g.members} (rank {g.rank()} in it) == neutral {want}",
        )
        if g.group is not None:
            check(
                g.group.size() == len(want) and g.group.rank() == want.index(rank),
                f"MLX's split group has size {g.group.size()}, this rank is {g.group.rank()}",
            )
        x = mx.array([float(rank), 10.0 * rank])
        check(
            g.all_sum(x).tolist() == [float(sum(want)), 10.0 * sum(want)],
            f"all_sum over {axes} == sum of {want}",
        )
        check(
            g.all_max(x).tolist()[0] == max(want) and g.all_min(x).tolist()[0] == min(want),
            f"all_max / all_min over {axes}",
        )
        gathered = g.all_gather(mx.array([float(rank)])).tolist()
        check(gathered == [float(d) for d in want], f"all_gather over {axes}: {gathered}")
    check(
        native.uses_split_groups is (backend_name == "mpi"),
        f"split groups in use: {native.uses_split_groups}",
    )
    for spec, shape in [(P("dp", "tp"), (5, 6)), (P(("tp", "dp")), (9,)), (P(None, "tp"), (3, 4))]:
        x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        lay = Layout(mesh, spec)
        shard = unimesh.distribute(x, lay, be)
        check(
            np.array_equal(np.array(shard.local), x[lay.shard_slices(shape, rank)]),
            f"distribute {spec} of {shape}: this rank's shard is the reference block",
        )
        back = unimesh.from_local(x[lay.shard_slices(shape, rank)], lay, shape, backend=be)
        check(
            back.shape == shape
            and np.array_equal(unimesh.local_shards(back)[rank], np.array(shard.local)),
            f"from_local of this rank's block of {spec} is distribute's array",
        )

if backend_name == "mpi":  # MLX's own tensor-parallel layers on the tp group
    from mlx import nn
    from unimesh_mlx import shard_linear

    mesh = Mesh((2, 2), ("dp", "tp"))
    native = unimesh.to_native(mesh, be)
    mx.random.seed(0)
    full = nn.Linear(4, 6)
    col = shard_linear(full, Layout(mesh, P("tp", None)), native)
    x = mx.arange(8, dtype=mx.float32).reshape(2, 4)
    want = np.array(full(x))
    got = np.array(col(x))
    tp = native.coords["tp"]
    check(
        np.allclose(got, want[:, 3 * tp : 3 * tp + 3], atol=1e-5),
        "shard_linear P('tp', None): this rank's output columns",
    )
    row = shard_linear(full, Layout(mesh, P(None, "tp")), native)
    got = np.array(row(x[:, 2 * tp : 2 * tp + 2]))
    check(np.allclose(got, want, atol=1e-5), "shard_linear P(None, 'tp'): the full output")

# a fused layer sharded by segments (mlx-lm's QKV): MLX's own shard_linear on the same group is
# the answer (mlx/nn/layers/distributed.py, mlx 0.32), on MPI's tp group and ring's world
from mlx import nn
from mlx.nn.layers.distributed import shard_linear as mlx_shard_linear
from unimesh_mlx import shard_linear

seg_mesh = Mesh((2, 2), ("dp", "tp")) if backend_name == "mpi" else Mesh((4,), ("tp",))
seg_native = unimesh.to_native(seg_mesh, be)
tp_size = seg_mesh.axis_size("tp")
tp = seg_native.coords["tp"]
mx.random.seed(2)
fused = nn.Linear(4, 24)  # q, k, v of 8 outputs each
xs = mx.arange(8, dtype=mx.float32).reshape(2, 4)
whole = np.array(fused(xs))
group = seg_native.axis_group("tp")
theirs = mlx_shard_linear(
    fused, "all-to-sharded", segments=3, group=group.group or seg_native.world
)
ours = shard_linear(fused, Layout(seg_mesh, P("tp", None)), seg_native, segments=3)
per = 8 // tp_size
want_cols = np.concatenate(
    [whole[:, s * 8 + tp * per : s * 8 + (tp + 1) * per] for s in range(3)], axis=1
)
check(
    np.allclose(np.array(ours(xs)), np.array(theirs(xs)), atol=1e-6)
    and np.allclose(np.array(ours(xs)), want_cols, atol=1e-5),
    "shard_linear segments=3: MLX's own fused sharding, this rank's slice of q, k and v",
)
ours_split = shard_linear(fused, Layout(seg_mesh, P("tp", None)), seg_native, segments=[8, 16])
check(
    np.allclose(np.array(ours_split(xs)), want_cols, atol=1e-5),
    "shard_linear segments=[8, 16]: the same split given as points",
)
with tempfile.TemporaryDirectory() as scratch:
    try:
        unimesh.save(os.path.join(scratch, "fused"), nn.Sequential(ours))
        check(False, "save of a segmented layer is refused")
    except unimesh.UnsupportedError as exc:
        check("fused layer sharded by segments" in str(exc), f"save refuses a fused layer: {exc}")
try:
    shard_linear(fused, Layout(seg_mesh, P("tp", None)), seg_native, segments=5)
    check(False, "segments=5 of 24 outputs is refused")
except unimesh.LayoutError as exc:
    check("segments=5 must be a positive int dividing" in str(exc), f"segments=5: {exc}")
del theirs, ours, ours_split, group  # they hold split groups (MPI aborts on a late free)

# parameter sharding by rule: every parameter becomes this rank's reference block
from mlx import nn
from mlx.utils import tree_flatten

mesh = Mesh((2, 2), ("dp", "tp"))
mx.random.seed(1)
model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
rules = unimesh.LayoutMap(
    mesh,
    {
        r"layers\.0\.weight": P("tp", None),
        r"layers\.0\.bias": P("tp"),
        r"layers\.2\.weight": P(None, ("dp", "tp")),
    },
)
check(unimesh.shard_params(model, rules, backend=be) is model, "shard_params returns the model")
for name, value in tree_flatten(model.parameters()):
    lay = rules.get(name) or Layout(mesh, P())
    want = before[name][lay.shard_slices(before[name].shape, rank)]
    check(
        np.array_equal(np.array(value), want),
        f"shard_params: {name} holds its reference block {lay.spec!r} {want.shape}",
    )
try:
    unimesh.shard_params(
        nn.Linear(2, 3), unimesh.LayoutMap(mesh, {"bias": P("dp", "tp")}), backend=be
    )
    check(False, "a layout with more dims than the parameter must raise")
except unimesh.LayoutError as exc:
    check("'bias'" in str(exc), f"shard_params names the parameter: {exc}")

# the engine's edges and results, decided once per argument layouts and replayed (issue 55):
# one program called again and again while its arguments change layout, shape and grad
# mode; every call against numpy in float64 (the value, and the gradient 2 X^T X W)
rng = np.random.default_rng(7)
X8, X12 = rng.standard_normal((8, 6)), rng.standard_normal((12, 6))
W = rng.standard_normal((6, 4))


def square_sum(x, w):  # type: ignore[no-untyped-def]
    y = unimesh.psum(x @ w, "tp")  # x's columns and w's rows over tp: partial sums
    return unimesh.psum((y * y).sum(), "dp")


prog = unimesh.shard_map(square_sum, mesh, (P("dp", "tp"), P("tp", None)), P(), backend=be)
grad_w = unimesh.value_and_grad(prog, argnums=1, backend=be)


def placed(a, spec):  # type: ignore[no-untyped-def]
    return unimesh.distribute(a.astype(np.float32), Layout(mesh, spec), be)


def as_global(g):  # type: ignore[no-untyped-def]
    return unimesh.full_array(g, be) if isinstance(g, unimesh_mlx.MLXArray) else np.array(g)


calls = [  # (what changes, x, w)
    ("the in_specs' layouts", placed(X8, P("dp", "tp")), placed(W, P("tp", None))),
    ("numpy arguments", X8.astype(np.float32), W.astype(np.float32)),
    ("w laid out otherwise", placed(X8, P("dp", "tp")), placed(W, P(None, "tp"))),
    ("another shape", placed(X12, P("dp", "tp")), placed(W, P("tp", None))),
    ("the in_specs' layouts again", placed(X8, P("dp", "tp")), placed(W, P("tp", None))),
]
for what, x, w in calls * 2:
    xs = X8 if x.shape[0] == 8 else X12
    want = ((xs @ W) ** 2).sum()
    for grad_mode in (False, True, False):
        if grad_mode:
            value, g = grad_w(x, w)
            check(
                np.allclose(as_global(g), 2 * xs.T @ xs @ W, rtol=1e-4, atol=1e-4),
                f"replayed edges, {what}: the gradient is 2 X^T X W",
            )
        else:
            value = prog(x, w)
        check(
            np.isclose(float(np.array(unimesh.full_array(value, be))), want, rtol=1e-5),
            f"replayed edges, {what}, grad mode {grad_mode}: the value",
        )

# a program called inside another program's body continues the caller's chain of
# collectives: the caller's psum over tp, whose result only the tp=0 member uses, still runs
# on its tp=1 partner (before, the inner call started a chain of its own, the partner's graph
# dropped that psum and the tp=0 member waited for it forever: this case hung before the
# fix); an inner program on another mesh of the same processes joins the same chain, so every
# process runs the two programs' collectives in one order (that case checks the values; it
# did not hang before, MLX happening to walk both graphs in one order)
M, M2 = Mesh((2, 2), ("dp", "tp")), Mesh((4,), ("all",))
V, Z, Z2 = np.arange(4.0).reshape(2, 2), 10 * np.arange(4.0).reshape(2, 2), 100 * np.arange(4.0)
v_on, z_on = (
    unimesh.distribute(a.astype(np.float32), Layout(M, P("dp", "tp")), be) for a in (V, Z)
)
z2_on = unimesh.distribute(Z2.astype(np.float32), Layout(M2, P("all")), be)
summed_dp = unimesh.shard_map(
    lambda u: unimesh.psum(u, "dp"), M, P("dp", "tp"), P(None, "tp"), backend=be
)
summed_all = unimesh.shard_map(lambda u: unimesh.psum(u, "all"), M2, P("all"), P(), backend=be)
tp0 = np.arange(2)[None, :] == 0
for what, inner, whole in (
    ("the same mesh", lambda: summed_dp(z_on).local, np.broadcast_to(Z.sum(0), (2, 2))),
    ("another mesh", lambda: summed_all(z2_on).local.reshape(1, 1), np.full((2, 2), Z2.sum())),
):

    def body(b, inner=inner):  # type: ignore[no-untyped-def]
        s = unimesh.psum(b * 2.0, "tp")
        w = inner()
        return s + w if unimesh.axis_index("tp") == 0 else w * 1.0

    out = unimesh.shard_map(body, M, P("dp", "tp"), P("dp", "tp"), backend=be)(v_on)
    got = unimesh.full_array(out, be)
    want = whole + np.where(tp0, 2 * V.sum(1, keepdims=True), 0)
    check(np.allclose(got, want), f"a program inside a body, on {what}: {got.tolist()}")

check.done(f"RANK {rank}")
