"""The programs of program_cases.py, written once: JAX (jax.grad through jax.shard_map) gives
the reference loss and gradients; torch under torchrun and MLX under mpirun and mlx.launch (4
processes each) must give the same on every process, to 1e-5, through unimesh.value_and_grad
and through the framework's own autodiff (torch .backward(), mx.value_and_grad)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from .support.launch import WORKERS, free_port, require_mpirun, run_bounded

SUPPORT = Path(__file__).parent / "support"
WORKER = WORKERS / "program_worker.py"
LIMIT = 300  # seconds for one launcher run (about 25 s here); the kill must come before pytest's
pytestmark = pytest.mark.timeout(2 * LIMIT + 120)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("jax")
    sys.path.insert(0, str(SUPPORT))
    import program_cases

    import unimesh

    mesh = unimesh.Mesh.from_string(program_cases.MESH)
    arrays = {}
    for case in program_cases.CASES:
        for key, value in program_cases.run(case, mesh, "jax").items():
            arrays[f"{case.name}:{key}"] = value
    path = tmp_path_factory.mktemp("programs") / "reference.npz"
    np.savez(path, **arrays)
    return path


def test_issue_example_gradient_on_jax(reference: Path) -> None:
    """The reference itself: the true gradient of the issue's program is 16 everywhere."""
    want = np.load(reference)
    np.testing.assert_allclose(want["issue-example:grad2"], np.full((8, 1), 16.0))


def test_compiled_steps_on_jax_are_jax_jit(reference: Path) -> None:
    """unimesh.compile on JAX is jax.jit of the step: the same values and gradients as the
    eager step (the reference), and the compiled object is JAX's own."""
    import jax
    import program_cases

    import unimesh

    mesh = unimesh.Mesh.from_string(program_cases.MESH)
    want = np.load(reference)
    assert isinstance(unimesh.compile(lambda x: x, backend="jax"), type(jax.jit(lambda x: x)))
    for case in program_cases.CASES:
        if case.name in program_cases.COMPILED:
            for key, value in program_cases.run(case, mesh, "jax", compiled=True).items():
                expected = want[f"{case.name}:{key}"]  # the workers' measure: 1e-5 of max(1, |x|)
                error = np.abs(value - expected) / np.maximum(1.0, np.abs(expected))
                assert float(np.max(error, initial=0.0)) <= 1e-5, (case.name, key)
    with pytest.raises(unimesh.LayoutError, match=r"compile\(\) needs a function, got 3"):
        unimesh.compile(3, backend="jax")  # type: ignore[arg-type]
    with pytest.raises(unimesh.LayoutError, match=r"compiler_options is a dict .*got 3"):
        unimesh.compile(lambda x: x, backend="jax", compiler_options=3)  # type: ignore[arg-type]
    with pytest.raises(unimesh.UnsupportedError, match="does not implement compile"):
        unimesh.compile(lambda x: x, backend="tensorflow")


def _check(
    out_dir: Path,
    ranks: int,
    output: str,
    extra: tuple[str, ...] = (),
) -> None:
    import program_cases
    import reshard_cases

    import unimesh

    backend = "torch" if "full-array-bfloat16" in extra else "mlx"
    uneven = unimesh.get_backend(backend).supports("uneven_shards")
    extra += tuple(
        f"reshard:{name}" for name, *_ in reshard_cases.cases(4, backend == "torch", uneven)
    )
    if backend == "mlx":  # unimesh.value_and_grad through a reshard and a program's psum
        extra += tuple(
            f"psum-gradient:{name}" for name, *_ in reshard_cases.psum_gradient_cases(4, uneven)
        )
    if backend == "torch":  # pending reductions, and torch's autograd through a reshard
        extra += tuple(f"reshard:{name}" for name, *_ in reshard_cases.partial_cases(4))
    extra += ("reshard:gradient",)  # torch's autograd, MLX under unimesh.value_and_grad
    extra += ("reshard:rounds",)  # the exchange in rounds of a few bytes
    if "cross" in extra:  # torch and a second framework in the same processes, both ways
        extra = tuple(e for e in extra if e != "cross")
        extra += tuple(f"cross:{name}" for name, *_ in reshard_cases.cross_cases(4, "jax"))
    reports = {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out_dir.glob("rank-*.json")
    }
    assert sorted(reports) == list(range(ranks)), output[-4000:]
    for rank, report in reports.items():
        compiled = [f"compiled:{name}" for name in program_cases.COMPILED]
        compiled += [f"planned:{name}" for name in program_cases.planned_names(backend)]
        assert sorted(report) == sorted(
            [c.name for c in program_cases.CASES]
            + ["native-autodiff", "unused-collective", "psum-small-ints", *compiled, *extra]
        )
        bad = {k: v for k, v in report.items() if not isinstance(v, float) or v > 1e-5}
        assert not bad, f"rank {rank}: {json.dumps(bad, indent=1)[:6000]}"


def _run(
    cmd: list[str],
    ranks: int,
    out_dir: Path,
    extra: tuple[str, ...] = (),
    cross: dict[str, str] | None = None,
) -> None:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
        **(cross or {}),
    )
    rc, out = run_bounded(cmd, env, LIMIT)
    assert rc == 0, out[-6000:]
    _check(out_dir, ranks, out, extra)


