"""``unimesh.link`` against what users do today, in one run (issue 68, item 10).

    python benchmarks/bench_link.py [--mib 1024] [--repeat 3] [--link-only] [--rows]

Two torchrun jobs of 4 processes on this machine: the trainer holds a model of ``--mib`` MiB
(half its leaves bfloat16, half float32) on dp=2 x tp=2 DTensors; the server takes it on a
mesh of 4 with other layouts (rows -> columns, strided -> rows). Timed on the server, from the
moment both jobs are ready to the moment every server process has its blocks, each the median
of ``--repeat`` interleaved runs:

- ``link``: ``Link.send`` -> ``Link.receive`` (its plan made once, before timing);
- ``gather+broadcast``: each tensor gathered on the trainer (``full_tensor``), then sent whole
  from trainer rank 0 to every server process, each cutting its block (SGLang's
  ``update_weights_from_distributed``; here each whole tensor travels on the link itself, held
  by trainer rank 0 and received replicated by every server process);
- ``save+load``: ``unimesh.save`` on the trainer, ``unimesh.load`` on the server, through the
  local disk;
- ``floor``: the same gloo group moving, per pair of processes, exactly the bytes the link
  moves between them as one raw buffer (no cutting, no packing).

Each server process also reports its ``bytes_received`` beside the bytes of its blocks, the
plans it made (one: the timed transfers replay it), the first transfer's time (it plans), and
how much its peak resident memory grew in that first receive beside the blocks it made.
``--link-only`` times the link and the floor alone (more repeats in the same time);
``--rows`` makes every tensor a row block on both sides, so that nothing is packed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def leaves(mib: int, rows: bool = False) -> list[tuple[str, tuple[int, int], str, Any, Any]]:
    """(name, shape, dtype, trainer spec, server spec) of a model of about ``mib`` MiB."""
    from unimesh import P

    out = []
    rows = 1024
    per = max(mib // 8, 1) << 20  # 8 tensors
    for i in range(8):
        dtype = "bfloat16" if i % 2 else "float32"
        cols = per // (rows * (2 if i % 2 else 4))
        spec = [(P("dp", "tp"), P(None, "w")), (P(("tp", "dp")), P("w"))][i % 2]
        if rows:  # a row block on both sides: nothing to pack or unpack
            spec = (P(("dp", "tp")), P("w"))
        out.append((f"layer{i}.w", (rows, cols), dtype, *spec))
    return out


def floor(link: Any, sending: bool) -> None:
    """The floor: on the link's own gloo group, each pair of processes moves the bytes the
    link moves between them as one raw buffer (allocated here, as the link's targets are)."""
    schedule = next(iter(link._schedules.values()))  # the model's: the first transfer
    messages = [(q, 0, np.empty(sum(u.nbytes for u in us), np.uint8))
                for q, us in schedule.units.items()]  # fmt: skip
    link._wire.start(messages if sending else [], [] if sending else messages)()


def trainer(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import unimesh
    from unimesh import Layout, Mesh

    rank, _ = unimesh.initialize("torch")
    mesh = Mesh((2, 2), ("dp", "tp"))
    tree = {}
    for name, shape, dtype, spec, _ in leaves(args.mib, args.rows):
        t = torch.randn(shape).to(getattr(torch, dtype))
        tree[name] = unimesh.distribute(t, Layout(mesh, spec), backend="torch")
    one = Layout(Mesh((1,), ("o",)), ())  # rank 0 alone
    go = {"go": one}  # the server's signal
    flag = {"saved": unimesh.distribute(np.ones(1, np.float32), Layout(mesh, ()), backend="torch")}
    with unimesh.link(args.address, job="trainer", peer="server", timeout=600) as link:
        link.send(tree)  # plans
        for _ in range(args.repeat):
            link.receive(go)
            link.send(tree)
            link.receive(go)
            if not args.all:
                floor(link, sending=True)
                continue
            for name, value in tree.items():  # gathered, then rank 0 sends it whole to each
                full = value.full_tensor()  # server (on the link: held by rank 0 only)
                whole = unimesh.from_local({0: full} if rank == 0 else {}, one, tuple(full.shape),
                                           backend="torch", dtype=full.dtype)  # fmt: skip
                link.send({name: whole})
            link.receive(go)
            unimesh.save(str(Path(args.scratch) / "ckpt"), tree)
            dist.barrier()
            link.send(flag)
            link.receive(go)
            floor(link, sending=True)


def server(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import unimesh
    from unimesh import Layout, Mesh

    rank, _ = unimesh.initialize("torch")
    mesh = Mesh((4,), ("w",))
    spec = {
        name: (shape, dtype, Layout(mesh, s))
        for name, shape, dtype, _, s in leaves(args.mib, args.rows)
    }
    target = {name: lay for name, (_, _, lay) in spec.items()}
    times: dict[str, list[float]] = {
        "link": [],
        "gather+broadcast": [],
        "save+load": [],
        "floor": [],
    }
    one = Layout(Mesh((1,), ("o",)), ())
    go = {"go": unimesh.distribute(np.zeros(1, np.float32), one, backend="torch")}
    with unimesh.link(args.address, job="server", peer="trainer", timeout=600) as link:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.perf_counter()
        first = link.receive(target)  # plans
        planned = time.perf_counter() - t0
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
        del first
        stats: dict[str, int] = {}
        for _turn in range(args.repeat):
            dist.barrier()
            link.send(go)
            t0 = time.perf_counter()
            stats = {}
            made = link.plans
            if args.profile and rank == 0 and _turn == args.repeat - 1:
                import cProfile
                import pstats

                with cProfile.Profile() as prof:
                    got = link.receive(target, stats=stats)
                pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
            else:
                got = link.receive(target, stats=stats)
            dist.barrier()
            times["link"].append(time.perf_counter() - t0)
            if _turn == 0:
                replayed = link.plans - made  # the timed transfer's plans: none, replayed
            del got
            link.send(go)
            if not args.all:
                t0 = time.perf_counter()
                floor(link, sending=False)
                dist.barrier()
                times["floor"].append(time.perf_counter() - t0)
                continue
            t0 = time.perf_counter()
            for name, (shape, _dtype, lay) in spec.items():  # the whole tensor, then a cut
                got = link.receive({name: Layout(mesh, ())})[name]
                _ = unimesh.local_shards(got)[rank][lay.shard_slices(shape, rank)].copy()
            dist.barrier()
            times["gather+broadcast"].append(time.perf_counter() - t0)
            link.send(go)
            t0 = time.perf_counter()
            link.receive({"saved": Layout(mesh, ())})  # the trainer's checkpoint is complete
            unimesh.load(str(Path(args.scratch) / "ckpt"), target)
            dist.barrier()
            times["save+load"].append(time.perf_counter() - t0)
            link.send(go)
            t0 = time.perf_counter()
            floor(link, sending=False)
            dist.barrier()
            times["floor"].append(time.perf_counter() - t0)
    least = sum(
        int(np.prod([s.stop - s.start for s in lay.shard_slices(shape, rank)]))
        * (2 if dtype == "bfloat16" else 4)
        for shape, dtype, lay in spec.values()
    )
    result: dict[str, Any] = {k: float(np.median(v)) for k, v in times.items() if v}
    result["spread"] = {k: [float(min(v)), float(max(v))] for k, v in times.items() if v}
    result["all"] = {k: [round(x, 3) for x in v] for k, v in times.items() if v}
    result.update(received=stats.get("bytes_received"), least=least, grown_mib=grown,
                  first_seconds=planned,
                  blocks_mib=least / 2**20, plans=replayed)  # fmt: skip
    Path(args.scratch, f"server-{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--link-only", dest="all", action="store_false", help="time the link and the floor only"
    )
    parser.add_argument(
        "--rows", action="store_true", help="every tensor a row block on both sides (no packing)"
    )
    parser.add_argument("--profile", action="store_true", help="profile a server's receive")
    parser.add_argument("--role", choices=["trainer", "server"])
    parser.add_argument("--address")
    parser.add_argument("--scratch")
    args = parser.parse_args()
    if args.role:
        (trainer if args.role == "trainer" else server)(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    scratch = tempfile.mkdtemp(prefix="unimesh-bench-link-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = [__file__, "--mib", str(args.mib), "--repeat", str(args.repeat),
              "--address", address, "--scratch", scratch]  # fmt: skip
    common += ["--profile"] if args.profile else []
    common += [] if args.all else ["--link-only"]
    common += ["--rows"] if args.rows else []
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    try:
        jobs = [subprocess.Popen([*run, *common, "--role", r], env=env)
                for r in ("trainer", "server")]  # fmt: skip
        codes = [j.wait(timeout=3600) for j in jobs]
        assert codes == [0, 0], codes
        got = [json.loads(Path(scratch, f"server-{r}.json").read_text()) for r in range(4)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    slowest = {
        k: max(g[k] for g in got)
        for k in ("link", "gather+broadcast", "save+load", "floor")
        if k in got[0]
    }
    print(json.dumps({"mib": args.mib, "seconds": slowest, "servers": got}, indent=1))
    link = slowest["link"]
    if args.all:
        print(f"gather+broadcast / link = {slowest['gather+broadcast'] / link:.2f} (goal >= 3)")
        print(f"save+load / link = {slowest['save+load'] / link:.2f} (goal >= 2)")
    print(f"link / floor = {link / slowest['floor']:.2f} (goal <= 1.3)")
    print("bytes received = minimum:", all(g["received"] == g["least"] for g in got))
    print("plans made by the timed transfers (0: replayed):", {g["plans"] for g in got})
    beside = max(g["grown_mib"] - g["blocks_mib"] for g in got)
    print(f"peak memory beside the blocks: {beside:.0f} MiB (in-flight bound 64 MiB)")


if __name__ == "__main__":
    main()
