"""One dp x tp MLP training step through unimesh.shard_map vs the same step written natively.

    python benchmarks/bench_step.py                      # runs all three below, prints a table
    python benchmarks/bench_step.py --backend jax        # 8 CPU devices, jitted, in process
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_step.py --backend torch
    mpirun --allow-run-as-root --oversubscribe -np 4 python benchmarks/bench_step.py --backend mlx

Two steps of examples/mlp_step.py's model (Megatron column/row split over "tp", batch over
"dp"): ``manual`` with a hand-written backward (``manual_step``), and ``grad``, the loss
differentiated by ``unimesh.value_and_grad`` against the framework's own autodiff idiom (JAX
``jax.value_and_grad`` of ``jax.shard_map``; torch Megatron-style autograd functions and a
DistributedDataParallel-style all-reduce of the gradients, after the backward and, in the
``grad/in_backward`` row, inside it, where DDP's hooks and unimesh's rules put it; MLX
``mx.value_and_grad`` with ``all_sum`` and an ``average_gradients``-style all-reduce). Each
native step is checked to compute the same loss and gradients as unimesh's before it is timed.
Native versions: JAX ``jax.shard_map`` with ``lax.psum``; torch local tensors of the DTensors,
``_functional_collectives.all_reduce`` on the DeviceMesh's groups and ``DTensor.from_local``;
MLX ``mx.distributed.all_sum`` on ``Group.split`` groups. The two are timed alternately in one
run; the ratio of medians is the figure (goal <= 1.02).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import mlp_step
import numpy as np
from _example import split

import unimesh
from unimesh import Layout, P


def dp_tp(n: int) -> dict[str, int]:
    """dp=2 and the rest over tp; on one device (one GPU) dp=1, tp=1 (the examples' split)."""
    return dict(zip(("dp", "tp"), split(n, 2)))


SPECS_IN = (P("dp", None), P("dp", None), P(None, "tp"), P("tp", None))


def manual_step(x, t, w1, w2):  # type: ignore[no-untyped-def]
    """examples/mlp_step.py's step with its backward written by hand (no autodiff)."""
    pre = x @ w1
    mask = pre > 0
    h = pre * mask
    y = unimesh.psum(h @ w2, "tp")
    n = x.shape[0] * unimesh.axis_size("dp")
    diff = y - t
    loss = unimesh.psum((diff * diff).sum(), "dp") / n
    dy = diff * (2.0 / n)
    dw2 = unimesh.psum(h.T @ dy, "dp")
    dh = (dy @ w2.T) * mask
    dw1 = unimesh.psum(x.T @ dh, "dp")
    return loss, w1 - mlp_step.LR * dw1, w2 - mlp_step.LR * dw2


SPECS_OUT = (P(), P(None, "tp"), P("tp", None))


def sizes(scale: int) -> None:
    mlp_step.BATCH, mlp_step.D_IN, mlp_step.HIDDEN, mlp_step.D_OUT = (
        16 * scale,
        8 * scale,
        32 * scale,
        4 * scale,
    )


def timed(
    pairs: dict[str, Callable[[], Any]],
    repeat: int,
    sync: Callable[[Any], Any],
    together: Callable[[], Any] | None = None,
    block: int = 10,
) -> dict[str, float]:
    """Median step time of each function, the functions alternating. In one process: single
    steps (synced by ``sync``). With several processes (``together`` is a barrier): blocks of
    ``block`` consecutive steps, each block starting on every process at once, timed to its
    end on this process and divided by ``block``. That is the step time of a training loop,
    and neither function is charged for the stragglers the other one left behind."""
    for f in pairs.values():  # warm up: compile, build groups
        sync(f())
    size = 1 if together is None else block
    times: dict[str, list[float]] = {k: [] for k in pairs}
    order = list(pairs.items())
    for i in range(max(1, repeat // size)):
        for name, f in order if i % 2 else order[::-1]:  # alternate who goes first
            if together is not None:
                together()
            start = time.perf_counter()
            for _ in range(size):
                sync(f())
            times[name].append((time.perf_counter() - start) / size)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_jax(repeat: int) -> dict[str, float]:
    backend = unimesh.get_backend("jax")
    n = backend.prepare_devices(8)
    import jax
    from jax import lax

    mesh = unimesh.make_mesh(dp_tp(n))
    jmesh = unimesh.to_native(mesh, backend)
    x, t, w1, w2 = (
        unimesh.distribute(a, Layout(mesh, s), backend=backend)
        for a, s in zip(mlp_step.data(), SPECS_IN)
    )

    def native_step(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        pre = x @ w1
        mask = pre > 0
        h = pre * mask
        y = lax.psum(h @ w2, "tp")
        n = x.shape[0] * lax.axis_size("dp")
        diff = y - t
        loss = lax.psum((diff * diff).sum(), "dp") / n
        dy = diff * (2.0 / n)
        dw2 = lax.psum(h.T @ dy, "dp")
        dw1 = lax.psum(x.T @ ((dy @ w2.T) * mask), "dp")
        return loss, w1 - mlp_step.LR * dw1, w2 - mlp_step.LR * dw2

    native = jax.jit(
        jax.shard_map(
            native_step,
            mesh=jmesh,
            in_specs=tuple(jax.P(*s) for s in SPECS_IN),
            out_specs=tuple(jax.P(*s) for s in SPECS_OUT),
        )
    )
    ours = jax.jit(unimesh.shard_map(manual_step, mesh, SPECS_IN, SPECS_OUT, backend=backend))

    def native_loss(x: Any, t: Any, p: Any) -> Any:
        pre = x @ p["w1"]
        h = pre * (pre > 0)
        diff = lax.psum(h @ p["w2"], "tp") - t
        return lax.pmean((diff * diff).sum() / x.shape[0], "dp")

    specs = {k: jax.P(*v) for k, v in mlp_step.SPECS.items()}
    native_program = jax.shard_map(
        native_loss,
        mesh=jmesh,
        in_specs=(jax.P("dp", None), jax.P("dp", None), specs),
        out_specs=jax.P(),
    )
    native_grad = jax.jit(jax.value_and_grad(lambda p: native_program(x, t, p)))
    our_program = unimesh.shard_map(
        mlp_step.loss, mesh, (P("dp", None), P("dp", None), mlp_step.SPECS), P(), backend=backend
    )
    our_grad = jax.jit(unimesh.value_and_grad(lambda p: our_program(x, t, p), backend=backend))
    params = {"w1": w1, "w2": w2}
    same(native_grad(params), our_grad(params))
    return timed(
        {
            "native": lambda: native(x, t, w1, w2),
            "unimesh": lambda: ours(x, t, w1, w2),
            "native_grad": lambda: native_grad(params),
            "unimesh_grad": lambda: our_grad(params),
        },
        repeat,
        jax.block_until_ready,
    )


def bench_torch(repeat: int) -> dict[str, float]:
    backend = unimesh.get_backend("torch")
    n = backend.prepare_devices(4)
    import torch
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.tensor import DTensor

    mesh = unimesh.make_mesh(dp_tp(n))
    placed = [
        unimesh.distribute(torch.as_tensor(a), Layout(mesh, s), backend=backend)
        for a, s in zip(mlp_step.data(), SPECS_IN)
    ]
    dm = placed[0].device_mesh
    outs = [unimesh.to_native(Layout(mesh, s), backend) for s in SPECS_OUT]

    def native_local(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        dp, tp = dm.get_group("dp"), dm.get_group("tp")
        pre = x @ w1
        mask = pre > 0
        h = pre * mask
        y = funcol.all_reduce(h @ w2, "sum", tp)
        n = x.shape[0] * dm.size(0)
        diff = y - t
        loss = funcol.all_reduce((diff * diff).sum(), "sum", dp) / n
        dy = diff * (2.0 / n)
        dw2 = funcol.all_reduce(h.T @ dy, "sum", dp)
        dw1 = funcol.all_reduce(x.T @ ((dy @ w2.T) * mask), "sum", dp)
        return loss, w1 - mlp_step.LR * dw1, w2 - mlp_step.LR * dw2

    def native() -> Any:  # eager: the same step, on this rank's blocks, results as DTensors
        results = native_local(*(a.to_local() for a in placed))
        return tuple(
            DTensor.from_local(r, dm, list(o.placements), run_check=False)
            for r, o in zip(results, outs)
        )

    ours = unimesh.shard_map(manual_step, mesh, SPECS_IN, SPECS_OUT, backend=backend)

    def sync(out: Any) -> Any:
        return [o.to_local().wait() if hasattr(o.to_local(), "wait") else o.to_local() for o in out]

    class Sum(torch.autograd.Function):  # Megatron's "g": all-reduce forward, identity backward
        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:
            out = x.clone()
            torch.distributed.all_reduce(out, group=group)
            return out

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g, None

    class Summed(torch.autograd.Function):  # identity forward, the gradient summed backward
        @staticmethod
        def forward(ctx: Any, w: Any, group: Any) -> Any:
            ctx.group = group
            return w.view_as(w)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            g = g.clone()  # copied before gloo's in-place sum, as unimesh's rule does
            torch.distributed.all_reduce(g, group=ctx.group)
            return g, None

    def native_grad(in_backward: bool = False) -> Any:
        """Megatron's f/g by hand, and DDP's sum of the weights' gradients over dp: after
        ``torch.autograd.grad`` returns (in place, back to back), or ``in_backward`` where
        each weight's backward falls (where DDP's hooks and unimesh's rules put it)."""
        x, t = placed[0].to_local(), placed[1].to_local()
        w1, w2 = (a.to_local().detach().requires_grad_(True) for a in placed[2:])
        dp, tp = dm.get_group("dp"), dm.get_group("tp")
        u1, u2 = (Summed.apply(w1, dp), Summed.apply(w2, dp)) if in_backward else (w1, w2)
        pre = x @ u1
        diff = Sum.apply((pre * (pre > 0)) @ u2, tp) - t
        loss = Sum.apply((diff * diff).sum() / x.shape[0], dp) / dm.size(0)
        grads = torch.autograd.grad(loss, (w1, w2))
        if not in_backward:  # summed already, in the backward, where in_backward
            for g in grads:
                torch.distributed.all_reduce(g, group=dp)
        return (
            loss,
            *(
                DTensor.from_local(g, dm, list(a.placements), run_check=False)
                for g, a in zip(grads, placed[2:])
            ),
        )

    our_program = unimesh.shard_map(
        mlp_step.loss, mesh, (P("dp", None), P("dp", None), mlp_step.SPECS), P(), backend=backend
    )
    params = {"w1": placed[2], "w2": placed[3]}
    our_vg = unimesh.value_and_grad(lambda p: our_program(placed[0], placed[1], p), backend=backend)

    def our_grad() -> Any:
        value, grads = our_vg(params)
        return value, grads["w1"], grads["w2"]

    def local(out: Any) -> Any:
        return [o.to_local() if isinstance(o, DTensor) else o for o in out]

    same(local(native_grad()), local(our_grad()))
    same(local(native_grad(in_backward=True)), local(our_grad()))

    # compiled (inductor, or TORCH_COMPILE_BACKEND): torch.compile of the native steps as
    # functions of this rank's blocks (functional collectives, which dynamo traces) against
    # unimesh.compile of the same unimesh steps; both return DTensors as the eager ones do
    how = os.environ.get("TORCH_COMPILE_BACKEND", "inductor")

    native_c = torch.compile(native_local, backend=how)
    blocks = [a.to_local() for a in placed]

    def native_compiled() -> Any:
        return tuple(
            DTensor.from_local(r, dm, list(o.placements), run_check=False)
            for r, o in zip(native_c(*blocks), outs)
        )

    def native_grad_local(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        dp, tp = dm.get_group("dp"), dm.get_group("tp")
        pre = x @ w1
        diff = Sum.apply((pre * (pre > 0)) @ w2, tp) - t
        loss = Sum.apply((diff * diff).sum() / x.shape[0], dp) / dm.size(0)
        grads = torch.autograd.grad(loss, (w1, w2))
        return loss, *(funcol.all_reduce(g, "sum", dp) for g in grads)

    native_grad_c = torch.compile(native_grad_local, backend=how)
    # the same native step compiled whole, as unimesh.compile compiles a value_and_grad step:
    # dynamo traces its torch.autograd.grad (trace_autograd_ops) instead of breaking the graph
    native_whole_c = torch.compile(native_grad_local, backend=how, fullgraph=True)

    def native_grad_whole() -> Any:
        config = torch._dynamo.config
        before = config.trace_autograd_ops
        config.trace_autograd_ops = True
        try:
            w1, w2 = (b.detach().requires_grad_(True) for b in blocks[2:])
            loss, *grads = native_whole_c(blocks[0], blocks[1], w1, w2)
        finally:
            config.trace_autograd_ops = before
        return (
            loss,
            *(
                DTensor.from_local(g, dm, list(a.placements), run_check=False)
                for g, a in zip(grads, placed[2:])
            ),
        )

    def native_grad_compiled() -> Any:
        w1, w2 = (b.detach().requires_grad_(True) for b in blocks[2:])
        loss, *grads = native_grad_c(blocks[0], blocks[1], w1, w2)
        return (
            loss,
            *(
                DTensor.from_local(g, dm, list(a.placements), run_check=False)
                for g, a in zip(grads, placed[2:])
            ),
        )

    ours_c = unimesh.compile(
        ours, backend=backend, compiler_options={"backend": how}, fullgraph=True
    )
    our_vg_c = unimesh.compile(
        unimesh.value_and_grad(lambda p: our_program(placed[0], placed[1], p), backend=backend),
        backend=backend,
        compiler_options={"backend": how},
        fullgraph=True,
    )

    def our_grad_c() -> Any:
        value, grads = our_vg_c(params)
        return value, grads["w1"], grads["w2"]

    same(local(native_compiled()), local(ours_c(*placed)))
    same(local(native_grad_compiled()), local(our_grad_c()))
    try:
        same(local(native_grad_whole()), local(our_grad_c()))
        whole: dict[str, Any] = {"native_grad_whole": native_grad_whole}
    except Exception as exc:  # noqa: BLE001 - what dynamo says of the native step
        print(f"NOTE native step not compiled whole: {type(exc).__name__}: {str(exc)[:300]}")
        whole = {}
    return timed(
        {
            "native": native,
            "unimesh": lambda: ours(*placed),
            "native_grad": native_grad,
            "native_grad_in_backward": lambda: native_grad(in_backward=True),
            "unimesh_grad": our_grad,
            "native_compiled": native_compiled,
            "unimesh_compiled": lambda: ours_c(*placed),
            "native_grad_compiled": native_grad_compiled,
            "unimesh_grad_compiled": our_grad_c,
            **whole,
        },
        repeat,
        sync_all,
        torch.distributed.barrier,
    )


def mlx_steps(backend: Any, n: int) -> Any:
    """(mesh, placed MLXArrays, their blocks, the native manual step, the native gradient
    step): the native steps as functions of this process's blocks, as an MLX user writes
    them."""
    import mlx.core as mx

    mesh = unimesh.make_mesh(dp_tp(n))
    placed = [
        unimesh.distribute(a, Layout(mesh, s), backend=backend)
        for a, s in zip(mlp_step.data(), SPECS_IN)
    ]
    native_mesh = unimesh.to_native(mesh, backend)
    dp, tp = native_mesh.axis_group("dp").group, native_mesh.axis_group("tp").group
    if dp is None:
        raise SystemExit("the MLX benchmark needs split groups: run it under mpirun")

    # the native steps as functions of this process's blocks, as an MLX user writes them
    # (mx.distributed.all_sum differentiates to itself: the loss sums only where the
    # cotangent is whole, Megatron's g); timed eager, and under mx.compile below
    def native_step(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        pre = x @ w1
        mask = pre > 0
        h = pre * mask
        y = mx.distributed.all_sum(h @ w2, group=tp)
        n = x.shape[0] * dp.size()
        diff = y - t
        loss = mx.distributed.all_sum((diff * diff).sum(), group=dp) / n
        dy = diff * (2.0 / n)
        dw2 = mx.distributed.all_sum(h.T @ dy, group=dp)
        dw1 = mx.distributed.all_sum(x.T @ ((dy @ w2.T) * mask), group=dp)
        return loss, w1 - mlp_step.LR * dw1, w2 - mlp_step.LR * dw2

    def native_loss_of(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        pre = x @ w1
        diff = mx.distributed.all_sum((pre * (pre > 0)) @ w2, group=tp) - t
        loss = mx.distributed.all_sum((diff * diff).sum() / x.shape[0], group=dp)
        return loss / dp.size()

    native_vg_of = mx.value_and_grad(native_loss_of, argnums=(2, 3))

    def native_grad_step(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        loss, grads = native_vg_of(x, t, w1, w2)
        return (loss, *(mx.distributed.all_sum(g, group=dp) for g in grads))

    arrays = [a.local for a in placed]
    return mesh, placed, arrays, native_step, native_grad_step


def bench_mlx(repeat: int) -> dict[str, float]:
    backend = unimesh.get_backend("mlx")
    n = backend.prepare_devices(4)
    import mlx.core as mx

    mesh, placed, arrays, native_step, native_grad_step = mlx_steps(backend, n)

    def native() -> Any:
        return native_step(*arrays)

    ours = unimesh.shard_map(manual_step, mesh, SPECS_IN, SPECS_OUT, backend=backend)

    def sync(out: Any) -> Any:
        mx.eval(*[o.local if hasattr(o, "local") else o for o in out])

    def native_grad() -> Any:  # with average_gradients' all-reduce over dp
        return native_grad_step(*arrays)

    our_program = unimesh.shard_map(
        mlp_step.loss, mesh, (P("dp", None), P("dp", None), mlp_step.SPECS), P(), backend=backend
    )
    params = {"w1": placed[2], "w2": placed[3]}
    our_vg = unimesh.value_and_grad(lambda p: our_program(placed[0], placed[1], p), backend=backend)

    def our_grad() -> Any:
        value, grads = our_vg(params)
        return value, grads["w1"].local, grads["w2"].local

    same([np.array(a) for a in native_grad()], [np.array(a) for a in our_grad()])

    # compiled: mx.compile of the native steps against unimesh.compile of the same unimesh steps
    native_c = mx.compile(native_step)
    native_grad_c = mx.compile(native_grad_step)
    ours_c = unimesh.compile(ours, backend=backend)
    our_vg_c = unimesh.compile(
        unimesh.value_and_grad(our_program, argnums=2, backend=backend), backend=backend
    )

    def our_grad_c() -> Any:
        value, grads = our_vg_c(placed[0], placed[1], params)
        return value, grads["w1"].local, grads["w2"].local

    same([np.array(a) for a in native_c(*arrays)], [np.array(a.local) for a in ours_c(*placed)])
    same([np.array(a) for a in native_grad_c(*arrays)], [np.array(a) for a in our_grad_c()])
    return timed(
        {
            "native": native,
            "unimesh": lambda: ours(*placed),
            "native_grad": native_grad,
            "unimesh_grad": our_grad,
            "native_compiled": lambda: native_c(*arrays),
            "unimesh_compiled": lambda: ours_c(*placed),
            "native_grad_compiled": lambda: native_grad_c(*arrays),
            "unimesh_grad_compiled": our_grad_c,
        },
        repeat,
        sync,
        lambda: mx.eval(mx.distributed.all_sum(mx.array(0.0))),  # a barrier
    )


def same(native: Any, ours: Any) -> None:
    """The native program computes what unimesh's does (loss and gradients), or no timing."""
    import optree

    for a, b in zip(optree.tree_leaves(native), optree.tree_leaves(ours), strict=True):
        a, b = (
            np.asarray(unimesh.full_array(v) if not isinstance(v, np.ndarray) else v)
            for v in (a, b)
        )
        if not np.allclose(a, b, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"the native step and unimesh's differ: {a} vs {b}")


def sync_all(out: Any) -> Any:
    return out


def report(backend: str, scale: int, medians: dict[str, float]) -> str:
    lines = []
    for step, (a, b) in {
        "manual": ("native", "unimesh"),
        "grad": ("native_grad", "unimesh_grad"),
        "grad/in_backward": ("native_grad_in_backward", "unimesh_grad"),
        "manual/compiled": ("native_compiled", "unimesh_compiled"),
        "grad/compiled": ("native_grad_compiled", "unimesh_grad_compiled"),
        "grad/whole": ("native_grad_whole", "unimesh_grad_compiled"),
    }.items():
        if a not in medians:
            continue
        ratio = medians[b] / medians[a]
        lines.append(
            f"BENCH {backend:6s} step={step:15s} scale={scale:<3d} "
            f"native={medians[a] * 1e3:8.3f} ms unimesh={medians[b] * 1e3:8.3f} ms "
            f"ratio={ratio:.3f}"
        )
    return "\n".join(lines)


#: four MPI processes on this machine (mpirun as root, more processes than cores)
MPIRUN4 = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4"]


def collect(repeat: int, scales: list[int]) -> dict[str, list[str] | str]:
    """Run every backend's step benchmark under its launcher; its BENCH lines, or why none."""
    here = str(Path(__file__).resolve())
    extra = ["--repeat", str(repeat), "--scales", ",".join(map(str, scales))]
    runs = {
        "jax": [sys.executable, here, "--backend", "jax", *extra],
        "torch": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            here,
            "--backend",
            "torch",
            *extra,
        ],
        "mlx": [*MPIRUN4, sys.executable, here, "--backend", "mlx", *extra],
    }
    return launched(runs, 600)


def launched(
    runs: dict[str, list[str]], timeout: float, prefix: str = "BENCH"
) -> dict[str, list[str] | str]:
    """Each command run with one OpenMP thread per process: its result lines (starting with
    ``prefix``), or why none."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results: dict[str, list[str] | str] = {}
    for name, cmd in runs.items():
        try:
            out = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False
            ).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            results[name] = f"not run ({exc})"
            continue
        lines = [ln for ln in out.splitlines() if ln.startswith(prefix)]
        results[name] = lines or f"no result: {out[-300:]}"
    return results


def launch_all(repeat: int, scales: list[int]) -> None:
    print("step time, median of alternating runs; ratio = unimesh / native (goal <= 1.02)")
    for name, lines in collect(repeat, scales).items():
        print("\n".join(lines) if isinstance(lines, list) else f"{name}: {lines}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["jax", "torch", "mlx"])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--scales", default="1,8", help="sizes: 1 = the example's, k = k times")
    args = parser.parse_args()
    scales = [int(s) for s in args.scales.split(",")]
    if args.backend is None:
        launch_all(args.repeat, scales)
        return
    run = {"jax": bench_jax, "torch": bench_torch, "mlx": bench_mlx}[args.backend]
    rank = next(
        (int(os.environ[v]) for v in ("RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ), 0
    )
    for scale in scales:
        sizes(scale)
        medians = run(args.repeat)
        if rank == 0:
            print(report(args.backend, scale, medians), flush=True)


if __name__ == "__main__":
    main()
