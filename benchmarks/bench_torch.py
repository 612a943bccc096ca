"""Overhead of unimesh.to_native over building the DeviceMesh directly (torch fake process group).

    python benchmarks/bench_torch.py [--repeat N]

For world sizes 8, 512 and 4096: the median time of ``DeviceMesh("cpu", ranks, mesh_dim_names=...)``
against the first conversion of the same neutral mesh by a fresh torch backend (no cache), and
the ratio (goal <= 1.05). A second conversion of the same mesh is a cache hit; shown beside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from unimesh_torch import TorchBackend

import unimesh

SHAPES = {8: (2, 4), 512: (8, 8, 8), 4096: (16, 16, 16)}
NAMES = ("dp", "cp", "tp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    print(
        f"{'world':>6s} {'shape':>12s} {'DeviceMesh':>12s} {'to_native':>12s} {'ratio':>7s} "
        f"{'cached':>10s}"
    )
    for world, shape in SHAPES.items():
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        names = NAMES[-len(shape) :]
        mesh = unimesh.Mesh(shape, names)
        direct, ours, cached = [], [], []
        for _ in range(args.repeat):  # interleaved so that machine noise hits both alike
            t0 = time.perf_counter()
            DeviceMesh("cpu", torch.arange(world).reshape(shape), mesh_dim_names=names)
            direct.append(time.perf_counter() - t0)
            backend = TorchBackend()
            t0 = time.perf_counter()
            backend.mesh_to_native(mesh)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            backend.mesh_to_native(mesh)
            cached.append(time.perf_counter() - t0)
        d, o, c = (statistics.median(x) * 1e3 for x in (direct, ours, cached))
        label = "x".join(map(str, shape))
        print(f"{world:6d} {label:>12s} {d:10.2f}ms {o:10.2f}ms {o / d:6.3f}x {c * 1e3:8.1f}us")
        rows.append(
            {
                "world": world,
                "shape": label,
                "native_ms": d,
                "unimesh_ms": o,
                "ratio": o / d,
                "cached_us": c * 1e3,
            }
        )
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
