"""``unimesh.reshard`` against each framework's own verb, in one run (issue 53, item 6).

    python benchmarks/bench_reshard.py [--mib 16] [--json FILE]

- planning: ``unimesh.moves.plan`` for one process of 2**16 (one device each), an all-to-all
  (rows to columns over one axis) and a 2-D swap; and a cache hit;
- JAX, 8 CPU devices in this process: the same mesh with another spec against
  ``jax.jit(lambda a: a, out_shardings=...)`` (the compiled reshard, what ``jax.reshard`` does
  inside ``jit``) and ``jax.device_put(x, sharding)``; another mesh (devices 0-3 to 4-7)
  against ``jax.device_put``;
- torch, torchrun 4 (gloo): ``DTensor.redistribute`` on the cases it takes, and a move to
  another mesh that it refuses;
- MLX, mpirun 4: against the hand-written ``all_gather`` and slice.

Each figure is the median of interleaved repetitions (these machines are shared and noisy);
a ratio below 1 means unimesh is faster. Bytes are unimesh's ``stats`` per process beside the
minimum the plan guarantees and, for the gather idioms, what they receive.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _median_pair(a: Any, b: Any, repeat: int) -> tuple[float, float]:
    """Medians of ``a()`` and ``b()`` run alternately."""
    ta, tb = [], []
    a()
    b()  # warm: compile caches, plan caches
    for _ in range(repeat):
        t = time.perf_counter()
        a()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        b()
        tb.append(time.perf_counter() - t)
    return float(np.median(ta)), float(np.median(tb))


def planning() -> dict[str, Any]:
    from unimesh import Layout, Mesh, P
    from unimesh.moves import clear_cache, plan

    n = 1 << 16
    out: dict[str, Any] = {}
    line = Mesh((n,), ("x",))
    grid = Mesh((n // 8, 8), ("d", "t"))
    cases = {
        "all-to-all, rows to columns": (Layout(line, P("x")), Layout(line, P(None, "x"))),
        "2-D swap, (d, t) to (t, d)": (Layout(grid, P("d", "t")), Layout(grid, P("t", "d"))),
    }
    where = np.arange(n)
    for name, (a, b) in cases.items():
        times = []
        for _ in range(3):
            clear_cache()
            t = time.perf_counter()
            p = plan(a, b, (n * 2, n * 2), 4, where, 12345)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        plan(a, b, (n * 2, n * 2), 4, where, 12345)
        hit = time.perf_counter() - t
        out[name] = {
            "devices": n,
            "seconds": float(np.median(times)),
            "cache_hit_seconds": hit,
            "peers": len(p.receive),
            "bytes_received": p.bytes_received,
        }
    return out


def jax_part(mib: int, repeat: int) -> dict[str, Any]:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax

    import unimesh
    from unimesh import Layout, Mesh, P

    side = int((mib * 2**20 / 4) ** 0.5) // 8 * 8
    x = np.arange(side * side, dtype=np.float32).reshape(side, side)
    mesh = Mesh((2, 4), ("dp", "tp"))
    out: dict[str, Any] = {"shape": [side, side]}

    src = unimesh.distribute(x, Layout(mesh, P("dp")), "jax")
    target = Layout(mesh, P(None, "tp"))
    sharding = unimesh.to_native(target, "jax")
    ident = jax.jit(lambda a: a, out_shardings=sharding)
    stats: dict[str, int] = {}
    unimesh.reshard(src, target, stats=stats)
    ours, jit = _median_pair(
        lambda: unimesh.reshard(src, target).block_until_ready(),
        lambda: ident(src).block_until_ready(),
        repeat,
    )
    _, put = _median_pair(
        lambda: None, lambda: jax.device_put(src, sharding).block_until_ready(), repeat
    )
    out["same mesh, P('dp') -> P(None, 'tp')"] = {
        "unimesh_s": ours,
        "jit_out_shardings_s": jit,
        "device_put_s": put,
        "ratio_vs_jit": ours / jit,
        "ratio_vs_device_put": ours / put,
        "bytes_copied": stats["bytes_copied"],
        "array_bytes": x.nbytes,
    }

    def against_device_put(src: Any, target: Layout) -> dict[str, Any]:
        """``unimesh.reshard`` of ``src`` to ``target`` beside ``jax.device_put``."""
        sharding = unimesh.to_native(target, "jax")
        stats: dict[str, int] = {}
        unimesh.reshard(src, target, stats=stats)
        ours, put = _median_pair(
            lambda: unimesh.reshard(src, target).block_until_ready(),
            lambda: jax.device_put(src, sharding).block_until_ready(),
            repeat,
        )
        return {
            "unimesh_s": ours,
            "device_put_s": put,
            "ratio_vs_device_put": ours / put,
            "bytes_copied": stats["bytes_copied"],
            "array_bytes": x.nbytes,
        }

    # a reshard to the layout the array has: nothing moves (generic code that reshards
    # whatever it is given); device_put to the sharding it has returns the array
    out["nothing moves, P('dp') -> P('dp')"] = against_device_put(src, Layout(mesh, P("dp")))

    low = Mesh((4,), ("x",), device_ids=[0, 1, 2, 3])
    high = Mesh((4,), ("y",), device_ids=[4, 5, 6, 7])
    src = unimesh.distribute(x, Layout(low, P("x")), "jax")
    out["other devices, 0-3 P('x') -> 4-7 P(None, 'y')"] = against_device_put(
        src, Layout(high, P(None, "y"))
    )
    return out


def torch_worker(mib: int, repeat: int, out: Path) -> None:
    """One rank under torchrun: unimesh.reshard against DTensor.redistribute."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    import unimesh
    from unimesh import Layout, Mesh, P

    rank, _ = unimesh.initialize("torch")
    side = int((mib * 2**20 / 4) ** 0.5) // 4 * 4
    x = np.arange(side * side, dtype=np.float32).reshape(side, side)
    square = Mesh((2, 2), ("dp", "tp"))
    results: dict[str, Any] = {}
    cases = {
        "rows on dp to columns on tp": (P("dp"), P(None, "tp"), [Replicate(), Shard(1)]),
        "(dp, tp) rows to (tp, dp) columns": (P(("dp", "tp")), P(None, ("tp", "dp")), None),
        "2-D swap, (dp, tp) to (tp, dp)": (P("dp", "tp"), P("tp", "dp"), None),
    }
    for name, (a, b, placements) in cases.items():
        src = unimesh.distribute(x, Layout(square, a), "torch")
        target = Layout(square, b)
        native = unimesh.to_native(target, "torch")
        stats: dict[str, int] = {}
        unimesh.reshard(src, target, stats=stats)

        def ours(src: Any = src, target: Layout = target) -> None:
            unimesh.reshard(src, target)
            dist.barrier()

        def theirs(src: Any = src, native: Any = native) -> None:
            src.redistribute(native.device_mesh, native.placements)
            dist.barrier()

        a_s, b_s = _median_pair(ours, theirs, repeat)
        results[name] = {
            "unimesh_s": a_s,
            "redistribute_s": b_s,
            "ratio": a_s / b_s,
            "bytes_received": stats["bytes_received"],
            "block_bytes": int(np.prod(target.shard_shape(x.shape, rank))) * 4,
        }
        del placements
    line = Mesh((4,), ("x",))
    src = unimesh.distribute(x, Layout(square, P("dp")), "torch")
    target = Layout(line, P(None, "x"))
    try:
        native = unimesh.to_native(target, "torch")
        src.redistribute(native.device_mesh, native.placements)
        refused = ""
    except Exception as exc:  # noqa: BLE001 - what torch says
        refused = f"{type(exc).__name__}: {exc}"
    stats = {}
    unimesh.reshard(src, target, stats=stats)
    t = []
    for _ in range(repeat):
        s = time.perf_counter()
        unimesh.reshard(src, target)
        dist.barrier()
        t.append(time.perf_counter() - s)
    results["another mesh, 2x2 rows to a line's columns"] = {
        "unimesh_s": float(np.median(t)),
        "redistribute": refused[:160],
        "bytes_received": stats["bytes_received"],
    }
    results["peak memory"] = _peak(rank, repeat)
    results["handoff to JAX"] = _handoff(x, square, rank, repeat)
    (out / f"torch-{rank}.json").write_text(json.dumps(results))
    del torch


