"""A million devices end to end (issue 16). Prints a table; every claim is a ratio measured in
this one run, unimesh and its floor alternating.

    python benchmarks/bench_scale.py [--quick] [--json FILE]

1. At 2**20 devices (a permuted 64x64x16x16 mesh ``dp,fsdp,cp,tp``), each operation beside the
   numpy floor of the same work: ``Mesh.from_string`` / ``np.fromstring`` of the ids,
   ``Mesh.from_json`` / ``json.loads`` of the same text, ``Mesh(...)`` / a ``np.bincount``
   distinctness check, ``flatten`` of two non-adjacent axes / the transpose-and-copy,
   ``Layout.device_slices`` / the same tuples built from ``shard_bounds``; ``unimesh show``
   (drawn to a sink) and ``show --json`` (streamed to a sink). Each with its peak traced memory
   (tracemalloc, in a separate pass) beside the size of the id array (8 MiB).
2. The growth of each operation from 2**16 to 2**20 devices, as the slope of log(time) against
   log(devices) (1 is linear), beside its floor's.
3. to_native at 8 devices against the native idiom a user writes (JAX ``Mesh(np.array(
   jax.devices()).reshape(...), names)``, ``NamedSharding``; Keras ``DeviceMesh(...,
   devices=list_devices())``, ``TensorLayout``), both from scratch and per tensor with the
   mesh already built, where jax and keras are installed.
4. The per-process engine (torch's and MLX's ``shard_map``) for one process of a 2**10 to
   2**16 device mesh, collectives simulated: the first call (groups and edges built), its peak
   memory, later calls, and the growth of each.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np

import unimesh
from unimesh import Layout, Mesh, P
from unimesh.spmd import ProcessBackend, ProcessGroup

SHAPE = (64, 64, 16, 16)
NAMES = ("dp", "fsdp", "cp", "tp")


def _shape_for(size: int) -> tuple[int, ...]:
    """A 4-D shape of ``size`` (a power of two >= 16) in the proportions of SHAPE."""
    k = int(math.log2(size))
    tp = cp = 2 ** min(4, k // 4)
    rest = k - 2 * int(math.log2(tp))
    return (2 ** (rest // 2), 2 ** (rest - rest // 2), cp, tp)


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def pair(ours: Callable[[], Any], floor: Callable[[], Any], rounds: int) -> tuple[float, float]:
    """Medians in ms of ``ours`` and ``floor``, alternating (noise hits both alike)."""
    a, b = [], []
    for _ in range(rounds):
        a.append(_time(ours))
        b.append(_time(floor))
    return statistics.median(a), statistics.median(b)


def peak_mib(fn: Callable[[], Any]) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


class _Sink(io.StringIO):
    """Counts what is written; keeps nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def write(self, text: str) -> int:
        self.count += len(text)
        return len(text)


def _draw(mesh: Mesh, layout: Layout | None = None, shape: Any = None) -> int:
    from rich.console import Console

    from unimesh.visual import draw

    sink = _Sink()
    draw(mesh, layout, shape, Console(file=sink, width=120))
    return sink.count


def _json(mesh: Mesh, layout: Layout | None = None, shape: Any = None) -> int:
    from unimesh.visual import write_json

    sink = _Sink()
    write_json(sink.write, mesh, layout, shape)
    return sink.count


