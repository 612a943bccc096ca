"""The conformance suite run as a user runs it (pytest --pyargs unimesh.conformance), against
every installed backend, a third-party backend pip-installed from tests/, and a broken one."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path

import pytest

import unimesh

from .support.launch import require_mpirun, run_bounded, run_ranks

LIMIT = 600  # one suite run (JAX in process: about 110 s here); our kill comes before pytest's
IN_PROCESS = ("jax", "keras", "tensorflow")
pytestmark = pytest.mark.timeout(LIMIT + 120)


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "KERAS_BACKEND", "UNIMESH_BACKEND")
    }
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    return run_bounded(cmd, env, LIMIT, cwd)


def suite_args(backend: str) -> list[str]:
    """``-m pytest ...``: the conformance suite on ``backend``, for any launcher to run."""
    return [
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--color=no",
        "--pyargs",
        "unimesh.conformance",
        "--unimesh-backend",
        backend,
    ]


def suite(
    backend: str,
    tmp_path: Path,
    env: dict[str, str] | None = None,
) -> tuple[int, str, dict]:
    matrix = tmp_path / f"matrix-{backend}.json"
    cmd = [
        sys.executable,
        *suite_args(backend),
        "--unimesh-matrix-json",
        str(matrix),
        "--unimesh-matrix-md",
        str(tmp_path / f"matrix-{backend}.md"),
    ]
    rc, out = run(cmd, env or clean_env(), tmp_path)
    return rc, out, json.loads(matrix.read_text()) if matrix.exists() else {}


@pytest.mark.parametrize("name", IN_PROCESS)
def test_suite_passes_on_installed_backend(name: str, tmp_path: Path) -> None:
    if name not in unimesh.backends():
        pytest.skip(f"backend {name!r} is not installed")
    rc, out, matrix = suite(name, tmp_path)
    assert rc == 0, out[-6000:]
    caps = unimesh.get_backend(name).capabilities
    for cap, cell in matrix[name].items():  # nothing refused: these backends take every mesh
        assert cell["verdict"] == ("pass" if cap in caps else "not declared"), (cap, cell)
        assert cell["failed"] == cell["refused"] == 0, (cap, cell)
        assert (cell["passed"] > 0) == (cap in caps), (cap, cell)
    assert "mesh" in matrix[name] and "distribute" in matrix[name]
    assert "unimesh capability matrix" in out
    assert (tmp_path / f"matrix-{name}.md").read_text().startswith(f"| capability | {name} |")


def test_suite_in_every_torchrun_rank(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        *suite_args("torch"),
    ]
    rc, out = run(
        cmd, clean_env(GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")), tmp_path
    )
    assert rc == 0, out[-6000:]
    assert not re.search(r"\d+ failed", out), out[-6000:]  # a launcher may exit 0 regardless
    summaries = re.findall(r"(\d+) passed, (\d+) skipped", out)
    assert len(summaries) == 4 and len(set(summaries)) == 1, out[-3000:]
    assert int(summaries[0][0]) >= 40
    assert out.count("unimesh capability matrix") == 4  # every rank checked and reported


def test_third_party_backend_is_found_and_passes(example_site: Path, tmp_path: Path) -> None:
    env = clean_env(PYTHONPATH=str(example_site))
    rc, out = run(
        [sys.executable, "-c", "import unimesh; print(unimesh.backends())"], env, tmp_path
    )
    assert "'example'" in out and "'example_broken'" in out, out
    rc, out, matrix = suite("example", tmp_path, env)
    assert rc == 0, out[-6000:]
    verdicts = {cap: cell["verdict"] for cap, cell in matrix["example"].items()}
    assert verdicts["distribute"] == "pass"
    assert verdicts["uneven_shards"] == "pass"
    assert verdicts["partial"] == "not declared"
    # its programs run on the core's per-process engine (a thread per device): the primitive
    # set of docs/writing-a-backend.md is enough for every collective
    assert verdicts["shard_map"] == "pass"
    assert verdicts["grad"] == "not declared"


def test_broken_backend_fails_named_tests(example_site: Path, tmp_path: Path) -> None:
    rc, out, matrix = suite("example_broken", tmp_path, clean_env(PYTHONPATH=str(example_site)))
    assert rc == 1, out[-6000:]
    failed = set(re.findall(r"FAILED \S+::(test_\w+)\[", out))
    assert {
        "test_mesh_round_trip",
        "test_distribute_gives_reference_shards",
        "test_layout_round_trip",
    } <= failed, failed
    assert matrix["example_broken"]["mesh"]["verdict"] == "fail"
    assert matrix["example_broken"]["distribute"]["verdict"] == "fail"
    assert matrix["example_broken"]["mesh"]["failed"] > 0


@pytest.mark.parametrize("launcher", ["ring", "mpi"])
def test_suite_in_every_mlx_process(launcher: str, tmp_path: Path) -> None:
    pytest.importorskip("mlx.core")
    if launcher == "ring":
        cmd = [
            str(Path(sys.executable).with_name("mlx.launch")),
            "-n",
            "4",
            "--backend",
            "ring",
            "--",
            sys.executable,
            *suite_args("mlx"),
        ]
    else:
        mpirun = require_mpirun()
        cmd = [
            mpirun,
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "4",
            sys.executable,
            *suite_args("mlx"),
        ]
    rc, out = run(cmd, clean_env(), tmp_path)
    assert rc == 0, out[-6000:]
    assert not re.search(r"\d+ failed", out), out[-6000:]  # a launcher may exit 0 regardless
    summaries = re.findall(r"(\d+) passed, (\d+) skipped", out)
    assert len(summaries) == 4 and len(set(summaries)) == 1, out[-3000:]
    assert int(summaries[0][0]) >= 40
    assert out.count("unimesh capability matrix") == 4


def test_suite_in_every_jax_distributed_process(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    envs = [
        clean_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        for i in range(2)
    ]
    codes, outs, _ = run_ranks([sys.executable, *suite_args("jax")], envs, LIMIT, tmp_path)
    for code, out in zip(codes, outs):
        assert code == 0, out[-6000:]
        (summary,) = re.findall(r"(\d+) passed, (\d+) skipped", out)
        assert int(summary[0]) >= 40
        assert "unimesh capability matrix" in out
