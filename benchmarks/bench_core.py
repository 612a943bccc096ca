"""Benchmarks of the neutral core. Prints a table; every claim is a ratio measured in this run.

    python benchmarks/bench_core.py [--quick] [--json FILE]

1. `import unimesh` against `import numpy` alone, each in fresh interpreters (goal: <= 1.15x).
2. The core at 1,048,576 devices (64x64x16x16): construction, groups of one axis, flatten of two
   axes, coordinates of every device, shard offsets of every device for a 2-D tensor
   (goal: each < 200 ms here).
3. Beside them, torch's own `init_device_mesh` + slicing for the same shapes under the fake
   process group, where it finishes within a time limit (torch is optional).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

IMPORT_CODE = """
import time
t0 = time.perf_counter()
import {module}
print(time.perf_counter() - t0)
"""

TORCH_CODE = """
import sys, time
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
shape = tuple(int(s) for s in sys.argv[1].split("x"))
names = ("a", "b", "c", "d")[: len(shape)]
world = 1
for s in shape:
    world *= s
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
t0 = time.perf_counter()
mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
t1 = time.perf_counter()
sub = mesh[names[-1]]
flat = mesh[names[-2:]]._flatten() if len(names) > 1 else sub
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of ``repeat`` calls, in ms."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def import_cost(rounds: int) -> dict[str, float]:
    import compileall
    import os

    import unimesh

    # compare like with like: numpy's bytecode was compiled at install, so compile ours too
    # (an editable install under PYTHONDONTWRITEBYTECODE would otherwise recompile every run)
    compileall.compile_dir(os.path.dirname(unimesh.__file__), quiet=1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    samples: dict[str, list[float]] = {"numpy": [], "unimesh": []}
    for _ in range(rounds):  # interleaved, so drift on a shared machine hits both alike
        for module, times in samples.items():
            out = subprocess.run(
                [sys.executable, "-c", IMPORT_CODE.format(module=module)],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            times.append(float(out.stdout) * 1e3)
    numpy_ms = statistics.median(samples["numpy"])
    unimesh_ms = statistics.median(samples["unimesh"])
    return {"numpy_ms": numpy_ms, "unimesh_ms": unimesh_ms, "ratio": unimesh_ms / numpy_ms}


def core_scale(shape: tuple[int, ...], repeat: int) -> dict[str, float]:
    import numpy as np

    import unimesh

    names = ("dp", "fsdp", "cp", "tp")[: len(shape)]
    size = int(np.prod(shape))
    rng = np.random.default_rng(0)
    perm = rng.permutation(size).reshape(shape)
    mesh = unimesh.Mesh(shape, names)
    pmesh = unimesh.Mesh(shape, names, perm)
    layout = unimesh.Layout(mesh, unimesh.P(("dp", "fsdp"), ("cp", "tp")))
    out = {
        "construct (default ids)": best_of(lambda: unimesh.Mesh(shape, names), repeat),
        "construct + materialise default ids": best_of(
            lambda: unimesh.Mesh(shape, names).device_ids, repeat
        ),
        "construct (permuted ids)": best_of(lambda: unimesh.Mesh(shape, names, perm), repeat),
        "groups_array of every axis": best_of(
            lambda: [unimesh.Mesh(shape, names).groups_array(n) for n in names], repeat
        ),
        "groups_array(one axis)": best_of(lambda: mesh.groups_array("cp"), repeat),
        "groups(one axis) as tuples": best_of(lambda: mesh.groups("tp"), repeat),
        "flatten(two axes)": best_of(lambda: mesh.flatten(("dp", "fsdp"), "dpf"), repeat),
        "coords_array() of all devices": best_of(mesh.coords_array, repeat),
        "coords_array(ids) permuted mesh": best_of(
            lambda: pmesh.coords_array(perm.ravel()), repeat
        ),
        "shard_bounds 2-D, all devices": best_of(lambda: layout.shard_bounds((8192, 4096)), repeat),
    }
    return out


def torch_scale(shape: tuple[int, ...], limit: float) -> dict[str, Any]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"status": "torch not installed"}
    arg = "x".join(map(str, shape))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", TORCH_CODE, arg],
            capture_output=True,
            text=True,
            timeout=limit,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"status": f"> {limit:.0f} s (stopped)"}
    if proc.returncode != 0:
        return {"status": "error: " + proc.stderr.strip().splitlines()[-1][:80]}
    init_s, slice_s = map(float, proc.stdout.split())
    return {"status": "ok", "init_ms": init_s * 1e3, "slice_ms": slice_s * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument(
        "--torch-limit",
        type=float,
        default=120.0,
        help="seconds allowed for each torch measurement",
    )
    args = parser.parse_args()
    rounds = 5 if args.quick else 15
    results: dict[str, Any] = {}

    imp = import_cost(rounds)
    results["import"] = imp
    print(f"import cost, median of {rounds} fresh interpreters each")
    print(f"  import numpy    {imp['numpy_ms']:8.1f} ms")
    print(
        f"  import unimesh  {imp['unimesh_ms']:8.1f} ms   ratio {imp['ratio']:.3f}x (goal <= 1.15x)"
    )

    big = (64, 64, 16, 16)
    scale = core_scale(big, 3 if args.quick else 7)
    results["core_1m"] = scale
    print(f"\nunimesh core at {64 * 64 * 16 * 16:,} devices {big}, median ms (goal < 200 ms)")
    for k, v in scale.items():
        print(f"  {k:36s} {v:8.1f} ms   {'ok' if v < 200 else 'OVER'}")

    print("\ntorch init_device_mesh + slicing (fake process group), same shapes, vs unimesh")
    print(
        f"  {'shape':>18s} {'devices':>9s} {'torch init':>12s} {'torch slice':>12s} "
        f"{'unimesh':>10s} {'ratio':>9s}"
    )
    results["torch"] = {}
    for shape in [(8, 8, 4, 4), (16, 16, 8, 8), big]:
        n = 1
        for s in shape:
            n *= s
        t = torch_scale(shape, args.torch_limit)
        u = core_scale(shape, 3)
        ours = u["groups_array of every axis"] + u["flatten(two axes)"]
        row = {"unimesh_ms": ours, **t}
        results["torch"]["x".join(map(str, shape))] = row
        label = "x".join(map(str, shape))
        if t.get("status") == "ok":
            total = t["init_ms"] + t["slice_ms"]
            print(
                f"  {label:>18s} {n:9,d} {t['init_ms']:10.1f}ms {t['slice_ms']:10.1f}ms "
                f"{ours:8.2f}ms {total / ours:8.0f}x"
            )
        else:
            print(f"  {label:>18s} {n:9,d} {t['status']:>25s} {ours:8.2f}ms")
    print(
        "  (torch: init_device_mesh, which builds a group per axis, then mesh[last axis] and a "
        "_flatten of two axes;\n   unimesh: construct + the groups of every axis + flatten of "
        "two axes; ratio = torch / unimesh)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
