"""examples/mlp_step.py, written once, run unchanged on every backend with shard_map: JAX (8 CPU
devices in one process), torch (torchrun, 4 gloo processes), MLX (mpirun with MPI split groups,
and mlx.launch ring); every process must match the single-device numpy step to 1e-5."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .launch import require_mpirun, run_bounded

EXAMPLE = Path(__file__).parents[1] / "examples" / "mlp_step.py"
LIMIT = 180


def run(cmd: list[str], ranks: int, backend: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the example asks for its own devices
    rc, out = run_bounded(cmd, env, LIMIT)
    assert rc == 0, out[-6000:]
    lines = re.findall(r"RANK (\d+) OK backend=(\w+) mesh=(\S+) loss=([\d.]+) reference=([\d.]+)",
                       out)
    assert sorted(int(r) for r, *_ in lines) == list(range(ranks)), out[-6000:]
    assert {b for _, b, *_ in lines} == {backend}
    assert all(abs(float(loss) - float(ref)) < 1e-5 for *_, loss, ref in lines)
    assert "FAIL" not in out
    return out


def test_jax_eight_devices() -> None:
    pytest.importorskip("jax")
    out = run([sys.executable, str(EXAMPLE), "--backend", "jax"], 1, "jax")
    assert "mesh=dp=2,tp=4" in out


def test_keras_on_jax() -> None:
    pytest.importorskip("keras")
    run([sys.executable, str(EXAMPLE), "--backend", "keras"], 1, "keras")


def test_torchrun_four_processes() -> None:
    pytest.importorskip("torch")
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "4", str(EXAMPLE), "--backend", "torch"], 4, "torch")
    assert "mesh=dp=2,tp=2" in out


def test_mpirun_four_processes() -> None:
    pytest.importorskip("mlx.core")
    mpirun = require_mpirun()
    out = run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable,
               str(EXAMPLE), "--backend", "mlx"], 4, "mlx")
    assert "MPI_FINALIZE" not in out


def test_mlx_launch_ring_four_processes() -> None:
    pytest.importorskip("mlx.core")
    launcher = Path(sys.executable).with_name("mlx.launch")
    run([str(launcher), "-n", "4", "--backend", "ring", "--", sys.executable, str(EXAMPLE),
         "--backend", "mlx"], 4, "mlx")
