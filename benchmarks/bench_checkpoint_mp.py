"""Checkpoint speed with 4 processes, side by side in one run (issue 37, item 3): torch DCP's
default writer and reader under torchrun 4 (gloo), MLX's ``mx.save_safetensors`` / ``mx.load``
plus slicing under mpirun 4, and unimesh on the same state and layouts in the same launch,
beside the limit measured there: every process's ``pwrite`` + ``fsync`` and ``pread`` (warm,
and cold after ``posix_fadvise(DONTNEED)``) of its own share of the bytes, at once.

    python benchmarks/bench_checkpoint_mp.py [--mib 1024] [--json FILE]   # both launches

The state is ``bench_checkpoint.state`` (float32 4096-column matrices, two bfloat16 copies,
replicated biases, one uneven 4097-row matrix), each matrix split by rows over the 4 processes
(P("x")), biases replicated. A figure is the slowest process's seconds, processes started
together by a barrier. Reshard: the same checkpoint loaded split by columns (P(None, "x")):
unimesh reads each block's byte runs; bytes read per process are printed beside the bytes it
holds, for unimesh, DCP (whose reader resolves each chunk's overlap) and the mlx-lm idiom (load
the whole file, then slice).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def worker(engine: str, work: Path, mib: int, out: Path) -> None:
    """One process of the launch: every measurement, its own seconds and bytes to a file."""
    import bench_checkpoint

    import unimesh
    from unimesh import Layout, P

    be = unimesh.get_backend(engine)
    n = be.prepare_devices(4)
    rank = be.process_index()
    mesh = unimesh.make_mesh({"x": n})
    values = bench_checkpoint.state(mib)
    rows = {k: Layout(mesh, P("x") if v.ndim == 2 else P()) for k, v in values.items()}
    cols = {k: Layout(mesh, P(None, "x") if v.ndim == 2 else P()) for k, v in values.items()}
    held = sum(
        int(np.prod([s.stop - s.start for s in lay.shard_slices(values[k].shape, rank)]))
        * values[k].dtype.itemsize
        for k, lay in rows.items()
    )
    if engine == "torch":
        import torch
        import torch.distributed as dist

        def barrier() -> None:
            dist.barrier()

        def slowest(seconds: float) -> float:
            t = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

    else:
        import mlx.core as mx

        def barrier() -> None:
            mx.eval(mx.distributed.all_sum(mx.array(1.0)))

        def slowest(seconds: float) -> float:
            return float(mx.distributed.all_max(mx.array(seconds)).item())

    placed = {k: unimesh.distribute(v, rows[k], backend=be) for k, v in values.items()}

    def together(fn: Any) -> float:
        """Seconds of ``fn`` run by every process at once: the slowest process's, so that
        the best of several trials is the best of whole trials."""
        barrier()
        t0 = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t0)

    total = sum(v.nbytes for v in values.values())
    # a save writes each block once (the unique bytes, balanced over the processes), a warm
    # load reads every block this process holds (replicas too): the floors on those sizes
    limit = bench_checkpoint.limits(work, held, together, f"limit-{rank}.bin", memcpy=False,
                                    written=total // n)  # fmt: skip
    report: dict[str, Any] = {"rank": rank, "bytes": total, "held": held, "limit": limit}
    times: dict[str, float] = {}
    read: dict[str, int] = {}
    # -- unimesh ------------------------------------------------------------------------------
    path = work / "unimesh"
    times["unimesh save (durable)"] = together(lambda: unimesh.save(path, placed))
    stats: dict[str, int] = {}

    def load(target: Any) -> None:
        got = unimesh.load(path, target, backend=be, stats=stats)
        if engine == "mlx":
            mx.eval(*[a.local for a in got.values()])

    load(rows)
    times["unimesh load warm"] = min(together(lambda: load(rows)) for _ in range(2))
    read["unimesh load"] = stats["bytes_read"]
    bench_checkpoint._drop_cache([path])
    times["unimesh load cold"] = together(lambda: load(rows))
    load(cols)
    times["unimesh load warm, reshard"] = min(together(lambda: load(cols)) for _ in range(2))
    read["unimesh load, reshard"] = stats["bytes_read"]
    report["held reshard"] = stats["bytes_held"]
    # -- the incumbent --------------------------------------------------------------------------
    if engine == "torch":
        import warnings

        import torch.distributed.checkpoint as dcp

        warnings.simplefilter("ignore")
        where = str(work / "dcp")
        times["DCP save"] = together(lambda: dcp.save(placed, checkpoint_id=where))
        into = {k: torch.zeros_like(v) for k, v in placed.items()}

        def dcp_load(target: dict[str, Any]) -> None:
            dcp.load(target, checkpoint_id=where)

        dcp_load(into)
        times["DCP load warm"] = min(together(lambda: dcp_load(into)) for _ in range(2))
        bench_checkpoint._drop_cache([work / "dcp"])
        times["DCP load cold"] = together(lambda: dcp_load(into))
        by_cols = {
            k: unimesh.distribute(torch.zeros(tuple(v.shape), dtype=v.dtype), cols[k], backend=be)
            for k, v in placed.items()
        }
        times["DCP load warm, reshard"] = min(together(lambda: dcp_load(by_cols)) for _ in "ab")
        # DCP's reader reads each chunk that overlaps a block whole: the bytes it reads
        files = [p for p in (work / "dcp").iterdir() if p.suffix == ".distcp"]
        read["DCP load, reshard (chunks overlapping its blocks)"] = _dcp_chunk_bytes(
            work / "dcp", cols, values, rank
        )
        report["DCP files"] = sum(p.stat().st_size for p in files)
    else:
        own = work / f"mx-{rank}.safetensors"
        local = {k: v.local for k, v in placed.items()}

        def mx_save() -> None:  # made durable like the others: fsync before it counts as done
            mx.save_safetensors(str(own), local)
            _sync_file(own)

        times["mx.save_safetensors + fsync (own blocks)"] = together(mx_save)

        def mx_load() -> None:
            mx.eval(*mx.load(str(own)).values())

        mx_load()
        times["mx.load warm (own blocks)"] = min(together(mx_load) for _ in range(2))
        bench_checkpoint._drop_cache([own])
        times["mx.load cold (own blocks)"] = together(mx_load)
        whole = work / "mx-whole.safetensors"
        if rank == 0:
            from unimesh_mlx.runtime import host_to_mx

            mx.save_safetensors(str(whole), {k: host_to_mx(v) for k, v in values.items()})
        barrier()

        def mlx_lm_reshard() -> None:  # mlx-lm's idiom: load the whole file, then slice
            got = mx.load(str(whole))
            mx.eval(*[got[k][lay.shard_slices(values[k].shape, rank)] for k, lay in cols.items()])

        mlx_lm_reshard()
        times["mx.load whole + slice, reshard"] = min(together(mlx_lm_reshard) for _ in "ab")
        read["mx.load whole + slice, reshard"] = whole.stat().st_size
    report["seconds"] = times
    report["read"] = read
    (out / f"{engine}-{rank}.json").write_text(json.dumps(report))


def incumbents(work: Path, n: int, out: Path) -> None:
    """One process of the incumbents' own setup (issue 54), torchrun 4 on a dp=2 x tp=2
    DeviceMesh: 8 float32 n x n DTensors alternating [Shard(0), Shard(1)] and [Replicate(),
    Shard(0)], 2 bfloat16 ones at [Shard(0), Shard(1)]. Saved by ``dcp.save(state)`` and
    ``unimesh.save``; loaded warm into the DTensors that exist (a restart's model: both fill
    them in place); then, the page cache dropped, into [Replicate(), Shard(1)] DTensors (a
    reshard). The limit: this process's share written with pwrite + fsync, read with pread
    into a buffer whose pages exist, every process at once."""
    import warnings

    import bench_checkpoint
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import unimesh

    warnings.simplefilter("ignore")
    unimesh.initialize("torch")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    kinds = [(torch.float32, [Shard(0), Shard(1)] if i % 2 == 0 else [Replicate(), Shard(0)])
             for i in range(8)] + [(torch.bfloat16, [Shard(0), Shard(1)])] * 2  # fmt: skip
    state = {f"w{i}": distribute_tensor(torch.randn(n, n, dtype=dtype), mesh, places)
             for i, (dtype, places) in enumerate(kinds)}  # fmt: skip
    total = sum(v.numel() * v.element_size() for v in state.values())
    held = sum(v.to_local().numel() * v.element_size() for v in state.values())

    def together(fn: Any) -> float:
        """As in :func:`worker`: the slowest process's seconds; each trial starts with no
        dirty pages (``os.sync`` first), so that no write pays for an earlier one's
        writeback."""
        os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def reshard_targets() -> dict[str, Any]:
        cols = [Replicate(), Shard(1)]
        return {k: distribute_tensor(torch.zeros(n, n, dtype=v.dtype), mesh, cols)
                for k, v in state.items()}  # fmt: skip

    # a save writes each block once (the unique bytes, balanced over the processes), a warm
    # load reads every block this process holds (replicas too): the floors on those sizes
    limit = bench_checkpoint.limits(work, held, together, f"limit-{rank}.bin", memcpy=False,
                                    written=total // dist.get_world_size())  # fmt: skip
    times: dict[str, float] = {}
    # the best of three saves, alternated, each to a new place and the earlier ones removed
    # (a job keeping its latest checkpoint), as the write floor is the best of three writes
    # of a file truncated before each (one write's time moves by 2x and more on this disk)
    saves: dict[str, list[float]] = {"DCP save": [], "unimesh save (durable)": []}
    ours, theirs = work / "unimesh", str(work / "dcp")
    for trial in range(3):
        if trial:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ours)
                shutil.rmtree(theirs)
        saves["DCP save"].append(together(partial(dcp.save, state, checkpoint_id=theirs)))
        saves["unimesh save (durable)"].append(together(partial(unimesh.save, ours, state)))
    times.update({k: min(v) for k, v in saves.items()})
    dcp.load(state, checkpoint_id=theirs)
    times["DCP load warm, in place"] = min(
        together(lambda: dcp.load(state, checkpoint_id=theirs)) for _ in "ab")  # fmt: skip
    unimesh.load(ours, state)
    times["unimesh load warm, in place"] = min(
        together(lambda: unimesh.load(ours, state)) for _ in "ab")  # fmt: skip
    # each cold load the median of three, as the floor's cold read (new targets each time)
    times["DCP load cold, reshard"] = bench_checkpoint.cold(
        lambda: together(partial(dcp.load, reshard_targets(), checkpoint_id=theirs)),
        [Path(theirs)],
    )
    stats: dict[str, int] = {}
    kept: list[Any] = []

    def ours_cold() -> float:
        kept[:] = [reshard_targets()]
        return together(lambda: unimesh.load(ours, kept[0], stats=stats))

    times["unimesh load cold, reshard"] = bench_checkpoint.cold(ours_cold, [ours])
    into = kept[0]
    ok = all(torch.equal(into[k].full_tensor(), state[k].full_tensor()) for k in state)
    report = {"rank": rank, "bytes": total, "held": held, "limit": limit, "seconds": times,
              "trials": saves,
              "read": {"unimesh load, reshard": stats["bytes_read"]},
              "held reshard": stats["bytes_held"], "equal": ok}  # fmt: skip
    (out / f"incumbents-{rank}.json").write_text(json.dumps(report))


def _sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp_chunk_bytes(root: Path, cols: dict[str, Any], values: dict[str, Any], rank: int) -> int:
    """Bytes of the DCP chunks (as saved, split by rows) that overlap this process's blocks
    split by columns: what DCP's reader reads for them (it reads an overlapping chunk whole)."""
    import unimesh

    ck = unimesh.open_checkpoint(root)
    total = 0
    for name, lay in cols.items():
        want = lay.shard_slices(values[name].shape, rank)
        for box in ck.tensor(name).boxes:
            if all(
                a < s.stop and s.start < a + n
                for a, n, s in zip(box.offset, box.size, want + (slice(0, 1 << 62),) * 8)
            ):
                total += box.end - box.start
    return total


