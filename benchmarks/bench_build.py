"""What building an eager unimesh step costs over the native step, in CPU time (issue 38's
eager budgets).

    mpirun --allow-run-as-root --oversubscribe -np 4 python benchmarks/bench_build.py --backend mlx
    python benchmarks/bench_build.py --backend torch     # one process, torch's fake group of 4

MLX is lazy: calling a step builds its graph and runs nothing, so the figure is the CPU time
(``time.process_time``) of building ``bench_step.py``'s manual and gradient steps (the example
MLP, 4 collectives, 4 arguments, 3 results), unimesh against native, and what is over native per
call against the budget of 5 us per collective plus 2 us per argument and result.

torch runs as it builds. Under its fake process group a collective does nothing, so the CPU time
of the manual step is the layer's own cost: unimesh's step against the native one (local
tensors, ``dist.all_reduce``, results as DTensors by ``DTensor.from_local``) run inside an
empty ``TorchFunctionMode`` (unimesh's check_vma rules watch the step through one), per torch
operation of the native step (budget: 1 us per op). And ``ppermute`` (a program of one
ppermute around a 4-member ring) against the hand-written ``batch_isend_irecv`` exchange
(budget: 1.25x).

Each pair is timed alternately in blocks; the figure is the median over blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import bench_step

import unimesh
from unimesh import Layout, P


def per_call(pair: dict[str, Callable[[], Any]], calls: int, blocks: int) -> dict[str, float]:
    """Median CPU microseconds per call of each function, timed alternately in blocks."""
    times: dict[str, list[float]] = {k: [] for k in pair}
    for f in pair.values():  # warm up: groups, caches, traces
        for _ in range(5):
            f()
    for _ in range(blocks):
        for name, f in pair.items():
            start = time.process_time()
            for _ in range(calls):
                f()
            times[name].append((time.process_time() - start) / calls * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_mlx(calls: int, blocks: int) -> list[str]:
    backend = unimesh.get_backend("mlx")
    n = backend.prepare_devices(4)
    mesh, placed, arrays, native_step, native_grad_step = bench_step.mlx_steps(backend, n)
    ours = unimesh.shard_map(
        bench_step.manual_step, mesh, bench_step.SPECS_IN, bench_step.SPECS_OUT, backend=backend
    )
    import mlp_step

    program = unimesh.shard_map(
        mlp_step.loss, mesh, (P("dp", None), P("dp", None), mlp_step.SPECS), P(), backend=backend
    )
    grad = unimesh.value_and_grad(program, argnums=2, backend=backend)
    params = {"w1": placed[2], "w2": placed[3]}
    # issue 55's budgets: 5 us per collective plus 2 per argument and result (4, 4 and 3)
    # for the manual step; the gradient step's, +60 us, as the issue states it
    budgets = {"manual": 5 * 4 + 2 * (4 + 3), "grad": 60}
    lines = []
    for step, pair in (
        ("manual", {"native": lambda: native_step(*arrays), "unimesh": lambda: ours(*placed)}),
        (
            "grad",
            {
                "native": lambda: native_grad_step(*arrays),
                "unimesh": lambda: grad(placed[0], placed[1], params),
            },
        ),
    ):
        t = per_call(pair, calls, blocks)
        over = t["unimesh"] - t["native"]
        lines.append(
            f"BUILD mlx    step={step:<8} native={t['native']:8.1f} us "
            f"unimesh={t['unimesh']:8.1f} us over={over:7.1f} us budget={budgets[step]} us"
        )
    return lines


def bench_torch(calls: int, blocks: int) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.overrides import TorchFunctionMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    backend = unimesh.get_backend("torch")
    import mlp_step

    mesh = unimesh.make_mesh(bench_step.dp_tp(4))
    placed = [
        unimesh.distribute(torch.as_tensor(a), Layout(mesh, s), backend=backend)
        for a, s in zip(mlp_step.data(), bench_step.SPECS_IN)
    ]
    dm = placed[0].device_mesh
    dp, tp = dm.get_group("dp"), dm.get_group("tp")
    outs = [unimesh.to_native(Layout(mesh, s), backend) for s in bench_step.SPECS_OUT]

    def summed(x: Any, group: Any) -> Any:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    def native_local(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        pre = x @ w1
        mask = pre > 0
        h = pre * mask
        y = summed(h @ w2, tp)
        n = x.shape[0] * dm.size(0)
        diff = y - t
        loss = summed((diff * diff).sum(), dp) / n
        dy = diff * (2.0 / n)
        dw2 = summed(h.T @ dy, dp)
        dw1 = summed(x.T @ ((dy @ w2.T) * mask), dp)
        return loss, w1 - mlp_step.LR * dw1, w2 - mlp_step.LR * dw2

    class Empty(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    class Count(TorchFunctionMode):
        ops = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def native() -> Any:
        with Empty():
            results = native_local(*(a.to_local() for a in placed))
        return [
            DTensor.from_local(r, dm, list(o.placements), run_check=False)
            for r, o in zip(results, outs)
        ]

    with Count():
        native_local(*(a.to_local() for a in placed))
    ours = unimesh.shard_map(
        bench_step.manual_step, mesh, bench_step.SPECS_IN, bench_step.SPECS_OUT, backend=backend
    )
    t = per_call({"native": native, "unimesh": lambda: ours(*placed)}, calls, blocks)
    over = t["unimesh"] - t["native"]
    line = (
        f"BUILD torch  step=manual   native={t['native']:8.1f} us unimesh={t['unimesh']:8.1f} us "
        f"over={over:7.1f} us ops={Count.ops} per_op={over / Count.ops:5.2f} us budget=1 us"
    )
    lines = [line]

    ring = unimesh.make_mesh({"pp": 4})
    block = unimesh.distribute(torch.ones(4 * 64, 64), Layout(ring, P("pp")), backend=backend)
    perm = [(i, (i + 1) % 4) for i in range(4)]
    shift = unimesh.shard_map(
        lambda x: unimesh.ppermute(x, "pp", perm), ring, P("pp"), P("pp"), backend=backend
    )
    ring_dm = block.device_mesh
    rank = dist.get_rank()

    def native_shift() -> Any:
        x = block.to_local()
        out = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, (rank + 1) % 4),
            dist.P2POp(dist.irecv, out, (rank - 1) % 4),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return DTensor.from_local(out, ring_dm, list(block.placements), run_check=False)

    t = per_call({"native": native_shift, "unimesh": lambda: shift(block)}, calls, blocks)
    lines.append(
        f"BUILD torch  step=ppermute native={t['native']:8.1f} us unimesh={t['unimesh']:8.1f} us "
        f"ratio={t['unimesh'] / t['native']:.2f} budget=1.25x"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["torch", "mlx"], required=True)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed block")
    parser.add_argument("--blocks", type=int, default=15)
    args = parser.parse_args()
    lines = (bench_mlx if args.backend == "mlx" else bench_torch)(args.calls, args.blocks)
    if args.backend == "torch" or unimesh.get_backend("mlx").process_index() == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
