"""The example programs' training steps through unimesh vs the same programs written natively.

    python benchmarks/bench_programs.py                  # jax, then torch under torchrun 4
    python benchmarks/bench_programs.py --backend jax    # 8 CPU devices, jitted, in process
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_programs.py --backend torch
    python benchmarks/bench_programs.py --scales 1,32    # also 32x larger matrices (gather.py)

For ``examples/fsdp_step.py``, ``tp_sp_block.py``, ``moe_layer.py`` and ``pipeline.py``: one
step is the loss and its gradient with respect to the parameters. The unimesh step is the
example's own ``unimesh.value_and_grad`` of its ``unimesh.shard_map`` program. The native step
runs the example's loss function with its collectives taken from the framework instead (the
``unimesh`` name in its globals bound to a namespace of native calls; the array code is the
same text):

- JAX: ``jax.lax`` collectives in ``jax.shard_map``, ``jax.value_and_grad``, ``jax.jit``;
- torch: local tensors of the DTensors, the differentiable functional collectives torch ships
  (``all_gather_tensor_autograd``, ``reduce_scatter_tensor_autograd``,
  ``all_to_all_single_autograd``), Megatron's all-reduce with an identity backward, a
  send/recv permutation, ``torch.autograd.grad``, and a DistributedDataParallel-style
  all-reduce of each parameter's gradient over the axes it is replicated on.

MLX has none of all-to-all, reduce-scatter (MPI) or a differentiable all-gather, so a native
MLX version of these programs is the rules unimesh's engine holds, written again; only
``bench_step.py`` compares MLX. Each native step is checked to give the same loss and gradients
before it is timed; the two are timed alternately in one run; the figure is the ratio of
medians.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import bench_step
import fsdp_step
import moe_layer
import numpy as np
import pipeline
import tp_sp_block

import unimesh
from unimesh import Layout, P

EXAMPLES = ("fsdp", "tp_sp", "moe", "pipeline")
#: each example's size constants, as the example sets them (``scaled`` multiplies them)
SIZES = {
    "fsdp": (fsdp_step, ("BATCH", "D_IN", "HIDDEN", "D_OUT")),
    "tp_sp": (tp_sp_block, ("SEQ", "D_MODEL", "D_FF")),
    "moe": (moe_layer, ("TOKENS_PER_DEVICE", "D_MODEL")),
    "pipeline": (pipeline, ("MICROBATCH", "D_MODEL")),
}
_BASE = {name: tuple(getattr(m, c) for c in cs) for name, (m, cs) in SIZES.items()}


def scaled(name: str, scale: int) -> None:
    """The example's sizes times ``scale`` (1: as the example has them). The mesh, the
    layouts, the number of microbatches and of experts per device stay; the matrices grow,
    so that at a large enough scale the step's arithmetic, not its collectives' latency,
    sets its time (realistic steps)."""
    module, constants = SIZES[name]
    for c, base in zip(constants, _BASE[name]):
        setattr(module, c, base * scale)


def problem(
    name: str, n: int
) -> tuple[Any, dict[str, int], tuple[Any, Any, Any], list[np.ndarray], Any]:
    """(example module, mesh axes, in_specs, [x, t, params...], parameter tree) at the
    example's size, as its main() builds them."""
    if name == "fsdp":
        m = fsdp_step
        rng = np.random.default_rng(0)
        x = rng.standard_normal((m.BATCH, m.D_IN)).astype(np.float32)
        t = rng.standard_normal((m.BATCH, m.D_OUT)).astype(np.float32)
        params = {
            "w1": rng.standard_normal((m.D_IN, m.HIDDEN)).astype(np.float32) / 4,
            "w2": rng.standard_normal((m.HIDDEN, m.D_OUT)).astype(np.float32) / 6,
        }
        return m, {"fsdp": n}, (P("fsdp"), P("fsdp"), m.SPECS), [x, t], params
    if name == "tp_sp":
        m = tp_sp_block
        rng = np.random.default_rng(1)
        x = rng.standard_normal((m.BATCH, m.SEQ, m.D_MODEL)).astype(np.float32)
        t = rng.standard_normal((m.BATCH, m.SEQ, m.D_MODEL)).astype(np.float32)
        params = {
            "w1": rng.standard_normal((m.D_MODEL, m.D_FF)).astype(np.float32) / 3,
            "w2": rng.standard_normal((m.D_FF, m.D_MODEL)).astype(np.float32) / 6,
        }
        return m, bench_step.dp_tp(n), (m.ACTS, m.ACTS, m.SPECS), [x, t], params
    if name == "moe":
        m = moe_layer
        rng = np.random.default_rng(2)
        e = m.EXPERTS_PER_DEVICE * n
        x = rng.standard_normal((m.TOKENS_PER_DEVICE * n, m.D_MODEL)).astype(np.float32)
        t = rng.standard_normal((m.TOKENS_PER_DEVICE * n, m.D_MODEL)).astype(np.float32)
        params = {
            "router": rng.standard_normal((m.D_MODEL, e)).astype(np.float32),
            "experts": rng.standard_normal((e, m.D_MODEL, m.D_MODEL)).astype(np.float32) / 3,
        }
        return m, {"ep": n}, (P("ep"), P("ep"), m.SPECS), [x, t], params
    m = pipeline
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m.MICROBATCHES, m.MICROBATCH, m.D_MODEL)).astype(np.float32)
    t = rng.standard_normal((m.MICROBATCHES, m.MICROBATCH, m.D_MODEL)).astype(np.float32)
    w = rng.standard_normal((m.STAGES, m.D_MODEL, m.D_MODEL)).astype(np.float32) / 3
    return m, {"pp": m.STAGES, "dp": n // m.STAGES}, (m.DATA, m.DATA, P("pp")), [x, t], w


def with_collectives(fn: Any, namespace: Any) -> Any:
    """``fn`` with the name ``unimesh`` in its globals bound to ``namespace``: the same code
    calling the framework's collectives."""
    return types.FunctionType(
        fn.__code__,
        {**fn.__globals__, "unimesh": namespace},
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,
    )


def placed(tree: Any, specs: Any, mesh: unimesh.Mesh, backend: Any) -> Any:
    if isinstance(tree, dict):
        return {k: placed(v, specs[k], mesh, backend) for k, v in tree.items()}
    return unimesh.distribute(tree, Layout(mesh, specs), backend=backend)


# -- JAX -------------------------------------------------------------------------------------------
def jax_namespace() -> Any:
    from jax import lax

    def all_gather(x: Any, axis: Any, dim: int = 0, tiled: bool = True, to: str = "varying") -> Any:
        return lax.all_gather(x, axis, axis=dim, tiled=tiled)

    return types.SimpleNamespace(
        psum=lax.psum,
        pmean=lax.pmean,
        all_gather=all_gather,
        psum_scatter=lambda x, axis, scatter_dimension=0, tiled=False: lax.psum_scatter(
            x, axis, scatter_dimension=scatter_dimension, tiled=tiled
        ),
        all_to_all=lambda x, axis, split_axis, concat_axis, tiled=False: lax.all_to_all(
            x, axis, split_axis, concat_axis, tiled=tiled
        ),
        ppermute=lambda x, axis, perm: lax.ppermute(x, axis, perm),
        axis_index=lax.axis_index,
        axis_size=lax.axis_size,
    )


def bench_jax(name: str, n: int, repeat: int) -> dict[str, float]:
    import jax

    backend = unimesh.get_backend("jax")
    module, axes, specs, data, params = problem(name, n)
    mesh = unimesh.make_mesh(axes)
    xs, ts = (placed(a, s, mesh, backend) for a, s in zip(data, specs))
    ps = placed(params, specs[2], mesh, backend)
    program = unimesh.shard_map(module.loss, mesh, specs, P(), backend=backend)
    ours = jax.jit(unimesh.value_and_grad(lambda p: program(xs, ts, p), backend=backend))

    def jspec(tree: Any) -> Any:
        if isinstance(tree, dict):
            return {k: jspec(v) for k, v in tree.items()}
        return jax.P(*tree)

    native_program = jax.shard_map(
        with_collectives(module.loss, jax_namespace()),
        mesh=unimesh.to_native(mesh, backend),
        in_specs=tuple(jspec(s) for s in specs),
        out_specs=jax.P(),
    )
    native = jax.jit(jax.value_and_grad(lambda p: native_program(xs, ts, p)))
    bench_step.same(native(ps), ours(ps))
    return bench_step.timed(
        {"native_grad": lambda: native(ps), "unimesh_grad": lambda: ours(ps)},
        repeat,
        jax.block_until_ready,
    )


# -- torch -----------------------------------------------------------------------------------------
def torch_namespace(device_mesh: Any) -> Any:
    """The collectives a torch user writes by hand over a DeviceMesh's groups."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    groups: dict[Any, Any] = {}

    def group(axis: Any) -> Any:
        if axis not in groups:
            names = (axis,) if isinstance(axis, str) else tuple(axis)
            groups[axis] = (
                device_mesh.get_group(names[0])
                if len(names) == 1
                else device_mesh[names]._flatten("bench_" + "_".join(names)).get_group()
            )
        return groups[axis]

    class AllReduce(torch.autograd.Function):  # Megatron's "g": sum forward, identity backward
        @staticmethod
        def forward(ctx: Any, x: Any, pg: Any) -> Any:
            out = x.clone()
            dist.all_reduce(out, group=pg)
            return out

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g, None

    def send_recv(x: Any, pg: Any, pairs: list[tuple[int, int]]) -> Any:
        """Each (source, destination) pair of group ranks: x moves from one to the other."""
        me = dist.get_group_rank(pg, dist.get_rank())
        ops, out = [], None
        for src, dst in pairs:
            if src == me:
                ops.append(
                    dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(pg, dst), pg)
                )
            if dst == me:
                out = torch.empty_like(x)
                ops.append(dist.P2POp(dist.irecv, out, dist.get_global_rank(pg, src), pg))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return out if out is not None else torch.zeros_like(x)

    class Permute(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, pg: Any, pairs: Any) -> Any:
            ctx.pg, ctx.pairs = pg, pairs
            return send_recv(x, pg, pairs)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return send_recv(g, ctx.pg, [(d, s) for s, d in ctx.pairs]), None, None

    scatter = getattr(
        funcol,
        "reduce_scatter_single_autograd",  # torch >= 2.13
        getattr(funcol, "reduce_scatter_tensor_autograd", None),
    )
    gather = getattr(
        funcol, "all_gather_single_autograd", getattr(funcol, "all_gather_tensor_autograd", None)
    )

    def size(axis: Any) -> int:
        return int(dist.get_world_size(group(axis)))

    def all_to_all(
        x: Any, axis: Any, split_axis: int, concat_axis: int, tiled: bool = False
    ) -> Any:
        n = size(axis)
        stacked = torch.stack(x.chunk(n, split_axis)).contiguous()  # piece j goes to j
        out = funcol.all_to_all_single_autograd(stacked, None, None, group(axis))
        return torch.cat(out.unbind(0), dim=concat_axis)  # piece j came from j

    return types.SimpleNamespace(
        psum=lambda x, axis: AllReduce.apply(x, group(axis)),
        pmean=lambda x, axis: AllReduce.apply(x, group(axis)) / size(axis),
        all_gather=lambda x, axis, dim=0, tiled=True, to="varying": gather(x, dim, group(axis)),
        psum_scatter=lambda x, axis, scatter_dimension=0, tiled=False: scatter(
            x, "sum", scatter_dimension, group(axis)
        ),
        all_to_all=all_to_all,
        ppermute=lambda x, axis, perm: Permute.apply(x, group(axis), list(perm)),
        axis_index=lambda axis: device_mesh.get_local_rank(axis),
        axis_size=size,
    )


def bench_torch(name: str, n: int, repeat: int) -> dict[str, float]:
    import optree
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    backend = unimesh.get_backend("torch")
    module, axes, specs, data, params = problem(name, n)
    mesh = unimesh.make_mesh(axes)
    xs, ts = (placed(torch.as_tensor(a), s, mesh, backend) for a, s in zip(data, specs))
    ps = placed(params, specs[2], mesh, backend)
    program = unimesh.shard_map(module.loss, mesh, specs, P(), backend=backend)
    ours = unimesh.value_and_grad(lambda p: program(xs, ts, p), backend=backend)

    device_mesh = xs.device_mesh
    native_loss = with_collectives(module.loss, torch_namespace(device_mesh))
    leaves, treedef = optree.tree_flatten(ps)
    spec_leaves = optree.tree_leaves(specs[2], is_leaf=lambda s: isinstance(s, P))
    spec_leaves = spec_leaves * len(leaves) if len(spec_leaves) == 1 else spec_leaves
    ddp = [
        [
            device_mesh.get_group(a)
            for a in mesh.axis_names
            if a not in s.axes() and mesh.axis_size(a) > 1
        ]
        for s in spec_leaves
    ]

    def native() -> Any:
        x, t = xs.to_local(), ts.to_local()
        local = [p.to_local().detach().requires_grad_(True) for p in leaves]
        value = native_loss(x, t, optree.tree_unflatten(treedef, local))
        grads = torch.autograd.grad(value, local)
        for g, groups in zip(grads, ddp):  # DistributedDataParallel: sum over the replicas
            for pg in groups:
                dist.all_reduce(g, group=pg)
        return value, optree.tree_unflatten(
            treedef,
            [
                DTensor.from_local(g, device_mesh, p.placements, run_check=False)
                for g, p in zip(grads, leaves)
            ],
        )

    def local(out: Any) -> Any:
        return [v.to_local() if isinstance(v, DTensor) else v for v in optree.tree_leaves(out)]

    bench_step.same(local(native()), local(ours(ps)))
    return bench_step.timed(
        {"native_grad": native, "unimesh_grad": lambda: ours(ps)},
        repeat,
        bench_step.sync_all,
        dist.barrier,
    )


def line(backend: str, name: str, medians: dict[str, float], scale: int = 1) -> str:
    a, b = medians["native_grad"], medians["unimesh_grad"]
    return (
        f"BENCH {backend:6s} program={name:9s} scale={scale:<3d} native={a * 1e3:8.3f} ms "
        f"unimesh={b * 1e3:8.3f} ms ratio={b / a:.3f}"
    )


def collect(repeat: int, scales: str = "1") -> dict[str, list[str] | str]:
    """Every backend's program benchmarks under its launcher: BENCH lines, or why none."""
    here = str(Path(__file__).resolve())
    extra = ["--repeat", str(repeat), "--scales", scales]
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
    }
    return bench_step.launched(runs, 900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["jax", "torch"])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--programs", default=",".join(EXAMPLES))
    parser.add_argument(
        "--scales",
        default="1",
        help="sizes: 1 = the example's, k = its matrices k times larger in each dimension",
    )
    args = parser.parse_args()
    if args.backend is None:
        print(
            "step time (loss and gradients), median of alternating runs; ratio = unimesh / native"
        )
        for name, lines in collect(args.repeat, args.scales).items():
            print("\n".join(lines) if isinstance(lines, list) else f"{name}: {lines}")
        return
    run = {"jax": bench_jax, "torch": bench_torch}[args.backend]
    n = unimesh.get_backend(args.backend).prepare_devices(8 if args.backend == "jax" else 4)
    rank = int(os.environ.get("RANK", "0"))
    for scale in (int(k) for k in args.scales.split(",")):
        for name in args.programs.split(","):
            scaled(name, scale)
            medians = run(name, n, args.repeat)
            if rank == 0:
                print(line(args.backend, name, medians, scale), flush=True)


if __name__ == "__main__":
    main()
