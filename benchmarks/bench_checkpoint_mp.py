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

    else:
        import mlx.core as mx

        def barrier() -> None:
            mx.eval(mx.distributed.all_sum(mx.array(1.0)))

    placed = {k: unimesh.distribute(v, rows[k], backend=be) for k, v in values.items()}

    def together(fn: Any) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        barrier()
        return seconds

    total = sum(v.nbytes for v in values.values())
    limit = bench_checkpoint.limits(work, held, together, f"limit-{rank}.bin", memcpy=False)
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


def drive(mib: int, out_json: str | None) -> None:
    here = str(Path(__file__).resolve())
    rows: list[dict[str, Any]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for engine, launch in (
        ("torch", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "4"]),
        ("mlx", ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4",
                 sys.executable]),
    ):  # fmt: skip
        work = Path(tempfile.mkdtemp(prefix=f"bench-mp-{engine}-"))
        outs = Path(tempfile.mkdtemp(prefix="bench-mp-out-"))
        try:
            cmd = [*launch, here, "--worker", engine, "--work", str(work), "--out", str(outs),
                   "--mib", str(mib)]  # fmt: skip
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=3000, check=False
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
    launcher = "torchrun 4" if engine == "torch" else "mpirun 4"
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
    for name in reports[0]["read"]:
        worst = max(r["read"][name] / r["held reshard" if "reshard" in name else "held"]
                    for r in reports)  # fmt: skip
        out.append({"launch": launcher, "system": name.split(" ")[0], "operation": name,
                    "read / held (worst process)": round(worst, 3)})  # fmt: skip
        print(f"BENCH {launcher:10s} {'bytes':10s} {name:42s} read/held {worst:.3f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=["torch", "mlx"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.work), args.mib, Path(args.out))
    else:
        drive(args.mib, args.json)


if __name__ == "__main__":
    main()
