"""``unimesh`` / ``python -m unimesh``: the command line.

Commands: ``demo`` (the main job), ``backends``, ``show``, ``convert``, ``check``. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from .errors import UnimeshError
from .mesh import Mesh

KNOWN_BACKENDS = ("torch", "jax", "keras", "tensorflow", "mlx")
#: Backends the demo runs under their own launcher, one process per device.
LAUNCHED = ("torch", "mlx")


def _compute(name: str, native: Any, w: Any) -> Any:
    """The demo's computation, a matmul with a replicated weight, in the framework itself."""
    if name == "jax":
        import jax

        return jax.jit(lambda a, b: a @ b)(native, w)
    if name == "keras":
        import keras

        return keras.ops.matmul(native, w)
    if name == "tensorflow":
        import tensorflow as tf
        from tensorflow.experimental import dtensor

        mesh = dtensor.fetch_layout(native).mesh
        wt = dtensor.copy_to_mesh(tf.constant(w), dtensor.Layout.replicated(mesh, rank=2))
        product = tf.matmul(native, wt)
        return dtensor.unpack(dtensor.relayout(product, dtensor.Layout.replicated(mesh, 2)))[0]
    return None


def _demo(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .registry import _REGISTRY, backends, distribute, get_backend, to_native

    console = Console(width=120)
    mesh = Mesh.from_string(args.mesh)
    layout, x, w = demo_problem(mesh)
    shape, spec_axes = x.shape, layout.spec.axes()
    want = x @ w

    console.print(f"[bold]mesh[/bold] {mesh!r}   [bold]layout[/bold] {layout.spec!r}   "
                  f"[bold]tensor[/bold] {shape}")
    grid = Table(title="device ids", show_header=True)
    names = mesh.axis_names
    flat = mesh.device_ids.reshape(mesh.shape[0], -1)
    grid.add_column(f"{names[0]} \\ {','.join(names[1:]) or '-'}")
    for j in range(flat.shape[1]):
        grid.add_column(str(j), justify="right")
    for i, row in enumerate(flat.tolist()):
        grid.add_row(str(i), *map(str, row))
    console.print(grid)

    # the neutral reference: each device's block, then a sharded matmul reassembled from blocks
    t0 = time.perf_counter()
    blocks = layout.device_slices(shape)
    covered = np.zeros(shape, dtype=np.int64)
    out = np.zeros((shape[0], w.shape[1]), dtype=np.float32)
    for sl in blocks.values():
        covered[sl] += 1
    reps = mesh.size // int(np.prod([mesh.axis_size(a) for a in spec_axes]))
    for sl in blocks.values():
        out[sl[0]] += x[sl] @ w[sl[-1]] / reps
    ok_tiles = bool((covered == reps).all())
    ok_matmul = bool(np.allclose(out, want, rtol=1e-5, atol=1e-4))
    ref_ms = (time.perf_counter() - t0) * 1e3

    def mark(ok: bool | None) -> str:
        return "-" if ok is None else "[green]ok[/green]" if ok else "[red]FAIL[/red]"

    table = Table(title="one mesh, every backend")
    for col in ("backend", "native object", "shards vs reference", "result vs numpy", "time"):
        table.add_column(col)
    table.add_row("reference (numpy)", f"{len(blocks)} blocks", mark(ok_tiles), mark(ok_matmul),
                  f"{ref_ms:.1f} ms")
    installed = backends()
    failures = 0 if ok_tiles and ok_matmul else 1
    chosen = args.backends.split(",") if args.backends else sorted(
        set(KNOWN_BACKENDS) | set(installed))
    for name in chosen:  # in-process frameworks hear how many devices to simulate, first
        if name in installed and name not in LAUNCHED:
            try:
                get_backend(name).prepare_devices(max(8, mesh.size))
            except (ImportError, UnimeshError):
                pass  # its row reports what is missing
    for name in chosen:
        if name not in installed:
            table.add_row(name, "[dim]backend not installed[/dim]", "-", "-",
                          escape(f'pip install "unimesh[{name}]"'))
            continue
        plugin = _REGISTRY.load(name)
        if not plugin.available():
            table.add_row(name, f"[dim]{plugin.framework} not installed[/dim]", "-", "-",
                          escape(plugin.install_hint()))
            continue
        if name in LAUNCHED:
            cells = _launched_row(name, args.mesh, mesh.size, mark)
            failures += "FAIL" in "".join(cells) or "failed" in cells[1]
            table.add_row(*cells)
            continue
        try:
            be = get_backend(name)
            t0 = time.perf_counter()
            native_mesh = to_native(mesh, be)
            arr = distribute(x, layout, be)
            shards = be.local_shards(arr)
            ok_shards = bool(shards) and all(
                np.array_equal(block, x[layout.shard_slices(shape, d)])
                for d, block in shards.items())
            result = _compute(name, arr, w)
            ok_result = None if result is None else bool(
                np.allclose(np.asarray(result), want, rtol=1e-5, atol=1e-4))
            ms = (time.perf_counter() - t0) * 1e3
            failures += (not ok_shards) + (ok_result is False)
            table.add_row(name, type(native_mesh).__name__ + f", {len(shards)} shards",
                          mark(ok_shards), mark(ok_result), f"{ms:.1f} ms")
        except UnimeshError as exc:
            table.add_row(name, f"[yellow]{type(exc).__name__}[/yellow]", "-", "-",
                          escape(str(exc)[:70]))
    console.print(table)
    return 1 if failures else 0


def demo_problem(mesh: Mesh) -> tuple[Any, Any, Any]:
    """The demo's layout and data: a 2-D tensor, rows over the mesh's first axis and columns
    over its second, and a replicated weight to multiply it with."""
    import numpy as np

    from .layout import Layout, PartitionSpec

    axes = mesh.axis_names[:2]
    layout = Layout(mesh, PartitionSpec(axes[0], axes[1] if len(axes) > 1 else None))
    shape = (2 * mesh.shape[0], 2 * (mesh.shape[1] if mesh.ndim > 1 else 1))
    x = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
    w = np.linspace(-1.0, 1.0, shape[1] * 3, dtype=np.float32).reshape(shape[1], 3)
    return layout, x, w


def _launched_row(name: str, spec: str, size: int, mark: Any) -> tuple[str, ...]:
    """Run the demo under the framework's launcher (one process per device): torchrun with
    gloo for torch, mlx.launch with the ring backend for MLX; summarise the ranks."""
    import json
    import os
    import signal
    import subprocess
    from pathlib import Path

    from rich.markup import escape

    if size > 16:
        return (name, "[dim]skipped[/dim]", "-", "-", f"{size} processes is too many here")
    from .registry import get_backend

    be = get_backend(name)
    prefix, extra = be.launcher(size) or ([sys.executable], {})
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    package = type(be).__module__.rsplit(".", 1)[0]  # its demo worker: <package>.demo_worker
    cmd = [*prefix, "-m", f"{package}.demo_worker", spec]
    how = {"torch": "torchrun, gloo", "mlx": "mlx.launch, ring"}.get(name, Path(prefix[0]).name)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return (name, "[red]launcher timed out[/red]", "-", "-", "> 100 s")
    ms = (time.perf_counter() - t0) * 1e3
    ranks = [json.loads(line[len("UNIMESH_DEMO "):]) for line in out.splitlines()
             if line.startswith("UNIMESH_DEMO ")]
    if proc.returncode != 0 or len(ranks) != size:
        tail = out.strip().splitlines()[-1] if out.strip() else f"exit {proc.returncode}"
        return (name, "[red]launcher failed[/red]", "-", "-", escape(tail[:70]))
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return (name, "[yellow]refused[/yellow]", "-", "-", escape(errors[0][:70]))
    ok_shards = all(r["shards"] for r in ranks)
    ok_result = all(r["result"] for r in ranks)
    return (name, f"{ranks[0]['native']}, {size} ranks ({how})", mark(ok_shards),
            mark(ok_result), f"{ms:.0f} ms incl. launch")


def _backends(args: argparse.Namespace) -> int:
    from .registry import backends, get_backend

    for name in backends():
        try:
            be = get_backend(name)
            print(f"{name}: {be.framework} {be.framework_version()}; "
                  f"capabilities: {', '.join(sorted(be.capabilities))}")
        except UnimeshError as exc:
            print(f"{name}: unavailable ({exc})")
    if not backends():
        print('no backends installed; e.g. pip install "unimesh[jax]"')
    return 0


def _show(args: argparse.Namespace) -> int:
    from ._show import check_layout_args, describe, draw

    mesh = Mesh.from_string(args.spec)
    layout, shape = check_layout_args(mesh, args.layout, args.shape)
    if args.json:
        print(json.dumps(describe(mesh, layout, shape), indent=2))
    else:
        draw(mesh, layout, shape)
    return 0


def native_code(mesh: Mesh, backend: str) -> str:
    """The native Python that builds ``mesh`` by hand on ``backend`` (for porting)."""
    ids = mesh.device_ids.tolist()
    flat = mesh.device_ids.ravel().tolist()
    names = tuple(mesh.axis_names)
    if backend == "torch":
        return ("import torch\nfrom torch.distributed.device_mesh import DeviceMesh\n\n"
                "# every rank runs this, after torch.distributed.init_process_group\n"
                f"mesh = DeviceMesh(\"cpu\", torch.tensor({ids}), mesh_dim_names={names})")
    if backend == "jax":
        return ("import jax\nimport numpy as np\n\n"
                "# unimesh's device ids are positions in this order\n"
                "devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))\n"
                f"mesh = jax.sharding.Mesh(np.array(devices, dtype=object)[np.array({ids})], "
                f"{names})")
    if backend == "keras":
        return ("import keras\nimport numpy as np\n\n"
                "devices = keras.distribution.list_devices()\n"
                f"mesh = keras.distribution.DeviceMesh({mesh.shape}, {list(names)}, "
                f"devices=np.array(devices, dtype=object)[np.array({ids})])")
    if backend == "tensorflow":
        n = mesh.size
        return ("import numpy as np\nfrom tensorflow.experimental import dtensor\n\n"
                "# DTensor's global ids are 0..N-1; the device order is the local_devices order\n"
                f"local = [f\"/job:localhost/replica:0/task:0/device:CPU:{{i}}\" for i in {flat}]\n"
                f"mesh = dtensor.Mesh({list(names)}, np.arange({n}).reshape({mesh.shape}), "
                f"list(range({n})), local)")
    if backend == "mlx":
        lines = ["import mlx.core as mx\n", "world = mx.distributed.init()  # one process per device",
                 "rank = world.rank()"]
        for axis in names:
            lines.append(f"# {axis!r} groups: {mesh.groups(axis)}")
            lines.append(f"rows = {mesh.groups(axis)}")
            lines.append("row = next(i for i, g in enumerate(rows) if rank in g)")
            lines.append(f"{axis}_group = world.split(row, rows[row].index(rank))  # MPI backend")
        return "\n".join(lines)
    raise UnimeshError(f"no native code template for backend {backend!r}; "
                       "known: torch, jax, keras, tensorflow, mlx")


def _convert(args: argparse.Namespace) -> int:
    from .registry import get_backend, to_native

    mesh = Mesh.from_string(args.spec)
    if args.code:
        print(native_code(mesh, args.to))
        return 0
    backend = get_backend(args.to)
    backend.prepare_devices(int(mesh.device_ids.max()) + 1)
    native = to_native(mesh, backend)
    print(repr(native))
    devices = getattr(native, "devices", None)
    if devices is not None and not callable(devices):
        print(f"devices:\n{devices}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from ._check import check

    return check(list(args.backends), processes=args.processes, timeout=args.timeout,
                 json_path=args.json, markdown_path=args.markdown)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unimesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build one mesh on every installed backend")
    demo.add_argument("--mesh", default="dp=2,tp=4", help="mesh spec, e.g. dp=2,tp=4")
    demo.add_argument("--backends", default="",
                      help="comma-separated backends to run (default: all known and installed)")
    demo.set_defaults(run=_demo)
    sub.add_parser("backends", help="list installed backends").set_defaults(run=_backends)
    show = sub.add_parser("show", help="draw a mesh (and a layout's blocks) in the terminal")
    show.add_argument("spec", help="mesh spec, e.g. 'dp=2,tp=4' or 'dp=2,tp=2;ids=3,2,1,0'")
    show.add_argument("--layout", help="a spec: axis names by tensor dim, a+b for several axes, "
                                       "None for replicated, e.g. 'dp,None'")
    show.add_argument("--shape", help="the tensor's shape for --layout, e.g. 8,4")
    show.add_argument("--json", action="store_true", help="print JSON instead of drawing")
    show.set_defaults(run=_show)
    convert = sub.add_parser("convert", help="build a mesh on a backend and print the native "
                                             "object (or, with --code, the native code)")
    convert.add_argument("spec", help="mesh spec, e.g. 'dp=2,tp=4'")
    convert.add_argument("--to", required=True, help="backend: torch, jax, keras, tensorflow, mlx")
    convert.add_argument("--code", action="store_true",
                         help="print the native Python that builds it by hand")
    convert.set_defaults(run=_convert)
    chk = sub.add_parser("check", help="run the conformance suite on backends and print the "
                                        "capability matrix")
    chk.add_argument("backends", nargs="*", metavar="BACKEND",
                     help="backends to check (default: every installed one)")
    chk.add_argument("--processes", type=int, default=4,
                     help="processes for backends that run under a launcher (default 4)")
    chk.add_argument("--timeout", type=float, default=900.0,
                     help="seconds one backend's suite may take before it is killed")
    chk.add_argument("--json", metavar="PATH", help="also write the matrix as JSON")
    chk.add_argument("--markdown", metavar="PATH", help="also write the matrix as Markdown")
    chk.set_defaults(run=_check)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except UnimeshError as exc:
        print(f"unimesh: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