def operations(size: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]:
    """name -> (unimesh, its floor) at ``size`` devices."""
    shape = SHAPE if size == 1 << 20 else _shape_for(size)
    ids = np.random.default_rng(0).permutation(size).reshape(shape)
    mesh = Mesh(shape, NAMES, ids)
    text = mesh.to_string()
    id_text = text.split(";ids=")[1]
    js = mesh.to_json()
    layout = Layout(mesh, P("dp", "tp"))
    tensor = (shape[0] * 4, shape[3] * 4)

    def tuples_from_bounds() -> Any:
        lo, hi = layout.shard_bounds(tensor)
        flat = mesh.device_ids.ravel().tolist()
        return {
            d: tuple(slice(a, b) for a, b in zip(r0, r1))
            for d, r0, r1 in zip(flat, lo.tolist(), hi.tolist())
        }

    return {
        "Mesh.from_string": (
            lambda: Mesh.from_string(text),
            lambda: np.fromstring(id_text, dtype=np.int64, sep=","),
        ),
        "Mesh.from_json": (lambda: Mesh.from_json(js), lambda: json.loads(js)),
        "Mesh(...) permuted ids": (
            lambda: Mesh(shape, NAMES, ids),
            lambda: bool((np.bincount(ids.ravel(), minlength=size) > 1).any()),
        ),
        "flatten(dp, cp)": (
            lambda: mesh.flatten(("dp", "cp"), "dpcp"),
            lambda: np.ascontiguousarray(ids.transpose(0, 2, 1, 3)),
        ),
        "Layout.device_slices": (lambda: layout.device_slices(tensor), tuples_from_bounds),
        "Layout.shard_bounds": (lambda: layout.shard_bounds(tensor), None),
        "show (summary)": (lambda: _draw(mesh), None),
        "show --layout (summary)": (lambda: _draw(mesh, layout, tensor), None),
        "show --json": (lambda: _json(mesh), None),
        "show --json --layout": (lambda: _json(mesh, layout, tensor), None),
    }


def at_scale(rounds: int) -> list[dict[str, Any]]:
    size = 1 << 20
    rows = []
    for name, (ours, floor) in operations(size).items():
        if floor is None:
            t_ours, t_floor = statistics.median(_time(ours) for _ in range(rounds)), None
        else:
            t_ours, t_floor = pair(ours, floor, rounds)
        rows.append(
            {
                "operation": name,
                "unimesh_ms": t_ours,
                "floor_ms": t_floor,
                "ratio": None if t_floor is None else t_ours / t_floor,
                "peak_mib": peak_mib(ours),
                "floor_peak_mib": None if floor is None else peak_mib(floor),
            }
        )
    return rows


def slopes(rounds: int) -> dict[str, tuple[float, float | None]]:
    """log-log slope of each operation's time, and of its floor's, from 2**16 to 2**20 devices
    (where fixed costs no longer hide the growth). A slope above 1 that the floor shares is the
    memory hierarchy (the arrays outgrow the caches), not the algorithm."""
    sizes = [1 << k for k in (16, 17, 18, 19, 20)]
    times: dict[str, list[list[float]]] = {}
    for size in sizes:
        for name, (ours, floor) in operations(size).items():
            row = times.setdefault(name, [[], []])
            row[0].append(statistics.median(_time(ours) for _ in range(rounds)))
            if floor is not None:
                row[1].append(statistics.median(_time(floor) for _ in range(rounds)))
    x = np.log(np.array(sizes, dtype=float))

    def fit(ts: list[float]) -> float:
        return float(np.polyfit(x, np.log(np.maximum(np.array(ts), 1e-3)), 1)[0])

    return {name: (fit(a), fit(b) if b else None) for name, (a, b) in times.items()}


