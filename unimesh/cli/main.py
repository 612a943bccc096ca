"""The argument parser and the small commands (``backends``, ``show``, ``convert``); ``demo``
and ``check`` have their own modules. User errors print one line and exit 2; a closed pipe
(``unimesh backends | head -1``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import LayoutError, UnimeshError
from ..mesh import Mesh
from ..visual import THRESHOLD


def backend_rows() -> list[dict[str, Any]]:
    """One row per installed backend: what ``unimesh backends`` prints (``--json`` as is)."""
    from ..registry import backends, load_backend

    rows: list[dict[str, Any]] = []
    for name in backends():
        row: dict[str, Any] = {"name": name}
        try:
            be = load_backend(name)
        except UnimeshError as exc:  # a broken plugin: its message says how to fix it
            rows.append({**row, "available": False, "error": str(exc)})
            continue
        available = be.available()  # find_spec: asked once
        launch = be.launcher(2) if available else None
        row.update(
            available=available,
            framework=be.framework,
            version=be.framework_version(),
            runs="one process" if launch is None else (be.launcher_name or launch[0][0]),
            requires=list(be.requires),
            layers=list(be.layers()),
            capabilities=sorted(be.capabilities),
        )
        if not available:
            row["error"] = f"{be.framework} is not installed: {be.install_hint()}"
        rows.append(row)
    return rows


def _backends(args: argparse.Namespace) -> int:
    rows = backend_rows()
    if args.json:
        print(compact_json(rows))
        return 0
    if not rows:
        print('no backends installed; e.g. pip install "unimesh[jax]"')
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("backend", "version", "runs", "layers", "capabilities"):
        table.add_column(col, overflow="fold")
    for row in rows:
        if not row["available"]:  # a broken plugin, or its framework is missing
            table.add_row(row["name"], "[red]unavailable[/red]", escape(row["error"]), "", "")
            continue
        runs = row["runs"] + (f"; on {', '.join(row['requires'])}" if row["requires"] else "")
        same = row["framework"] == row["name"]
        table.add_row(
            row["name"],
            str(row["version"]) if same else f"{row['framework']} {row['version']}",
            runs,
            ", ".join(row["layers"]),
            ", ".join(row["capabilities"]),
        )
    Console(soft_wrap=False).print(table)
    return 0


def compact_json(value: Any, indent: int = 2, _level: int = 0, width: int = 88) -> str:
    """JSON with one item per line, except that a list or object that fits in ``width``
    columns stays on one line (``[0, 1]``, ``{"dp": 0, "tp": 1}``, ``[[0, 2], [0, 4]]``)."""
    if isinstance(value, (list, dict)):
        flat = json.dumps(value)
        if len(flat) + indent * _level <= width:
            return flat
        pad = " " * (indent * (_level + 1))
        if isinstance(value, dict):
            body = [
                f"{pad}{json.dumps(k)}: {compact_json(v, indent, _level + 1, width)}"
                for k, v in value.items()
            ]
            open_, close = "{", "}"
        else:
            body = [f"{pad}{compact_json(v, indent, _level + 1, width)}" for v in value]
            open_, close = "[", "]"
        return open_ + "\n" + ",\n".join(body) + "\n" + " " * (indent * _level) + close
    return json.dumps(value)


def mesh_from_arg(text: str) -> Mesh:
    """The mesh a command names: a spec (``dp=2,tp=4``), or ``@FILE`` / ``-`` (stdin) holding a
    spec or a mesh's JSON (``Mesh.to_json``): a big mesh's ids do not fit on a command line
    (Linux caps one argument at 128 KiB)."""
    if text != "-" and not text.startswith("@"):
        return Mesh.from_string(text)
    if text == "-":
        body = sys.stdin.read()
    else:
        from ..config import read_text_file
        from ..errors import MeshSpecError

        body = read_text_file(text[1:], "mesh file", 1 << 30, MeshSpecError)
    body = body.strip()
    return Mesh.from_json(body) if body.startswith("{") else Mesh.from_string(body)


def _show(args: argparse.Namespace) -> int:
    from .show import describe, draw, layout_from_args, write_json

    mesh = mesh_from_arg(args.spec)
    layout, shape = layout_from_args(mesh, args.layout, args.shape)
    if args.reshard_to is not None:
        from ..layout import Layout
        from .show import parse_spec, reshard_table

        if layout is None or shape is None:
            raise LayoutError("--reshard-to needs --layout and --shape (the array it moves)")
        other = mesh if args.to_mesh is None else mesh_from_arg(args.to_mesh)
        target = Layout(other, parse_spec(args.reshard_to))
        if len(target.spec) > len(shape):
            raise LayoutError(
                f"--reshard-to {args.reshard_to} names {len(target.spec)} dims but --shape "
                f"{args.shape} has {len(shape)}"
            )
        if not 1 <= args.itemsize <= 64:
            raise LayoutError(f"--itemsize is bytes per element, 1 to 64; got {args.itemsize}")
        reshard_table(layout, target, shape, args.itemsize)
        return 0
    if args.json and mesh.size <= THRESHOLD:
        print(compact_json(describe(mesh, layout, shape)))  # laid out for reading
    elif args.json:
        write_json(sys.stdout.write, mesh, layout, shape)  # one line, streamed: bounded memory
    else:
        draw(mesh, layout, shape, full=args.full)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from ..convert import require_layout, to_native
    from ..layout import Layout
    from ..registry import backends, get_backend, load_backend
    from ..runtime import detect_launcher
    from .show import parse_spec

    mesh = mesh_from_arg(args.spec)
    layout = None if args.layout is None else Layout(mesh, parse_spec(args.layout))
    if args.code:
        be = load_backend(args.to)
        code = be.native_code(mesh)
        if code is None:
            having = [n for n in backends() if _has_template(n, mesh)]
            raise UnimeshError(
                f"backend {args.to!r} writes no native code for a mesh; "
                f"backends that do: {', '.join(having) or 'none'}"
            )
        if layout is not None:
            require_layout(be, layout)
            layout_code = be.native_code(layout)
            if layout_code is None:
                raise UnimeshError(f"backend {args.to!r} writes no native code for a layout")
            code = _join_code(code, layout_code)
        print(code)
        return 0
    backend = get_backend(args.to)
    launch = backend.launcher(mesh.size)
    if launch is not None and not args.abstract and detect_launcher() is None:
        again = ["convert", args.spec, "--to", args.to]
        again += [] if args.layout is None else ["--layout", args.layout]
        raise UnimeshError(
            f"the {backend.name} backend builds a mesh of {mesh.size} devices from "
            f"{mesh.size} processes; run this under its launcher: "
            f"{shlex.join([*launch[0], '-m', 'unimesh', *again])}; "
            "or add --code for the code to write"
        )
    from .demo import stderr_kept

    log: list[str] = []
    try:  # the frameworks' C++ log lines (TensorFlow's, XLA's) are kept unless it fails
        with stderr_kept(log):
            if args.abstract:
                native = to_native(mesh, backend, abstract=True)
            else:
                backend.request_devices(int(mesh.device_ids.max()) + 1)
                native = to_native(mesh, backend)
            native_layout = None if layout is None else to_native(layout, backend)
    except BaseException:
        sys.stderr.write("".join(log))
        raise
    launcher = detect_launcher()
    if launcher is not None and launcher.rank not in (None, 0):
        return 0  # under a launcher every process builds the mesh; the first one prints it
    print(backend.describe_native(native))
    devices = None if args.abstract else getattr(native, "devices", None)
    if devices is not None and not callable(devices):
        print(f"devices:\n{devices}")
    if native_layout is not None:
        print(f"layout:\n{backend.describe_native(native_layout)}")
    return 0


def _join_code(mesh_code: str, layout_code: str) -> str:
    """The mesh's code, then the layout's, with the layout's imports moved to the top."""
    head = [ln for ln in layout_code.splitlines() if ln.startswith(("import ", "from "))]
    body = [ln for ln in layout_code.splitlines() if ln not in head]
    lines = mesh_code.splitlines()
    at = max(
        (i + 1 for i, ln in enumerate(lines) if ln.startswith(("import ", "from "))), default=0
    )
    fresh = [ln for ln in head if ln not in lines]
    lines[at:at] = fresh
    while body and not body[0].strip():
        body.pop(0)
    return "\n".join([*lines, "", *body])


