"""The argument parser and the small commands (``backends``, ``show``, ``convert``); ``demo``
and ``check`` have their own modules. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..errors import UnimeshError
from ..mesh import Mesh


def _backends(args: argparse.Namespace) -> int:
    from ..registry import backends, get_backend

    for name in backends():
        try:
            be = get_backend(name)
            launch = be.launcher(2)
            runs = "one process" if launch is None else (be.launcher_name or launch[0][0])
            needs = f"; builds on {', '.join(be.requires)}" if be.requires else ""
            print(
                f"{name}: {be.framework} {be.framework_version()}; runs: {runs}{needs}; "
                f"layers: {' + '.join(be.layers())}; "
                f"capabilities: {', '.join(sorted(be.capabilities))}"
            )
        except UnimeshError as exc:  # its message carries the install hint
            print(f"{name}: unavailable ({exc})")
    if not backends():
        print('no backends installed; e.g. pip install "unimesh[jax]"')
    return 0


def _show(args: argparse.Namespace) -> int:
    from .show import describe, draw, layout_from_args

    mesh = Mesh.from_string(args.spec)
    layout, shape = layout_from_args(mesh, args.layout, args.shape)
    if args.json:
        print(json.dumps(describe(mesh, layout, shape), indent=2))
    else:
        draw(mesh, layout, shape)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from ..registry import backends, get_backend, load_backend, to_native

    mesh = Mesh.from_string(args.spec)
    if args.code:
        code = load_backend(args.to).native_code(mesh)
        if code is None:
            having = [n for n in backends() if _has_template(n, mesh)]
            raise UnimeshError(
                f"backend {args.to!r} writes no native code for a mesh; "
                f"backends that do: {', '.join(having) or 'none'}"
            )
        print(code)
        return 0
    backend = get_backend(args.to)
    backend.prepare_devices(int(mesh.device_ids.max()) + 1)
    native = to_native(mesh, backend)
    print(repr(native))
    devices = getattr(native, "devices", None)
    if devices is not None and not callable(devices):
        print(f"devices:\n{devices}")
    return 0


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unimesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build one mesh on every installed backend")
    demo.add_argument("--mesh", default="dp=2,tp=4", help="mesh spec, e.g. dp=2,tp=4")
    demo.add_argument(
        "--backends",
        default="",
        help="comma-separated backends to run (default: every installed one)",
    )
    demo.set_defaults(run=_demo)
    sub.add_parser("backends", help="list installed backends").set_defaults(run=_backends)
    show = sub.add_parser("show", help="draw a mesh (and a layout's blocks) in the terminal")
    show.add_argument("spec", help="mesh spec, e.g. 'dp=2,tp=4' or 'dp=2,tp=2;ids=3,2,1,0'")
    show.add_argument(
        "--layout",
        help="a spec: axis names by tensor dim, a+b for several axes, "
        "None for replicated, e.g. 'dp,None'",
    )
    show.add_argument("--shape", help="the tensor's shape for --layout, e.g. 8,4")
    show.add_argument("--json", action="store_true", help="print JSON instead of drawing")
    show.set_defaults(run=_show)
    convert = sub.add_parser(
        "convert",
        help="build a mesh on a backend and print the native "
        "object (or, with --code, the native code)",
    )
    convert.add_argument("spec", help="mesh spec, e.g. 'dp=2,tp=4'")
    convert.add_argument("--to", required=True, help="an installed backend (see: unimesh backends)")
    convert.add_argument(
        "--code", action="store_true", help="print the native Python that builds it by hand"
    )
    convert.set_defaults(run=_convert)
    chk = sub.add_parser(
        "check", help="run the conformance suite on backends and print the capability matrix"
    )
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
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except UnimeshError as exc:
        print(f"unimesh: error: {exc}", file=sys.stderr)
        return 2