def fixed_cost(rounds: int) -> list[dict[str, Any]]:
    """to_native at 8 devices against the native idiom, alternating, in microseconds."""
    import timeit

    rows: list[dict[str, Any]] = []
    names = ("dp", "tp")
    mesh = Mesh((2, 4), names, np.arange(8)[::-1].reshape(2, 4))
    layout = Layout(mesh, P("dp", None))
    cases: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    if "jax" in unimesh.backends():
        import jax
        from jax.sharding import Mesh as JMesh
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as JP

        jm = JMesh(np.array(jax.devices())[::-1].reshape(2, 4), names)

        def jax_mesh() -> Any:
            return JMesh(np.array(jax.devices())[::-1].reshape(2, 4), names)

        cases["jax Mesh"] = (jax_mesh, lambda: unimesh.to_native(mesh, "jax"))
        cases["jax NamedSharding, from scratch"] = (
            lambda: NamedSharding(jax_mesh(), JP("dp", None)),
            lambda: unimesh.to_native(layout, "jax"),
        )
        cases["jax NamedSharding, mesh built"] = (
            lambda: NamedSharding(jm, JP("dp", None)),
            lambda: unimesh.to_native(layout, "jax"),
        )
    if "keras" in unimesh.backends():
        import keras

        kd = keras.distribution
        km = kd.DeviceMesh((2, 4), list(names), devices=np.array(kd.list_devices())[::-1])

        def keras_mesh() -> Any:
            return kd.DeviceMesh((2, 4), list(names), devices=np.array(kd.list_devices())[::-1])

        cases["keras DeviceMesh"] = (keras_mesh, lambda: unimesh.to_native(mesh, "keras"))
        cases["keras TensorLayout, from scratch"] = (
            lambda: kd.TensorLayout(("dp", None), keras_mesh()),
            lambda: unimesh.to_native(layout, "keras"),
        )
        cases["keras TensorLayout, mesh built"] = (
            lambda: kd.TensorLayout(("dp", None), km),
            lambda: unimesh.to_native(layout, "keras"),
        )
    for name, (native, ours) in cases.items():
        native()
        ours()
        a, b = [], []
        for _ in range(rounds):
            a.append(timeit.timeit(native, number=200) / 200 * 1e6)
            b.append(timeit.timeit(ours, number=200) / 200 * 1e6)
        na, nb = statistics.median(a), statistics.median(b)
        rows.append({"conversion": name, "native_us": na, "unimesh_us": nb, "ratio": nb / na})
    return rows