def _has_template(name: str, mesh: Mesh) -> bool:
    from ..registry import load_backend

    try:
        return load_backend(name).native_code(mesh) is not None
    except UnimeshError:
        return False


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo

    return demo(args)


def _check(args: argparse.Namespace) -> int:
    from .check import check

    return check(
        list(args.backends),
        processes=args.processes,
        timeout=args.timeout,
        json_path=args.json,
        markdown_path=args.markdown,
    )


DESCRIPTION = """\
Describe a device mesh once; get PyTorch, JAX, Keras, TensorFlow DTensor and MLX objects.

examples:
  unimesh demo
      one mesh on every installed backend, checked against the reference
  unimesh show dp=2,tp=4 --layout dp,tp --shape 8,8
      the grid, and the block of an 8x8 tensor each device holds
  unimesh convert dp=2,tp=4 --to jax --code
      the native code that builds the mesh
  unimesh check torch
      the conformance suite, under torchrun
"""

EXAMPLES = {
    "demo": """\
examples:
  unimesh demo
  unimesh demo --mesh dp=4,tp=2 --backends jax,torch
""",
    "backends": """\
examples:
  unimesh backends
  unimesh backends --json
""",
    "show": """\
examples:
  unimesh show dp=2,tp=4
  unimesh show dp=2,tp=4 --layout dp,tp --shape 8,8
  unimesh show 'dp=2,tp=2;ids=3,2,1,0' --layout dp+tp,None --shape 8,4 --json
""",
    "convert": """\
examples:
  unimesh convert dp=2,tp=4 --to jax
  unimesh convert dp=2,tp=4 --to torch --code
""",
    "check": """\
examples:
  unimesh check
  unimesh check jax mlx --processes 2 --json matrix.json
""",
    "checkpoint": """\
examples:
  unimesh checkpoint show ckpt/step-100
  unimesh checkpoint show ckpt/step-100 --json
  unimesh checkpoint verify ckpt/step-100
  unimesh checkpoint convert ckpt/step-100 hf-model --to safetensors
""",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a close-match suggestion for a mistyped choice (``unimesh shwo``)."""

    def error(self, message: str) -> NoReturn:
        import re

        from ..messages import close_match

        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            message += close_match(found.group(1), re.findall(r"'([^']*)'", found.group(2)))
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="unimesh", description=DESCRIPTION, formatter_class=raw)
    parser.add_argument("--version", action="version", version=f"unimesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=help, epilog=EXAMPLES[name], formatter_class=raw
        )

    demo = command("demo", "build one mesh on every installed backend and check its blocks")
    demo.add_argument("--mesh", default="dp=2,tp=4", help="mesh spec (default: dp=2,tp=4)")
    demo.add_argument(
        "--backends",
        default="",
        help="comma-separated backends to run (default: every installed one)",
    )
    demo.set_defaults(run=_demo)
    listing = command("backends", "list the installed backends, their layers and capabilities")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(run=_backends)
    show = command("show", "draw a mesh (and a layout's blocks) in the terminal")
    show.add_argument(
        "spec",
        help="mesh spec, e.g. 'dp=2,tp=4' or 'dp=2,tp=2;ids=3,2,1,0'; @FILE or - (stdin) for a "
        "file holding a spec or the mesh's JSON",
    )
    show.add_argument(
        "--layout",
        help="a spec: axis names by tensor dim, a+b for several axes, "
        "None for replicated, e.g. 'dp,None'",
    )
    show.add_argument("--shape", help="the tensor's shape for --layout, e.g. 8,4")
    show.add_argument(
        "--reshard-to",
        help="another spec: print what unimesh.reshard moves from --layout to it (each "
        "device's bytes kept, received and sent), beside an all-gather-and-slice",
    )
    show.add_argument("--to-mesh", help="the target's mesh for --reshard-to (default: the same)")
    show.add_argument(
        "--itemsize", type=int, default=4, help="bytes per element for --reshard-to (default 4)"
    )
    show.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of drawing: the device ids, processes and blocks as arrays "
        "of the mesh's shape",
    )
    show.add_argument(
        "--full",
        action="store_true",
        help=f"draw every device (a mesh of more than {THRESHOLD} devices, or wider than the "
        "terminal, is otherwise summarised)",
    )
    show.set_defaults(run=_show)
    convert = command(
        "convert",
        "build a mesh on a backend and print the native object (or, with --code, the native code)",
    )
    convert.add_argument("spec", help="mesh spec, e.g. 'dp=2,tp=4'; @FILE or - (stdin) as for show")
    convert.add_argument("--to", required=True, help="an installed backend (see: unimesh backends)")
    convert.add_argument(
        "--code", action="store_true", help="print the native Python that builds it by hand"
    )
    convert.add_argument(
        "--layout",
        help="a spec on the mesh, e.g. dp,None or dp+tp (None/_ replicated): print the native "
        "layout too (with --code, the code that builds it: NamedSharding, placements, ...)",
    )
    convert.add_argument(
        "--abstract",
        action="store_true",
        help="a device-free mesh (jax.sharding.AbstractMesh) where the backend has one: any "
        "size, no devices created",
    )
    convert.set_defaults(run=_convert)
    chk = command("check", "run the conformance suite on backends and print the capability matrix")
    chk.add_argument(
        "backends",
        nargs="*",
        metavar="BACKEND",
        help="backends to check (default: every installed one)",
    )
    chk.add_argument(
        "--processes",
        type=int,
        default=4,
        help="processes for backends that run under a launcher (default 4)",
    )
    chk.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds one backend's suite may take before it is killed",
    )
    chk.add_argument("--json", metavar="PATH", help="also write the matrix as JSON")
    chk.add_argument("--markdown", metavar="PATH", help="also write the matrix as Markdown")
    chk.set_defaults(run=_check)
    ck = command("checkpoint", "inspect or verify a unimesh checkpoint (no framework needed)")
    ck_sub = ck.add_subparsers(dest="action", required=True, metavar="ACTION")
    ck_show = ck_sub.add_parser(
        "show", help="tensors, shapes, dtypes, saved layouts and sizes", description="tensors, "
        "shapes, dtypes, saved layouts and sizes of a checkpoint",
    )  # fmt: skip
    ck_show.add_argument("path", help="the checkpoint's directory")
    ck_show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ck_show.set_defaults(run=lambda a: _checkpoint("show", a))
    ck_verify = ck_sub.add_parser(
        "verify", help="check every file and byte range; exit 1 naming what is wrong",
        description="check that every byte range lies inside its file, every tensor is tiled "
        "exactly once and every safetensors header agrees with the manifest; exit 1 naming "
        "what is wrong",
    )  # fmt: skip
    ck_verify.add_argument("path", help="the checkpoint's directory")
    ck_verify.set_defaults(run=lambda a: _checkpoint("verify", a))
    ck_convert = ck_sub.add_parser(
        "convert", help="write a checkpoint as Hugging Face safetensors, streaming",
        description="write the checkpoint SRC into the directory DST as Hugging Face "
        "safetensors (model.safetensors, or shards with model.safetensors.index.json), "
        "reading and writing at most a window of any tensor at once, with a progress bar",
    )  # fmt: skip
    ck_convert.add_argument("src", help="the checkpoint's directory")
    ck_convert.add_argument("dst", help="the directory to write")
    ck_convert.add_argument(
        "--to", choices=["safetensors"], required=True, help="the format to write"
    )
    ck_convert.add_argument(
        "--max-shard-size", type=_bytes, default=5 << 30, metavar="SIZE",
        help="largest file, e.g. 5GB, 500MB (default 5GB)",
    )  # fmt: skip
    ck_convert.add_argument("--quiet", action="store_true", help="no progress bar")
    ck_convert.set_defaults(run=lambda a: _checkpoint("convert", a))
    return parser


def _bytes(text: str) -> int:
    """``5GB``, ``500MB``, ``64KiB``, ``1000``: a size in bytes (argparse type)."""
    import re

    m = re.fullmatch(r"\s*(\d{1,15})\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if m is None or int(m[1]) == 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 1000)")
    power = " KMGT".index(m[2].upper() or " ")
    size: int = int(m[1]) * (1024 if m[3] else 1000) ** power
    return size


def _checkpoint(action: str, args: argparse.Namespace) -> int:
    from . import checkpoint

    if action == "show":
        return checkpoint.show(args.path, args.json)
    if action == "convert":
        return checkpoint.convert(args.src, args.dst, int(args.max_shard_size), not args.quiet)
    return checkpoint.verify(args.path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UnimeshError as exc:
        print(f"unimesh: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader is gone (| head): stop quietly; stdout goes to devnull so that Python's
        # own flush at exit does not raise again
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