def drive(mib: int, out_json: str | None, engines: set[str], n: int) -> None:
    here = str(Path(__file__).resolve())
    rows: list[dict[str, Any]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for engine, launch in (
        ("incumbents", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "4"]),
        ("torch", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "4"]),
        ("mlx", ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4",
                 sys.executable]),
    ):  # fmt: skip
        work = Path(tempfile.mkdtemp(prefix=f"bench-mp-{engine}-"))
        outs = Path(tempfile.mkdtemp(prefix="bench-mp-out-"))
        try:
            if engine not in engines:
                continue
            cmd = [*launch, here, "--worker", engine, "--work", str(work), "--out", str(outs),
                   "--mib", str(mib), "--size", str(n)]  # fmt: skip
            proc = subprocess.run(  # TMPDIR: the launcher's own scratch (torchrun's
                cmd,  # torchelastic_* folders) goes where the finally removes it
                env=dict(env, TMPDIR=str(outs)),
                capture_output=True,
                text=True,
                timeout=3000,
                check=False,
            )
            reports = [json.loads(p.read_text()) for p in sorted(outs.glob(f"{engine}-*.json"))]
            if len(reports) != 4:
                print(f"{engine}: {len(reports)} reports; {proc.stdout[-2000:]}"
                      f"{proc.stderr[-3000:]}")  # fmt: skip
                continue
            rows.extend(_rows(engine, reports))
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(outs, ignore_errors=True)
    if out_json:
        Path(out_json).write_text(json.dumps({"mib": mib, "processes": 4, "rows": rows}, indent=1)
                                  + "\n")  # fmt: skip