def _peak(rank: int, repeat: int) -> dict[str, Any]:
    """Resident memory a reshard adds beyond its target block (sampled from /proc every
    millisecond by a thread): a 1 GiB float32 array, rows to columns over 4 ranks (each
    rank's 256 MiB block goes in 4 pieces of 64 MiB), with ``IN_FLIGHT`` 64 MiB and
    unbounded (one round)."""
    import threading

    import torch.distributed as dist

    import unimesh
    from unimesh import Layout, Mesh, P, moves

    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    line = Mesh((4,), ("x",))
    side = 16384
    whole = np.ones((side, side), np.float32)
    src = unimesh.distribute(whole, Layout(line, P("x")), "torch")
    src = unimesh.from_local({rank: src.to_local().clone()}, Layout(line, P("x")), whole.shape,
                             backend="torch")  # fmt: skip
    del whole
    target = Layout(line, P(None, "x"))
    block = side * side
    out: dict[str, Any] = {"block_mib": block / 2**20}
    for name, budget in (("bounded", moves.IN_FLIGHT), ("one round", 1 << 40)):
        kept, moves.IN_FLIGHT = moves.IN_FLIGHT, budget
        high = [0]
        done = threading.Event()

        def watch(high: list[int] = high, done: threading.Event = done) -> None:
            while not done.is_set():
                high[0] = max(high[0], resident())
                time.sleep(0.001)

        try:
            dist.barrier()
            before = resident()
            sampler = threading.Thread(target=watch)
            sampler.start()
            moved = unimesh.reshard(src, target)
            done.set()
            sampler.join()
            dist.barrier()
        finally:
            moves.IN_FLIGHT = kept
        out[f"{name}_peak_beyond_target_mib"] = (high[0] - before - block) / 2**20
        del moved
    del repeat
    return out


