"""One process of a checked-mode run (torchrun, mpirun or mlx.launch). Started by
tests/test_programs.py.

    python tests/workers/checked_worker.py BACKEND MODES OUT_DIR

MODES: one or more of (comma-separated, run one after another in the same processes)
``clean`` (every process agrees: the result must be right), ``shape`` (process 1 sums an array
of another shape), ``axes`` (process 1 sums over another axis). With
``shard_map(..., checked=True)`` every process must raise MeshMismatchError naming the
difference instead of hanging, and the processes go on to the next mode; each writes
OUT_DIR/MODE/rank-R.json with what it saw.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import unimesh
from unimesh import P


def run(backend: str, rank: int, mode: str, out_dir: Path) -> None:
    mesh = unimesh.Mesh.from_string("dp=2,tp=2")

    def body(b):  # type: ignore[no-untyped-def]
        odd = rank == 1
        if mode == "shape" and odd:
            b = b[:, :1] * 1.0
        first = "dp" if mode == "axes" and odd else "tp"
        rows = unimesh.psum(b, first)
        return unimesh.psum(rows.sum(), "tp" if first == "dp" else "dp")

    program = unimesh.shard_map(body, mesh, P("dp", "tp"), P(), backend=backend, checked=True)
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    try:
        value = float(np.asarray(unimesh.full_array(program(x), backend=backend)))
        seen = {"value": value}
    except unimesh.MeshMismatchError as exc:
        seen = {"error": str(exc)}
    (out_dir / mode).mkdir(exist_ok=True)
    (out_dir / mode / f"rank-{rank}.json").write_text(json.dumps(seen))
    print(f"RANK {rank} {mode} {seen}", flush=True)


def main() -> None:
    backend, modes, out_dir = sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3])
    rank, _ = unimesh.initialize(backend)
    for mode in modes:
        run(backend, rank, mode, out_dir)
    if backend == "torch":  # gloo's teardown after a raised mismatch may abort: leave now
        os._exit(0)


if __name__ == "__main__":
    main()