class _SimulatedGroup(ProcessGroup):
    """A group of ``size`` simulated processes, each holding what this one holds."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def all_reduce(self, x: Any, op: str) -> Any:
        return x * self.size if op == "sum" else x

    def all_gather(self, x: Any) -> Any:
        return np.stack([x] * self.size)


class Simulated(ProcessBackend):
    """One process of a mesh whose collectives are simulated (for :func:`engine_scale`)."""

    name = "simulated"
    framework = "numpy"
    features = frozenset({"tuple_axes"})
    native_primitives = frozenset({"all_reduce", "all_gather", "split"})
    group_type = _SimulatedGroup

    def __init__(self, device: int) -> None:
        super().__init__()
        self.device = device

    def mesh_to_native(self, mesh: Mesh, **options: Any) -> Any:
        return mesh

    def from_native(self, obj: Any) -> Any:
        return obj

    def layout_to_native(self, layout: Layout, **options: Any) -> Any:
        return layout

    def process_index(self) -> int:
        return self.device

    def world_group(self) -> Any:
        return None

    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: Any, row: int) -> Any:
        return _SimulatedGroup(len(rows[row]))

    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]:
        return np.asarray(arg), True

    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any:
        return block

    def full_array(self, array: Any) -> Any:
        return np.asarray(array)


def _tp_step(x: Any, w1: Any, w2: Any) -> Any:
    y = unimesh.psum(np.maximum(x @ w1, 0) @ w2, "tp")
    gathered = unimesh.all_gather(y, "cp", axis=1, tiled=True)
    return unimesh.psum((gathered * gathered).sum(), ("dp", "fsdp", "cp"))


def engine_scale(rounds: int) -> list[dict[str, Any]]:
    """The per-process engine (torch's and MLX's) on meshes of 2**10 to 2**16 devices: one
    process of the job (the middle device) runs a tensor-parallel step whose collectives are
    simulated (a sum over a group of n is n times the block, a gather stacks n copies: the
    cost of the communication itself is not the engine's). The first call builds everything
    the engine decides for the program (its groups along each axis set, the edges of its
    arguments and results); later calls replay it. Peak memory by tracemalloc, first call."""
    first_program(1 << 8)  # imports and caches that do not depend on the mesh
    rows = []
    for k in (10, 12, 14, 16):
        size = 1 << k
        t0 = time.perf_counter()
        program, args = first_program(size)
        build_ms = (time.perf_counter() - t0) * 1e3
        tracemalloc.start()
        first_program(size)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        calls = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(100):
                program(*args)
            calls.append((time.perf_counter() - t0) * 1e4)  # us per call
        rows.append(
            {
                "devices": size,
                "mesh": _shape_for(size),
                "first_call_ms": build_ms,
                "peak_mib": peak,
                "call_us": statistics.median(calls),
            }
        )
    return rows


def first_program(size: int) -> tuple[Any, tuple[np.ndarray, ...]]:
    """:func:`_tp_step` as a program of the middle process of a ``size``-device mesh, after
    its first call, and its arguments."""
    shape = _shape_for(size)
    specs = (P(("dp", "fsdp", "cp")), P(None, "tp"), P("tp", None))
    batch = math.prod(shape[:3])
    args = (
        np.ones((batch * 2, 16), np.float32),
        np.ones((16, 8 * shape[3]), np.float32),
        np.ones((8 * shape[3], 4), np.float32),
    )
    program = unimesh.shard_map(
        _tp_step, Mesh(shape, NAMES), specs, P(), backend=Simulated(size // 2)
    )
    program(*args)
    return program, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args()
    rounds = 3 if args.quick else 9
    ids_mib = (1 << 20) * 8 / 2**20
    scale = at_scale(rounds)
    print(f"at 2**20 devices {SHAPE}, permuted ids; medians of {rounds}, alternating")
    print(f"  {'operation':26s} {'unimesh':>10s} {'floor':>10s} {'ratio':>6s} {'peak':>9s} ")
    for r in scale:
        floor = "" if r["floor_ms"] is None else f"{r['floor_ms']:8.1f}ms"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:5.2f}x"
        print(
            f"  {r['operation']:26s} {r['unimesh_ms']:8.1f}ms {floor:>10s} {ratio:>6s} "
            f"{r['peak_mib']:7.1f}MiB ({r['peak_mib'] / ids_mib:.1f}x ids)"
        )
    slope = slopes(max(3, rounds // 3))
    print("\ngrowth 2**16 -> 2**20 devices, slope of log time / log devices (1 = linear)")
    for name, (ours, floor) in slope.items():
        beside = "" if floor is None else f"   floor {floor:5.2f}"
        print(f"  {name:26s} {ours:5.2f}{beside}")
    fixed = fixed_cost(5 if args.quick else 15)
    if fixed:
        print("\nto_native at 8 devices vs the native idiom (medians, microseconds)")
        for r in fixed:
            print(
                f"  {r['conversion']:34s} native {r['native_us']:7.1f}  unimesh "
                f"{r['unimesh_us']:7.1f}  {r['ratio']:.2f}x"
            )
    engine = engine_scale(rounds)
    print(
        "\nthe per-process engine, one process of the mesh, simulated collectives (a tensor-"
        "parallel step: psum over tp, all_gather over cp, psum over dp/fsdp/cp)"
    )
    for r in engine:
        print(
            f"  2**{int(math.log2(r['devices'])):<2d} {r['mesh']!s:18s} first call "
            f"{r['first_call_ms']:7.1f} ms  peak {r['peak_mib']:6.2f} MiB  later calls "
            f"{r['call_us']:6.1f} us"
        )
    x = np.log([r["devices"] for r in engine])
    for key in ("first_call_ms", "peak_mib", "call_us"):
        fit = float(np.polyfit(x, np.log([r[key] for r in engine]), 1)[0])
        print(f"  growth 2**10 -> 2**16, slope of log {key} / log devices: {fit:5.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"scale": scale, "slopes": slope, "fixed": fixed, "engine": engine}, fh, indent=2
            )


if __name__ == "__main__":
    sys.exit(main())