def _handoff(x: np.ndarray, square: Any, rank: int, repeat: int) -> dict[str, Any]:
    """A DTensor handed to JAX in the same 4 processes (jax.distributed, one CPU device each):
    ``unimesh.reshard(..., backend="jax")`` against what a user writes without it, the
    whole tensor on every process (``full_tensor``) and ``jax.make_array_from_callback``."""
    import os

    import jax
    import torch.distributed as dist

    import unimesh
    from unimesh import Layout, P

    if "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return {"skipped": "JAX_COORDINATOR_ADDRESS not set"}
    os.environ["JAX_PROCESS_ID"] = str(rank)
    unimesh.initialize("jax")
    src = unimesh.distribute(x, Layout(square, P("dp")), "torch")
    target = Layout(square, P(None, "tp"))
    sharding = unimesh.to_native(target, "jax")
    stats: dict[str, int] = {}
    unimesh.reshard(src, target, backend="jax", stats=stats)

    def ours() -> None:
        jax.block_until_ready(unimesh.reshard(src, target, backend="jax"))
        dist.barrier()

    def theirs() -> None:
        whole = src.full_tensor().numpy()
        jax.block_until_ready(
            jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])
        )
        dist.barrier()

    a_s, b_s = _median_pair(ours, theirs, repeat)
    return {
        "unimesh_s": a_s,
        "full_tensor_and_callback_s": b_s,
        "ratio": a_s / b_s,
        "bytes_received": stats["bytes_received"],
        "full_tensor_receives": x.nbytes - x.nbytes // 2,
    }


def mlx_worker(mib: int, repeat: int, out: Path) -> None:
    """One rank under mpirun: unimesh.reshard against all_gather and slice."""
    import mlx.core as mx

    import unimesh
    from unimesh import Layout, Mesh, P

    rank, world = unimesh.initialize("mlx")
    side = int((mib * 2**20 / 4) ** 0.5) // 4 * 4
    x = np.arange(side * side, dtype=np.float32).reshape(side, side)
    line = Mesh((world,), ("x",))
    source, target = Layout(line, P("x")), Layout(line, P(None, "x"))
    src = unimesh.distribute(x, source, "mlx")
    stats: dict[str, int] = {}
    unimesh.reshard(src, target, stats=stats)
    group = mx.distributed.init()
    cols = target.shard_slices(x.shape, rank)

    def ours() -> None:
        mx.eval(unimesh.reshard(src, target).local)

    def theirs() -> None:
        whole = mx.distributed.all_gather(src.local, group=group)
        mx.eval(whole[cols])

    a_s, b_s = _median_pair(ours, theirs, repeat)
    result = {
        "rows to columns over 4 ranks": {
            "unimesh_s": a_s,
            "all_gather_and_slice_s": b_s,
            "ratio": a_s / b_s,
            "bytes_received": stats["bytes_received"],
            "all_gather_receives": x.nbytes - src.local.nbytes,
        }
    }
    (out / f"mlx-{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(
    cmd: list[str], out: Path, prefix: str, extra: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra or {}))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    found = sorted(out.glob(f"{prefix}-*.json"))
    if proc.returncode != 0 or not found:
        return [{"error": (proc.stdout + proc.stderr)[-2000:]}]
    return [json.loads(f.read_text()) for f in found]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=["torch", "mlx"])
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker == "torch":
        torch_worker(args.mib, args.repeat, Path(args.out))
        return 0
    if args.worker == "mlx":
        mlx_worker(args.mib, args.repeat, Path(args.out))
        return 0
    report: dict[str, Any] = {"planning": planning()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        me = [str(Path(__file__).resolve()), "--mib", str(args.mib), "--repeat", str(args.repeat)]
        report["torch"] = _launch(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "4", *me, "--worker", "torch", "--out", tmp], out, "torch",
            {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": "4"},
        )  # fmt: skip
        report["mlx"] = _launch(
            ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable, *me,
             "--worker", "mlx", "--out", tmp], out, "mlx",
        )  # fmt: skip
    report["jax"] = jax_part(args.mib, args.repeat)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
