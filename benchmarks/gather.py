"""Gathers the figures the issues name into one JSON file that the docs' benchmark page is
generated from. Every figure is a ratio (or a time) measured in this one run.

    python benchmarks/gather.py [--quick] [--json docs/_data/benchmarks.json] [--only LABELS]

``--only "checkpoints,checkpoints 4 processes"`` reruns those sections and keeps the others
of the JSON file as they were (each section records the date it was measured).

1. import cost: ``import unimesh`` / ``import numpy`` in fresh interpreters (bench_core.py).
2. to_native overhead per backend: the first conversion of a neutral mesh by a fresh backend
   (no cache) against the idiom a user writes for the same mesh (JAX ``jax.sharding.Mesh(
   np.array(jax.devices())...)``, Keras ``DeviceMesh(..., devices=list_devices()...)``,
   TensorFlow ``dtensor.Mesh`` in process; torch ``DeviceMesh`` under the fake process group,
   bench_torch.py). MLX has no mesh type: not measured. bench_scale.py adds repeated
   conversions and layouts.
3. the core at 1,048,576 devices (bench_core.py).
4. program-step overhead: the example MLP step through unimesh.shard_map against the native
   step (bench_step.py: JAX in process, torch under torchrun, MLX under mpirun).
5. example programs: the FSDP, tensor + sequence parallel, MoE and pipeline steps through
   unimesh against the same loss run with the framework's own collectives (bench_programs.py:
   JAX and torch).
6. checkpoints: save and load against the disk's and memory's limit and against safetensors,
   torch DCP and Orbax (bench_checkpoint.py), and with 4 processes against DCP under torchrun
   and mx under mpirun (bench_checkpoint_mp.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

IN_PROCESS = r"""
import json, os, statistics, sys, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
import unimesh
name, repeat = sys.argv[1], int(sys.argv[2])
mesh = unimesh.Mesh((2, 4), ("dp", "tp"), np.arange(8)[::-1].reshape(2, 4))
cls = type(unimesh.get_backend(name))
cls().prepare_devices(8)
if name == "jax":  # the idioms a user writes: the device list asked for, then reshaped
    import jax
    native = lambda: jax.sharding.Mesh(np.array(jax.devices())[::-1].reshape(2, 4), ("dp", "tp"))
elif name == "keras":
    import keras
    kd = keras.distribution
    native = lambda: kd.DeviceMesh((2, 4), ["dp", "tp"],
                                   devices=np.array(kd.list_devices())[::-1].reshape(2, 4))
else:
    from tensorflow.experimental import dtensor
    local = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in mesh.device_ids.ravel()]
    native = lambda: dtensor.Mesh(list(mesh.axis_names), np.arange(8).reshape(2, 4),
                                  list(range(8)), local)
native(); cls().mesh_to_native(mesh)  # warm both paths once
a, b = [], []
for _ in range(repeat):  # alternating, a fresh backend each time (no cache)
    t0 = time.perf_counter(); native(); a.append(time.perf_counter() - t0)
    be = cls()
    t0 = time.perf_counter(); be.mesh_to_native(mesh); b.append(time.perf_counter() - t0)
out = {"native_ms": statistics.median(a) * 1e3, "unimesh_ms": statistics.median(b) * 1e3}
# the fixed costs a program pays again and again: the same mesh, and a layout per tensor
lay = unimesh.Layout(mesh, unimesh.P("dp", "tp"))
if name in ("jax", "keras"):
    made = unimesh.to_native(mesh, name)
    if name == "jax":
        spec = jax.sharding.PartitionSpec("dp", "tp")
        per_tensor = lambda: jax.sharding.NamedSharding(made, spec)
    else:
        per_tensor = lambda: kd.TensorLayout(["dp", "tp"], made)
    pairs = {"mesh_again": (native, lambda: unimesh.to_native(mesh, name)),
             "layout": (per_tensor, lambda: unimesh.to_native(lay, name))}
    for key, (theirs, ours) in pairs.items():
        theirs(); ours()
        c, d = [], []
        for _ in range(repeat):
            t0 = time.perf_counter(); theirs(); c.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); ours(); d.append(time.perf_counter() - t0)
        out[key] = [statistics.median(c) * 1e3, statistics.median(d) * 1e3]
