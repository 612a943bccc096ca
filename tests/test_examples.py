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

from .support.launch import WORKERS, require_mpirun, run_bounded

EXAMPLES = Path(__file__).parents[1] / "examples"
WORKER = WORKERS / "examples_worker.py"
NAMES = ["mlp_step", "fsdp_step", "tp_sp_block", "moe_layer", "pipeline"]
LIMIT = 180
#: one launch runs every example of a launcher (examples_worker.py), each example its own test
ALL_LIMIT = 450
_RUNS: dict[str, tuple[str, list[str]]] = {}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the example asks for its own devices
    return env


def check(out: str, ranks: int, backend: str) -> str:
    """Every rank's OK line, on ``backend``, its loss within 1e-5 of float64 numpy's."""
    lines = re.findall(
        r"RANK (\d+) OK backend=(\w+) mesh=(\S+) loss=([\d.]+) reference=([\d.]+)", out
    )
    assert sorted(int(r) for r, *_ in lines) == list(range(ranks)), out[-6000:]
    assert {b for _, b, *_ in lines} == {backend}
    assert all(abs(float(loss) - float(ref)) < 1e-5 for *_, loss, ref in lines)
    assert "FAIL" not in out
    return out


def run(cmd: list[str], ranks: int, backend: str) -> str:
    rc, out = run_bounded(cmd, _env(), LIMIT)
    assert rc == 0, out[-6000:]
    return check(out, ranks, backend)


def shared(
    key: str, launch: list[str], names: list[str], args: list[str], name: str, ranks: int
) -> tuple[str, int]:
    """What example ``name`` printed (every rank's lines, without the ``[name] `` tag) in the
    one launch that runs all of ``names`` under ``launch`` (made by the first test that asks),
    and its exit code (every rank's must agree)."""
    if key not in _RUNS:
        command = [*launch, str(WORKER), ",".join(names), "--", *args]
        rc, out = run_bounded(command, _env(), ALL_LIMIT)
        assert rc == 0, out[-6000:]
        _RUNS[key] = (out, names)
    out, _ = _RUNS[key]
    mine = re.findall(rf"^\[{name}\] (.*)$", out, re.MULTILINE)
    exits = {int(code) for code in re.findall(rf"^\[{name}\] EXIT (-?\d+)$", out, re.MULTILINE)}
    assert len(re.findall(rf"^\[{name}\] EXIT", out, re.MULTILINE)) == ranks, out[-6000:]
    assert len(exits) == 1, (name, exits, out[-6000:])
    return "\n".join(mine), exits.pop()


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]


def mpirun() -> list[str]:
    return [require_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable]


def ring() -> list[str]:
    launcher = Path(sys.executable).with_name("mlx.launch")
    return [str(launcher), "-n", "4", "--backend", "ring", "--", sys.executable]


@pytest.mark.timeout(ALL_LIMIT + 60)
@pytest.mark.parametrize("name", NAMES)
def test_jax_eight_devices(name: str) -> None:
    pytest.importorskip("jax")
    out, code = shared("jax8", [sys.executable], NAMES, ["--backend", "jax"], name, 1)
    assert code == 0, out[-6000:]
    check(out, 1, "jax")


@pytest.mark.timeout(ALL_LIMIT + 60)
@pytest.mark.parametrize("name", NAMES)
def test_jax_one_device(name: str) -> None:
    """What one GPU gives: every two-axis example falls back to size-1 axes; the pipeline, which
    needs a device per stage, says so and how to run it, and exits 2."""
    pytest.importorskip("jax")
    args = ["--backend", "jax", "--devices", "1"]
    out, code = shared("jax1", [sys.executable], NAMES, args, name, 1)
    if name != "pipeline":
        assert code == 0, out[-6000:]
        check(out, 1, "jax")
        assert re.search(r"mesh=(\w+=1,?)+ ", out), out[-2000:]
        return
    assert code == 2, out[-3000:]
    assert "needs a multiple of 4 devices" in out and "this run has 1" in out, out[-3000:]
    assert "Traceback" not in out


def test_keras_on_jax() -> None:
    pytest.importorskip("keras")
    out = run([sys.executable, str(EXAMPLES / "mlp_step.py"), "--backend", "keras"], 1, "keras")
    assert "mesh=dp=2,tp=4" in out


@pytest.mark.timeout(ALL_LIMIT + 60)
@pytest.mark.parametrize("name", NAMES)
def test_torchrun_four_processes(name: str) -> None:
    pytest.importorskip("torch")
    out, code = shared("torchrun", torchrun(), NAMES, ["--backend", "torch"], name, 4)
    assert code == 0, out[-6000:]
    check(out, 4, "torch")


@pytest.mark.timeout(ALL_LIMIT + 60)
@pytest.mark.parametrize("name", NAMES)
def test_mpirun_four_processes(name: str) -> None:
    pytest.importorskip("mlx.core")
    out, code = shared("mpirun", mpirun(), NAMES, ["--backend", "mlx"], name, 4)
    assert code == 0, out[-6000:]
    check(out, 4, "mlx")
    assert "MPI_FINALIZE" not in _RUNS["mpirun"][0]


@pytest.mark.timeout(ALL_LIMIT + 60)
@pytest.mark.parametrize("name", NAMES)
def test_mlx_launch_ring_four_processes(name: str) -> None:
    pytest.importorskip("mlx.core")
    out, code = shared("ring", ring(), NAMES, ["--backend", "mlx"], name, 4)
    assert code == 0, out[-6000:]
    check(out, 4, "mlx")


#: the compiled runs CI repeats, by backend (one launch each)
COMPILED = {"jax": ["mlp_step", "pipeline"], "torch": ["tp_sp_block", "pipeline"],
            # MLX: every gradient step (a compiled one sums where the body's graph says)
            "mlx": ["mlp_step", "fsdp_step", "tp_sp_block", "moe_layer", "pipeline"]}  # fmt: skip


@pytest.mark.timeout(ALL_LIMIT + 60)
@pytest.mark.parametrize(
    ("backend", "name"), [(b, n) for b, names in COMPILED.items() for n in names]
)
def test_compiled_with_unimesh_compile(backend: str, name: str) -> None:
    """``--compile``: the same step under ``unimesh.compile`` (``jax.jit``; ``torch.compile``
    with its aot_eager backend under torchrun 4, no C++ build, the pipeline's ppermute as
    ``funcol.permute_tensor``; ``mx.compile`` under mpirun 4) matches the float64 reference
    as the eager step does. Every example runs compiled on
    every backend by hand (issue 38's note); these are the ones CI repeats."""
    args = ["--backend", backend, "--compile"]
    if backend == "jax":
        pytest.importorskip("jax")
        launch, ranks = [sys.executable], 1
    elif backend == "torch":
        pytest.importorskip("torch")
        launch, ranks, args = torchrun(), 4, [*args, "aot_eager"]
    else:
        pytest.importorskip("mlx.core")
        launch, ranks = mpirun(), 4
    out, code = shared(f"compiled-{backend}", launch, COMPILED[backend], args, name, ranks)
    assert code == 0, out[-6000:]
    check(out, ranks, backend)


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
