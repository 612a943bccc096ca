"""Real MLX runs started from pytest: mpirun (MPI backend, split groups) and mlx.launch (ring
backend, emulated axis groups), 4 processes, a 2x2 mesh; bounded in time."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .support.launch import WORKERS, require_mpirun, run_bounded

pytest.importorskip("mlx.core")

WORKER = WORKERS / "mlx_worker.py"
LIMIT = 120


def launch(cmd: list[str]) -> tuple[int, str]:
    return run_bounded(cmd, dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), LIMIT)


def check_ranks(rc: int, out: str) -> None:
    assert rc == 0, out[-6000:]
    done = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"RANK (\d+) OK (\d+)", out)}
    assert sorted(done) == [0, 1, 2, 3], out[-6000:]
    assert len(set(done.values())) == 1 and min(done.values()) >= 30, done
    assert "FAIL" not in out and "MPI_FINALIZE" not in out


def test_mpirun_with_split_groups() -> None:
    mpirun = require_mpirun()
    rc, out = launch(
        [
            mpirun,
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "4",
            sys.executable,
            str(WORKER),
            "mpi",
        ]
    )
    check_ranks(rc, out)
    assert "split groups in use: True" in out


def test_mlx_launch_ring_with_emulated_groups() -> None:
    launcher = Path(sys.executable).with_name("mlx.launch")
    rc, out = launch(
        [str(launcher), "-n", "4", "--backend", "ring", "--", sys.executable, str(WORKER), "ring"]
    )
    check_ranks(rc, out)
    assert "split groups in use: False" in out