print(json.dumps(out))
"""


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return proc.returncode, proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr


def imports(rounds: int) -> dict[str, Any]:
    from bench_core import import_cost

    r = import_cost(rounds)
    return {
        "title": "Import cost",
        "note": f"Median of {rounds} fresh interpreters each, "
        "interleaved. Goal: at most 1.15x `import numpy`.",
        "columns": ["import", "ms", "ratio to numpy"],
        "rows": [
            {"import": "numpy", "ms": f"{r['numpy_ms']:.1f}", "ratio to numpy": "1"},
            {
                "import": "unimesh",
                "ms": f"{r['unimesh_ms']:.1f}",
                "ratio to numpy": f"{r['ratio']:.3f}",
            },
        ],
    }


def to_native(repeat: int) -> dict[str, Any]:
    import unimesh

    rows = []
    for name in ("jax", "keras", "tensorflow"):
        if name not in unimesh.backends():
            rows.append({"backend": name, "mesh": "-", "note": "not installed"})
            continue
        rc, out = _run([sys.executable, "-c", IN_PROCESS, name, str(repeat)], 300)
        if rc != 0:
            rows.append({"backend": name, "note": f"failed: {out.strip()[-120:]}"})
            continue
        r = json.loads(out.strip().splitlines()[-1])
        rows.append(
            {
                "backend": name,
                "mesh": "dp=2,tp=4 (reversed ids)",
                "native": f"{r['native_ms'] * 1e3:.0f} us",
                "unimesh to_native": f"{r['unimesh_ms'] * 1e3:.0f} us",
                "ratio": f"{r['unimesh_ms'] / r['native_ms']:.2f}",
            }
        )
        idiom = {"jax": "NamedSharding(mesh, P('dp', 'tp'))",
                 "keras": "TensorLayout(['dp', 'tp'], mesh)"}.get(name, "")  # fmt: skip
        for key, what in (("mesh_again", "the same mesh again"),
                          ("layout", f"a layout per tensor vs {idiom}")):  # fmt: skip
            if key in r:
                theirs, ours = r[key]
                rows.append(
                    {
                        "backend": name,
                        "mesh": what,
                        "native": f"{theirs * 1e3:.1f} us",
                        "unimesh to_native": f"{ours * 1e3:.1f} us",
                        "ratio": f"{ours / theirs:.2f}",
                    }
                )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "torch.json"
        rc, out = _run(
            [
                sys.executable,
                str(HERE / "bench_torch.py"),
                "--repeat",
                str(max(5, repeat // 20)),
                "--json",
                str(path),
            ],
            600,
        )
        if rc == 0 and path.exists():
            for r in json.loads(path.read_text()):
                rows.append(
                    {
                        "backend": "torch",
                        "mesh": f"{r['shape']} ({r['world']} ranks, fake process group)",
                        "native": f"{r['native_ms'] * 1e3:.0f} us",
                        "unimesh to_native": f"{r['unimesh_ms'] * 1e3:.0f} us",
                        "ratio": f"{r['ratio']:.3f}",
                    }
                )
        else:
            rows.append({"backend": "torch", "note": f"not run: {out.strip()[-120:]}"})
    rows.append({"backend": "mlx", "note": "MLX has no mesh type; nothing to compare"})
    return {
        "title": "to_native overhead",
        "note": "The first conversion by a fresh backend (no "
        "cache) against the framework's own constructor for the same mesh, medians of "
        "alternating calls. Goal for torch: at most 1.05x. JAX, Keras and TensorFlow "
        "constructors take microseconds, so their first-conversion ratios show unimesh's fixed "
        "Python cost (validation, device lookup). The rows a program pays again and again, the "
        "same mesh and a layout per tensor with the mesh built, have a goal of at most 1.05x "
        "(issue 40): a converted mesh and layout are kept, so a repeat is a dict lookup.",
        "columns": ["backend", "mesh", "native", "unimesh to_native", "ratio", "note"],
        "rows": rows,
    }


def scale(repeat: int) -> dict[str, Any]:
    from bench_core import core_scale

    big = (64, 64, 16, 16)
    r = core_scale(big, repeat)
    return {
        "title": "The core at 1,048,576 devices",
        "note": "Mesh 64x64x16x16, median of the operation. Goal: each under 200 ms.",
        "columns": ["operation", "ms"],
        "rows": [{"operation": k, "ms": f"{v:.1f}"} for k, v in r.items()],
    }


def _rows(
    results: dict[str, list[str] | str],
    pattern: re.Pattern[str],
    row: Callable[[re.Match[str]], dict[str, str]],
) -> list[dict[str, str]]:
    """A table row per BENCH line that ``pattern`` reads, or a note where a backend gave none."""
    rows = []
    for name, lines in results.items():
        if isinstance(lines, str):
            rows.append({"backend": name, "note": lines[:120]})
            continue
        rows += [row(m) for m in map(pattern.search, lines) if m]
    return rows


def steps(repeat: int) -> dict[str, Any]:
    from bench_step import collect

    pattern = re.compile(
        r"BENCH (\w+)\s+step=([\w/]+)\s+scale=(\d+)\s+native=\s*([\d.]+) ms "
        r"unimesh=\s*([\d.]+) ms ratio=([\d.]+)"
    )
    rows = _rows(
        collect(repeat, [1, 8]),
        pattern,
        lambda m: {
            "backend": m[1],
            "step": m[2],
            "size": "example" if m[3] == "1" else f"{m[3]}x",
            "native": f"{m[4]} ms",
            "unimesh": f"{m[5]} ms",
            "ratio": m[6],
        },
    )
    how = {"jax": "jit, 8 CPU devices", "torch": "torchrun 4, gloo", "mlx": "mpirun 4"}
    for row in rows:
        row["backend"] = f"{row['backend']} ({how.get(row['backend'], '')})"
    return {
        "title": "Program step overhead",
        "note": "examples/mlp_step.py's model through unimesh against the same step "
        "written natively, {repeat} steps alternating (under torchrun and mpirun: "
        "medians of blocks of 10 steps, each block started after a barrier): manual = a "
        "hand-written backward, grad = the loss differentiated by "
        "unimesh.value_and_grad vs the framework's own autodiff idiom (torch: the data-parallel "
        "gradient sums after the backward; grad/in_backward: inside it, where DDP's hooks and "
        "unimesh's rules put them). Goal: 1.02 "
        "(JAX), 1.05 (torch, MLX).".replace("{repeat}", str(repeat)),
        "columns": ["backend", "step", "size", "native", "unimesh", "ratio", "note"],
        "rows": rows,
    }


def builds(blocks: int) -> dict[str, Any]:
    from bench_step import MPIRUN4, launched

    here = str(Path(__file__).with_name("bench_build.py"))
    extra = ["--blocks", str(blocks)]
    runs = {
        "torch": [sys.executable, here, "--backend", "torch", *extra],
        "mlx": [*MPIRUN4, sys.executable, here, "--backend", "mlx", *extra],
    }
    pattern = re.compile(
        r"BUILD (\w+)\s+step=(\w+)\s+native=\s*([\d.]+) us unimesh=\s*([\d.]+) us "
        r"(over=\s*(-?[\d.]+) us|ratio=([\d.]+)).*budget=(\S+( us)?)"
    )
    rows = _rows(
        launched(runs, 600, prefix="BUILD"),
        pattern,
        lambda m: {
            "backend": m[1],
            "step": m[2],
            "native": f"{m[3]} us",
            "unimesh": f"{m[4]} us",
            "over native": f"{m[6]} us" if m[6] is not None else f"{m[7]}x",
            "budget": m[8],
        },
    )
    return {
        "title": "Eager build cost",
        "note": "CPU time of one eager step (bench_build.py): MLX builds its graph lazily "
        "(mpirun 4, nothing evaluated), torch runs under its fake process group (collectives "
        "do nothing) against the native step inside an empty TorchFunctionMode; ppermute "
        "against batch_isend_irecv. Medians of {blocks} blocks. Budgets (issue 38): MLX 5 us "
        "per collective + 2 us per argument and result (34 us for this step), torch 1 us per "
        "op, ppermute 1.25x.".replace("{blocks}", str(blocks)),
        "columns": ["backend", "step", "native", "unimesh", "over native", "budget", "note"],
        "rows": rows,
    }


#: the example programs' sizes: the examples' own, and realistic (bench_programs.py --scales)
PROGRAM_SCALES = "1,32"


def programs(repeat: int) -> dict[str, Any]:
    from bench_programs import collect as collect_programs

    pattern = re.compile(
        r"BENCH (\w+)\s+program=(\w+)\s+scale=(\d+)\s+native=\s*([\d.]+) ms "
        r"unimesh=\s*([\d.]+) ms ratio=([\d.]+)"
    )
    how = {"jax": "jit, 8 CPU devices", "torch": "torchrun 4, gloo"}
    rows = _rows(
        collect_programs(repeat, PROGRAM_SCALES),
        pattern,
        lambda m: {
            "backend": f"{m[1]} ({how.get(m[1], '')})",
            "program": m[2],
            "scale": m[3],
            "native": f"{m[4]} ms",
            "unimesh": f"{m[5]} ms",
            "ratio": m[6],
        },
    )
    return {
        "title": "Example programs: training step",
        "note": "examples/fsdp_step.py, tp_sp_block.py, moe_layer.py and pipeline.py: loss "
        "and gradients by unimesh.value_and_grad against the same loss function "
        "run with the framework's own collectives and autodiff (bench_programs.py), "
        "{repeat} steps alternating in blocks of 10, each block started after a barrier "
        "(medians); scale 1 is the example's size, scale 32 its matrices 32 times larger in "
        "each dimension (a step whose arithmetic, not its collectives' latency, sets its "
        "time). MLX has no native all-to-all, "
        "reduce-scatter or differentiable all-gather to compare with. Goal: 1.02 "
        "(JAX), 1.05 (torch).".replace("{repeat}", str(repeat)),
        "columns": ["backend", "program", "scale", "native", "unimesh", "ratio", "note"],
        "rows": rows,
    }


def _script_rows(script: str, mib: int) -> dict[str, Any]:
    """``script --mib mib --json FILE`` in a fresh interpreter: what it wrote (a full-size run
    also keeps its raw rows as ``docs/_data/<script>.json``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        subprocess.run(
            [sys.executable, str(HERE / script), "--mib", str(mib), "--json", str(out)],
            check=True,
        )
        text = out.read_text()
    if mib >= 1024:
        (HERE.parent / "docs" / "_data" / script.replace(".py", ".json")).write_text(text)
    found: dict[str, Any] = json.loads(text)
    return found


def checkpoints(mib: int) -> dict[str, Any]:
    """bench_checkpoint.py (8 JAX CPU devices, one process): its rows."""
    found = _script_rows("bench_checkpoint.py", mib)
    return {
        "title": "Checkpoints",
        "note": f"bench_checkpoint.py: {found['bytes'] / 2**20:.0f} MiB on 8 JAX CPU devices in "
        "one process; each system's GB/s and its fraction of this machine's limit measured in "
        "the same run (pwrite + fsync, pread warm and cold, memcpy).",
        "columns": ["system", "operation", "seconds", "GB/s", "of limit", "limit"],
        "rows": found["rows"],
    }


def checkpoints_mp(mib: int) -> dict[str, Any]:
    """bench_checkpoint_mp.py (torchrun 4 with DCP, mpirun 4 with mx): its rows."""
    found = _script_rows("bench_checkpoint_mp.py", mib)
    return {
        "title": "Checkpoints, four processes",
        "note": "bench_checkpoint_mp.py: the state split by rows over 4 processes; unimesh "
        "beside torch DCP (torchrun 4) and mx.save_safetensors / mx.load (mpirun 4), the slowest "
        "process's seconds and its fraction of the limit measured in the same launch.",
        "columns": [
            "launch",
            "system",
            "operation",
            "seconds",
            "GB/s",
            "of limit",
            "limit",
            "read / held (worst process)",
        ],
        "rows": found["rows"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument(
        "--json",
        default=str(HERE.parent / "docs" / "_data" / "benchmarks.json"),
        help="where to write the results (default: the docs' data file)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated section labels to rerun, keeping the others of --json as they are",
    )
    args = parser.parse_args()
    q = args.quick
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("import cost", lambda: imports(3 if q else 15)),
        ("to_native", lambda: to_native(20 if q else 300)),
        ("core scale", lambda: scale(2 if q else 7)),
        ("step overhead", lambda: steps(20 if q else 300)),
        ("build cost", lambda: builds(3 if q else 15)),
        ("example programs", lambda: programs(10 if q else 200)),
        ("checkpoints", lambda: checkpoints(128 if q else 1024)),
        ("checkpoints 4 processes", lambda: checkpoints_mp(128 if q else 1024)),
    ]
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in only if x not in dict(parts)]
    if unknown:
        raise SystemExit(f"--only: no section {unknown}; the sections: {[p for p, _ in parts]}")
    kept: dict[str, Any] = {}
    if only:  # the sections not rerun, as the file has them
        old = json.loads(Path(args.json).read_text())
        kept = {s["label"]: s for s in old["sections"] if "label" in s}
    sections = []
    for label, part in parts:
        if only and label not in only:
            if label in kept:
                sections.append(kept[label])
            continue
        t0 = time.perf_counter()
        print(f"== {label}", flush=True)
        section = part()
        for row in section["rows"]:
            print("   " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
        section["label"] = label
        section["date"] = time.strftime("%Y-%m-%d")
        sections.append(section)
    data = {
        "run": {
            "command": "python benchmarks/gather.py" + (" --quick" if q else ""),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} "
            f"cores, Python {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d"),
        },
        "sections": sections,
    }
    Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
