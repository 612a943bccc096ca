"""Saves generation after generation into one checkpoint until it is killed:
python checkpoint_crash_worker.py BACKEND PATH LOG_DIR [MIB].

BACKEND is ``numpy`` (one process, host arrays) or a backend run under its launcher (``torch``
under torchrun, ``mlx`` under mpirun), whose arrays are sharded over every process. Generation
g holds ``gen = [g]`` and tensors whose every value is g (MIB MiB in all, default 16), so a
checkpoint read back says which generation it is and whether it is whole. After each save
returns, each process appends ``g`` to ``LOG_DIR/rank-R.log`` (flushed): the saves that had
finished when the kill came. The parent kills the whole process group with SIGKILL at a random
moment and checks what the path holds (tests/test_checkpoint_crash.py, benchmarks/crash.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

import unimesh


def main() -> None:
    backend, path, logs = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    mib = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    be = None if backend == "numpy" else backend
    rank, world = (0, 1) if be is None else unimesh.initialize(be, timeout=120)
    rows = max(world, (mib << 20) // (4 * 1024 * 4) // world * world)
    mesh = unimesh.Mesh((world,), ("x",))
    log = open(logs / f"rank-{rank}.log", "a")  # noqa: SIM115 - kept open until killed
    gen = 0
    while True:
        gen += 1
        tree: dict[str, object] = {"gen": np.array([gen], np.int64)}
        for i in range(4):
            block = np.full((rows, 1024), gen, np.float32)
            if be is not None:
                spec = unimesh.P("x") if i % 2 == 0 else unimesh.P(None, "x")
                tree[f"w{i}"] = unimesh.distribute(block, unimesh.Layout(mesh, spec), be)
            else:
                tree[f"w{i}"] = block
        unimesh.save(path, tree, backend=be, timeout=120)
        log.write(f"{gen}\n")
        log.flush()
        os.fsync(log.fileno())


if __name__ == "__main__":
    main()
