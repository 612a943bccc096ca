"""Crossings between the core and the torch backend in one ``psum`` inside a program.

    torchrun --standalone --nproc-per-node 2 benchmarks/crossings.py

Runs a shard_map whose body is one psum over "x" (2 processes, gloo), warm, under
``sys.setprofile``, and counts the calls from a function in ``unimesh/`` to one in
``backends/unimesh_torch/``: each is a crossing (issue 39 asks at most 4 per psum). Process 0
prints each crossing (caller -> callee) and the total, for the plain call and for one under
``unimesh.value_and_grad``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

import unimesh
from unimesh import P

ROOT = Path(__file__).resolve().parents[1]
CORE = str(ROOT / "unimesh")
BACKEND = str(ROOT / "backends" / "unimesh_torch")


def crossings(fn: Any, *args: Any) -> tuple[Any, list[str]]:
    """``fn(*args)`` and the crossings it made."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if callee.startswith(BACKEND) and caller.startswith(CORE):
            seen.append(f"{frame.f_back.f_code.co_name} -> {frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return out, seen


def main() -> None:
    be = unimesh.get_backend("torch")
    n = be.prepare_devices(2)
    mesh = unimesh.make_mesh({"x": n})
    seen: list[list[str]] = []

    def body(a: Any) -> Any:  # one psum, profiled
        out, found = crossings(unimesh.psum, a, "x")
        seen.append(found)
        return out

    program = unimesh.shard_map(body, mesh, in_specs=P("x"), out_specs=P(), backend=be)
    x = unimesh.distribute(np.arange(2.0 * n, dtype=np.float32), unimesh.Layout(mesh, P("x")), be)
    for _ in range(2):  # warm: groups and rules are built on the first call
        program(x)
    plain = seen[-1]
    for _ in range(2):
        unimesh.value_and_grad(lambda a: program(a).to_local().sum(), backend=be)(x)
    grad = seen[-1]
    if int(os.environ.get("RANK", "0")) == 0:
        for name, seen in (("psum", plain), ("psum under value_and_grad", grad)):
            print(f"{name}: {len(seen)} crossings")
            for line in seen:
                print("   ", line)


if __name__ == "__main__":
    main()
