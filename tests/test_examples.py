"""The example programs, each written once and run unchanged on every backend with shard_map:
JAX (8 CPU devices in one process), torch (torchrun, 4 gloo processes), MLX (mpirun with MPI
split groups, and mlx.launch ring). Each differentiates its loss with unimesh.value_and_grad, and
every process must match the float64 numpy loss and gradients (or updated weights) to 1e-5."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .launch import require_mpirun, run_bounded

EXAMPLES = Path(__file__).parents[1] / "examples"
NAMES = ["mlp_step", "fsdp_step", "tp_sp_block", "moe_layer", "pipeline"]
LIMIT = 180


def run(cmd: list[str], ranks: int, backend: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the example asks for its own devices
    rc, out = run_bounded(cmd, env, LIMIT)
    assert rc == 0, out[-6000:]
    lines = re.findall(
        r"RANK (\d+) OK backend=(\w+) mesh=(\S+) loss=([\d.]+) reference=([\d.]+)", out
    )
    assert sorted(int(r) for r, *_ in lines) == list(range(ranks)), out[-6000:]
    assert {b for _, b, *_ in lines} == {backend}
    assert all(abs(float(loss) - float(ref)) < 1e-5 for *_, loss, ref in lines)
    assert "FAIL" not in out
    return out


@pytest.mark.parametrize("name", NAMES)
def test_jax_eight_devices(name: str) -> None:
    pytest.importorskip("jax")
    run([sys.executable, str(EXAMPLES / f"{name}.py"), "--backend", "jax"], 1, "jax")


@pytest.mark.parametrize("name", NAMES)
def test_jax_one_device(name: str) -> None:
    """What one GPU gives: every two-axis example falls back to size-1 axes; the pipeline, which
    needs a device per stage, says so and how to run it, and exits 2."""
    pytest.importorskip("jax")
    cmd = [sys.executable, str(EXAMPLES / f"{name}.py"), "--backend", "jax", "--devices", "1"]
    if name != "pipeline":
        out = run(cmd, 1, "jax")
        assert re.search(r"mesh=(\w+=1,?)+ ", out), out[-2000:]
        return
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    rc, out = run_bounded(cmd, env, LIMIT)
    assert rc == 2, out[-3000:]
    assert "needs a multiple of 4 devices" in out and "this run has 1" in out, out[-3000:]
    assert "Traceback" not in out


def test_keras_on_jax() -> None:
    pytest.importorskip("keras")
    out = run([sys.executable, str(EXAMPLES / "mlp_step.py"), "--backend", "keras"], 1, "keras")
    assert "mesh=dp=2,tp=4" in out


@pytest.mark.parametrize("name", NAMES)
def test_torchrun_four_processes(name: str) -> None:
    pytest.importorskip("torch")
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            str(EXAMPLES / f"{name}.py"),
            "--backend",
            "torch",
        ],
        4,
        "torch",
    )


@pytest.mark.parametrize("name", NAMES)
def test_mpirun_four_processes(name: str) -> None:
    pytest.importorskip("mlx.core")
    mpirun = require_mpirun()
    out = run(
        [
            mpirun,
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "4",
            sys.executable,
            str(EXAMPLES / f"{name}.py"),
            "--backend",
            "mlx",
        ],
        4,
        "mlx",
    )
    assert "MPI_FINALIZE" not in out


@pytest.mark.parametrize("name", NAMES)
def test_mlx_launch_ring_four_processes(name: str) -> None:
    pytest.importorskip("mlx.core")
    launcher = Path(sys.executable).with_name("mlx.launch")
    run(
        [
            str(launcher),
            "-n",
            "4",
            "--backend",
            "ring",
            "--",
            sys.executable,
            str(EXAMPLES / f"{name}.py"),
            "--backend",
            "mlx",
        ],
        4,
        "mlx",
    )


@pytest.mark.parametrize(
    ("backend", "name"),
    [
        ("jax", "mlp_step"),
        ("jax", "pipeline"),
        ("torch", "tp_sp_block"),
        ("torch", "pipeline"),
        ("mlx", "mlp_step"),
    ],
)
def test_compiled_with_unimesh_compile(backend: str, name: str) -> None:
    """``--compile``: the same step under ``unimesh.compile`` (``jax.jit``; ``torch.compile``
    with its aot_eager backend under torchrun 4, no C++ build, the pipeline's ppermute as
    ``funcol.permute_tensor``; ``mx.compile`` under mpirun 4) matches the float64 reference
    as the eager step does. Every example runs compiled on
    every backend by hand (issue 38's note); these are the ones CI repeats."""
    script = [str(EXAMPLES / f"{name}.py"), "--backend", backend, "--compile"]
    if backend == "jax":
        pytest.importorskip("jax")
        run([sys.executable, *script], 1, "jax")
    elif backend == "torch":
        pytest.importorskip("torch")
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        run([*launch, "--nproc-per-node", "4", *script, "aot_eager"], 4, "torch")
    else:
        pytest.importorskip("mlx.core")
        mpirun = require_mpirun()
        launch = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable]
        run([*launch, *script], 4, "mlx")


def test_resume_on_another_framework_and_mesh(tmp_path: Path) -> None:
    """examples/resume.py: 3 steps on JAX (dp=2 x tp=4, 8 devices), saved; 3 more on torch
    under torchrun 4 (dp=4 x tp=1) from that checkpoint, saved again; 3 more on MLX under
    mpirun 4 (dp=1 x tp=4). Every step's loss on every process is the uninterrupted float64
    training's, to 1e-5: the runs go on where the last one stopped."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    pytest.importorskip("mlx.core")
    mpirun = require_mpirun()
    script = str(EXAMPLES / "resume.py")
    first, second = str(tmp_path / "ck"), str(tmp_path / "ck2")
    runs = [
        ([sys.executable, script, "--backend", "jax", "--save", first], 1, "jax", (1, 3)),
        ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
          script, "--backend", "torch", "--dp", "4", "--resume", first, "--save", second], 4,
         "torch", (4, 6)),
        ([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable, script,
          "--backend", "mlx", "--dp", "1", "--resume", second], 4, "mlx", (7, 9)),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    for cmd, ranks, backend, (lo, hi) in runs:
        rc, out = run_bounded(cmd, env, LIMIT)
        assert rc == 0, out[-6000:]
        steps = re.findall(r"RANK (\d+) STEP (\d+) LOSS ([\d.]+) REF ([\d.]+)", out)
        assert sorted({int(s) for _, s, *_ in steps}) == list(range(lo, hi + 1)), out[-3000:]
        assert len(steps) == ranks * (hi - lo + 1), out[-3000:]
        for _, _, got, want in steps:
            assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, float(want)), out[-3000:]
        done = re.findall(rf"RANK (\d+) OK backend={backend} mesh=(\S+) steps={lo}\.\.{hi}", out)
        assert sorted(int(r) for r, _ in done) == list(range(ranks)), out[-3000:]