def test_torchrun_four_processes(reference: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            str(WORKER),
            "torch",
            str(reference),
            str(tmp_path),
        ],
        4,
        tmp_path,
        ("typed-refusal", "typed-refusal-compiled", "full-array-bfloat16", "cross"),
        # and JAX in the same 4 processes (jax.distributed, one CPU device each): reshard
        # between DTensors and jax.Arrays both ways
        {
            "UNIMESH_CROSS": "jax",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
            "JAX_NUM_PROCESSES": "4",
            "XLA_FLAGS": "",
        },
    )  # torch follows JAX's check_vma rules, refusal included, eager and under torch.compile


def test_mpirun_four_processes(reference: Path, tmp_path: Path) -> None:
    pytest.importorskip("mlx.core")
    mpirun = require_mpirun()
    _run(
        [
            mpirun,
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "4",
            sys.executable,
            str(WORKER),
            "mlx",
            str(reference),
            str(tmp_path),
        ],
        4,
        tmp_path,
        (
            "rules-only-when-traced",
            "gradient-communication",
            "compiled-forward-without-rules",
            "compiled-other-mesh",
            "cross",
        ),
        # and torch in the same 4 processes (gloo): reshard between MLXArrays and DTensors
        {
            "UNIMESH_CROSS": "torch",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        },
    )


def test_mlx_launch_ring_four_processes(reference: Path, tmp_path: Path) -> None:
    pytest.importorskip("mlx.core")
    launcher = Path(sys.executable).with_name("mlx.launch")
    rc_out = [
        str(launcher),
        "-n",
        "4",
        "--backend",
        "ring",
        "--",
        sys.executable,
        str(WORKER),
        "mlx",
        str(reference),
        str(tmp_path),
    ]
    mlx_only = ("rules-only-when-traced", "compiled-forward-without-rules", "compiled-other-mesh")
    _run(rc_out, 4, tmp_path, mlx_only)


CHECKED = WORKERS / "checked_worker.py"


def _launch(launcher: str) -> list[str]:
    if launcher == "torchrun":
        pytest.importorskip("torch")
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
        ]
    pytest.importorskip("mlx.core")
    if launcher == "mpirun":
        return [
            require_mpirun(),
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "4",
            sys.executable,
        ]
    return [
        str(Path(sys.executable).with_name("mlx.launch")),
        "-n",
        "4",
        "--backend",
        "ring",
        "--",
        sys.executable,
    ]


CHECKED_CASES = [
    ("torchrun", "clean"),
    ("torchrun", "shape"),
    ("torchrun", "axes"),
    ("mpirun", "clean"),
    ("mpirun", "axes"),
    ("ring", "shape"),
]
_CHECKED_RUNS: dict[str, tuple[int, str, Path]] = {}


def _checked_run(launcher: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """One launch per launcher runs all of its modes one after another (the first test of
    the launcher that asks makes it): (exit code, output, the folder of every mode's files)."""
    if launcher not in _CHECKED_RUNS:
        backend = "torch" if launcher == "torchrun" else "mlx"
        modes = ",".join(m for lc, m in CHECKED_CASES if lc == launcher)
        out_dir = tmp_path_factory.mktemp(f"checked-{launcher}")
        rc, out = run_bounded(
            [*_launch(launcher), str(CHECKED), backend, modes, str(out_dir)],
            dict(os.environ, OMP_NUM_THREADS="1"),
            LIMIT,
        )
        _CHECKED_RUNS[launcher] = (rc, out, out_dir)
    return _CHECKED_RUNS[launcher]


@pytest.mark.parametrize(("launcher", "mode"), CHECKED_CASES)
def test_checked_mode_names_what_processes_disagree_on(
    launcher: str, mode: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """shard_map(checked=True): process 1 sums another shape, or over another axis; instead of
    hanging, every process raises the same MeshMismatchError naming the field and who differs,
    and goes on (the modes of one launcher run in one launch). Agreeing processes get the
    right value."""
    rc, out, out_dir = _checked_run(launcher, tmp_path_factory)
    seen = {
        int(p.stem.split("-")[1]): json.loads(p.read_text())
        for p in (out_dir / mode).glob("rank-*.json")
    }
    ran = sorted(p.name for p in out_dir.iterdir())
    assert sorted(seen) == [0, 1, 2, 3], f"mode {mode} (modes with files: {ran}): {out[-4000:]}"
    assert rc == 0, out[-4000:]  # every process reported and left cleanly
    if mode == "clean":
        assert all(s == {"value": 120.0} for s in seen.values()), seen
        return
    errors = {s.get("error") for s in seen.values()}
    assert len(errors) == 1 and None not in errors, seen  # the same message everywhere
    (message,) = errors
    assert f"differs between processes ({mode})" in message
    assert "process(es) [0, 2, 3] call psum over ('tp',)" in message
    assert "process(es) [1] call psum over" in message
    assert ("(2, 1)" in message) if mode == "shape" else ("over ('dp',)" in message)
