"""JAX's own shard_map tests, ported (jax_suite.py names the source commit): JAX's run of each
case (jax.shard_map with jax.lax, check_vma, float64) is the reference; unimesh's run of the
same body on JAX, on torch under torchrun (4 processes) and on MLX under mpirun (4 processes)
must give the same outputs, every process's own blocks and the same gradients. A case unimesh
cannot express is a strict xfail: it fails the day it works, so it is moved out of the list."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from .support.launch import WORKERS, require_mpirun, run_bounded

SUPPORT = Path(__file__).parent / "support"
sys.path.insert(0, str(SUPPORT))
import jax_suite

WORKER = WORKERS / "jax_suite_worker.py"
LIMIT = 300  # seconds for one run (about 20 s here)
pytestmark = pytest.mark.timeout(3 * LIMIT + 120)

CASES = jax_suite.cases()


def _params() -> list[Any]:
    return [
        pytest.param(
            case.name,
            id=case.name,
            marks=() if case.expressible else pytest.mark.xfail(strict=True, reason=case.why),
        )
        for case in CASES
    ]


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
    )


def _reports(out_dir: Path, backend: str, ranks: int, output: str) -> dict[int, dict[str, Any]]:
    found = {
        int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text())
        for p in out_dir.glob(f"{backend}-rank-*.json")
    }
    assert sorted(found) == list(range(ranks)), output[-4000:]
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JAX's own run in its own process (x64 and 8 devices), with the JAX backend's port."""
    pytest.importorskip("jax")
    out = tmp_path_factory.mktemp("jax_suite")
    rc, output = run_bounded([sys.executable, str(WORKER), "reference", str(out)], _env(), LIMIT)
    assert rc == 0, output[-6000:]
    _reports(out, "jax", 1, output)
    return out


@pytest.fixture(scope="module")
def torch_reports(reference: Path) -> dict[int, dict[str, Any]]:
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", str(WORKER), "torch", str(reference)]  # fmt: skip
    rc, output = run_bounded(cmd, _env(), LIMIT)
    assert rc == 0, output[-6000:]
    return _reports(reference, "torch", 4, output)


@pytest.fixture(scope="module")
def mlx_reports(reference: Path) -> dict[int, dict[str, Any]]:
    pytest.importorskip("mlx.core")
    cmd = [require_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "4",
           sys.executable, str(WORKER), "mlx", str(reference)]  # fmt: skip
    rc, output = run_bounded(cmd, _env(), LIMIT)
    assert rc == 0, output[-6000:]
    return _reports(reference, "mlx", 4, output)


def _assert_agrees(reports: dict[int, dict[str, Any]], name: str) -> None:
    for rank, report in sorted(reports.items()):
        assert name in report, f"rank {rank} did not run {name}"
        assert report[name] is None, f"rank {rank}: {report[name]}"


def test_the_port_is_the_promised_size() -> None:
    """Every named case of the port is a JAX test (by its name) and most are expressible."""
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert sum(c.expressible for c in CASES) >= 60
    source = jax_suite.SOURCE
    assert "cec06d116c05f0d52adfceee3d3b730fdbcb0ce5" in source


@pytest.mark.parametrize("name", _params())
def test_on_jax(reference: Path, name: str) -> None:
    _assert_agrees(_reports(reference, "jax", 1, ""), name)


@pytest.mark.parametrize("name", _params())
def test_on_torch_under_torchrun_4(torch_reports: dict[int, dict[str, Any]], name: str) -> None:
    _assert_agrees(torch_reports, name)


@pytest.mark.parametrize("name", _params())
def test_on_mlx_under_mpirun_4(mlx_reports: dict[int, dict[str, Any]], name: str) -> None:
    _assert_agrees(mlx_reports, name)
