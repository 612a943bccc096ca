"""``unimesh`` / ``python -m unimesh``: the command line.

Commands: ``demo`` (the main job), ``backends``. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from .errors import UnimeshError

KNOWN_BACKENDS = ("torch", "jax", "keras", "tensorflow", "mlx")


def _demo(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .layout import Layout, PartitionSpec
    from .mesh import Mesh
    from .registry import backends, get_backend, to_native

    console = Console(width=120)
    mesh = Mesh.from_string(args.mesh)
    # a 2-D tensor: rows over the first axis, columns over the second (if any)
    spec_axes = list(mesh.axis_names[:2])
    layout = Layout(mesh, PartitionSpec(spec_axes[0], spec_axes[1] if len(spec_axes) > 1 else None))
    shape = (2 * mesh.shape[0], 2 * (mesh.shape[1] if mesh.ndim > 1 else 1))
    x = np.arange(shape[0] * shape[1], dtype=np.float64).reshape(shape)
    w = np.linspace(-1.0, 1.0, shape[1] * 3).reshape(shape[1], 3)

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
    out = np.zeros((shape[0], w.shape[1]))
    for sl in blocks.values():
        covered[sl] += 1
    reps = mesh.size // int(np.prod([mesh.axis_size(a) for a in spec_axes]))
    for sl in blocks.values():
        out[sl[0]] += x[sl] @ w[sl[-1]] / reps
    ok_tiles = bool((covered == reps).all())
    ok_matmul = bool(np.allclose(out, x @ w))
    ref_ms = (time.perf_counter() - t0) * 1e3

    table = Table(title="one mesh, every backend")
    for col in ("backend", "native object", "shards vs reference", "result vs numpy", "time"):
        table.add_column(col)
    table.add_row("reference (numpy)", f"{len(blocks)} blocks", "ok" if ok_tiles else "FAIL",
                  "ok" if ok_matmul else "FAIL", f"{ref_ms:.1f} ms")
    installed = backends()
    failures = 0 if ok_tiles and ok_matmul else 1
    for name in sorted(set(KNOWN_BACKENDS) | set(installed)):
        if name not in installed:
            table.add_row(name, "[dim]backend not installed[/dim]", "-", "-",
                          escape(f'pip install "unimesh[{name}]"'))
            continue
        try:
            be = get_backend(name)
            t0 = time.perf_counter()
            native = to_native(mesh, be)
            ms = (time.perf_counter() - t0) * 1e3
            table.add_row(name, type(native).__name__, "-", "-", f"{ms:.1f} ms")
        except UnimeshError as exc:
            table.add_row(name, f"[yellow]{type(exc).__name__}[/yellow]", "-", "-",
                          escape(str(exc)[:60]))
    console.print(table)
    return 1 if failures else 0


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unimesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build one mesh on every installed backend")
    demo.add_argument("--mesh", default="dp=2,tp=4", help="mesh spec, e.g. dp=2,tp=4")
    demo.set_defaults(run=_demo)
    sub.add_parser("backends", help="list installed backends").set_defaults(run=_backends)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except UnimeshError as exc:
        print(f"unimesh: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