def _rows(engine: str, reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slowest process's seconds per measurement, as GB/s of the whole state and as a
    fraction of the limit measured in the same launch."""
    total = reports[0]["bytes"]
    limit = {k: max(r["limit"][k] for r in reports) for k in reports[0]["limit"]}
    out = []
    launcher = {"torch": "torchrun 4", "incumbents": "torchrun 4, dp=2 x tp=2"}.get(
        engine, "mpirun 4"
    )
    for name, seconds in limit.items():
        out.append({"launch": launcher, "system": "limit", "operation": name,
                    "seconds": round(seconds, 3)})  # fmt: skip
        print(f"BENCH {launcher:10s} {'limit':10s} {name:42s} {seconds:7.3f} s")
    for name in reports[0]["seconds"]:
        seconds = max(r["seconds"][name] for r in reports)
        kind = ("pwrite+fsync" if "save" in name else
                "pread cold" if "cold" in name else "pread warm")  # fmt: skip
        frac = limit[kind] / seconds
        row = {"launch": launcher, "system": name.split(" ")[0], "operation": name,
               "seconds": round(seconds, 3), "GB/s": round(total / seconds / 1e9, 2),
               "limit": kind, "of limit": round(frac, 2)}  # fmt: skip
        extra = ""
        if kind == "pread warm":
            fresh = limit["pread warm, into new memory"] / seconds
            row["of pread into new memory"] = round(fresh, 2)
            extra = f", {fresh:.2f} of pread into new memory"
        out.append(row)
        print(f"BENCH {launcher:10s} {row['system']:10s} {name:42s} {seconds:7.3f} s "
              f"{row['GB/s']:6.2f} GB/s {frac:.2f} of {kind}{extra}")  # fmt: skip
    for name, trials in reports[0].get("trials", {}).items():  # each: the slowest process's
        listed = ", ".join(f"{t:.3f}" for t in trials)
        print(f"BENCH {launcher:10s} {'trials':10s} {name:42s} {listed} s")
    for name in reports[0]["read"]:
        worst = max(r["read"][name] / r["held reshard" if "reshard" in name else "held"]
                    for r in reports)  # fmt: skip
        out.append({"launch": launcher, "system": name.split(" ")[0], "operation": name,
                    "read / held (worst process)": round(worst, 3)})  # fmt: skip
        print(f"BENCH {launcher:10s} {'bytes':10s} {name:42s} read/held {worst:.3f}")
    if "equal" in reports[0]:
        print(
            f"BENCH {launcher}: the resharded DTensors equal the saved ones on every rank: "
            f"{all(r['equal'] for r in reports)}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--size", type=int, default=4096, help="incumbents: n x n tensors")
    parser.add_argument("--only", default="incumbents,torch,mlx", help="launches to run")
    parser.add_argument("--worker", choices=["torch", "mlx", "incumbents"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "incumbents":
        incumbents(Path(args.work), args.size, Path(args.out))
    elif args.worker:
        worker(args.worker, Path(args.work), args.mib, Path(args.out))
    else:
        drive(args.mib, args.json, set(args.only.split(",")), args.size)


if __name__ == "__main__":
    main()
