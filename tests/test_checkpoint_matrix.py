"""The any-to-any checkpoint matrix (issue 35, item 5): a set of float32, bfloat16, float16,
int64 and bool tensors, one uneven and one replicated, saved from torch under torchrun 4 (FSDP
over TP: _StridedShard and Shard(1); with async_save), JAX on 8 devices (4 x 2), MLX under
mpirun 4 (async_save) and Keras on
JAX (variables laid out by a LayoutMap), then loaded on each framework with another mesh shape
and other specs: 12 ordered pairs and a reshard within each framework. Every block every
process holds is compared byte for byte; each process reads no more than 1.05x the bytes of
its own blocks (the reader's own counter, data files only; the manifest comes on top)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .support.launch import worker_output

HERE = Path(__file__).parent
WORKER = HERE / "support" / "checkpoint_matrix.py"
LIMIT = 300
pytestmark = pytest.mark.timeout(8 * LIMIT)
FRAMEWORKS = ("torch", "jax", "mlx", "keras")
RANKS = {"torch": 4, "mlx": 4, "jax": 1, "keras": 1}


def _needs(framework: str) -> None:
    pytest.importorskip(
        {"torch": "torch", "mlx": "mlx.core", "jax": "jax", "keras": "keras"}[framework]
    )
    pytest.importorskip("ml_dtypes")


def _run(framework: str, mode: str, out: Path) -> str:
    return worker_output(WORKER, framework, [framework, mode, str(out)], LIMIT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for framework in FRAMEWORKS:
        _needs(framework)
    out = tmp_path_factory.mktemp("matrix")
    for framework in FRAMEWORKS:
        _run(framework, "save", out)
    return out


def test_what_each_framework_saved(saved: Path) -> None:
    """The manifests hold the savers' layouts: torch's FSDP-over-TP weight is a strided shard
    in torch's terms; a replicated tensor is written once; the uneven one tiles exactly."""
    import unimesh
    from unimesh import StridedShard

    torch_ck = unimesh.open_checkpoint(saved / "torch")
    layout = torch_ck.layout("model.w")
    assert any(isinstance(p, StridedShard) for p in layout.placements())
    assert len(torch_ck.tensor("model.r").boxes) == 1
    assert len(torch_ck.tensor("model.u").boxes) == 2  # 7 rows over tp=2: 4 + 3
    for framework in FRAMEWORKS:
        ck = unimesh.open_checkpoint(saved / framework)
        assert sorted(ck.names) == sorted(f"model.{k}" for k in
                                         ("w", "bf", "h", "n", "m", "u", "r"))  # fmt: skip
        assert {ck.tensor(n).dtype for n in ck.names} == {
            "float32",
            "bfloat16",
            "float16",
            "int64",
            "bool",
        }


@pytest.mark.parametrize("loader", FRAMEWORKS)
def test_every_checkpoint_loads_on(saved: Path, loader: str) -> None:
    _needs(loader)
    output = _run(loader, "load", saved)
    reports: dict[int, dict[str, Any]] = {}
    for rank in range(RANKS[loader]):
        path = saved / f"load-{loader}-rank-{rank}.json"
        assert path.exists(), output[-4000:]
        reports[rank] = json.loads(path.read_text())
    for rank, report in reports.items():
        assert sorted(report) == sorted(FRAMEWORKS)
        for saver, result in report.items():
            assert not result["errors"], f"{saver} -> {loader} rank {rank}: {result['errors']}"
            assert result["tensors"] == 7
            assert result["read"] <= 1.05 * result["held"], (saver, loader, rank, result)
