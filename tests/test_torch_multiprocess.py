"""Real torch runs: torchrun --standalone with gloo, 4 and 8 ranks, started from pytest.

Each run is bounded: on timeout the whole process group is killed and the test fails with the
output so far. Every rank must print its checks and ``RANK r OK``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .support.launch import WORKERS, run_bounded

pytest.importorskip("torch.distributed")

WORKER = WORKERS / "torch_worker.py"
LIMIT = 120


def torchrun(
    nproc: int, *args: str, worker: Path = WORKER, limit: float = LIMIT
) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.pop("UNIMESH_BACKEND", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(worker),
        *args,
    ]
    return run_bounded(cmd, env, limit)


@pytest.mark.parametrize(
    "nproc, spec", [(4, "dp=2,tp=2"), (8, "pp=2,dp=2,tp=2")], ids=["2x2", "2x2x2"]
)
def test_torchrun_gloo(nproc: int, spec: str) -> None:
    rc, out = torchrun(nproc, spec)
    assert rc == 0, out[-6000:]
    done = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"RANK (\d+) OK (\d+)", out)}
    assert sorted(done) == list(range(nproc)), out[-6000:]
    assert len(set(done.values())) == 1 and min(done.values()) >= 20, done
    assert "FAIL" not in out


def test_a_crashed_rank_fails_the_run_instead_of_hanging() -> None:
    rc, out = torchrun(4, "dp=2,tp=2", "crash")
    assert rc != 0, out[-4000:]


def test_ranks_building_different_meshes_all_raise() -> None:
    rc, out = torchrun(4, "dp=2,tp=2", "disagree")
    assert rc == 0, out[-4000:]
    assert len(re.findall(r"ok   disagreement raised: ranks disagree", out)) == 4, out[-4000:]
    assert sorted(int(r) for r in re.findall(r"RANK (\d+) OK 1", out)) == [0, 1, 2, 3]


def test_torch_compile_called_directly_compiles_a_program_made_before_dynamo_loaded() -> None:
    """torch.compile (not unimesh.compile) with fullgraph=True on a program made before
    torch._dynamo was imported: the program still reaches dynamo as one call."""
    worker = WORKERS / "torch_compile_worker.py"
    rc, out = torchrun(4, worker=worker, limit=2 * LIMIT)  # compiling takes longer
    assert rc == 0, out[-6000:]
    assert sorted(int(r) for r in re.findall(r"RANK (\d+) OK", out)) == [0, 1, 2, 3], out[-6000:]
