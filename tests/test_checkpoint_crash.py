"""A save killed with SIGKILL at a random moment leaves the previous checkpoint or the new one,
whole and bit-exact, and the next save removes what the killed one left: one process, and
every process of a 4-process torchrun and mpirun save (a few trials each here; 100 per engine
in benchmarks/crash.py, figures in docs/robustness.md)."""

from __future__ import annotations

import os
import random

import pytest

from .support.crashing import leftovers_after_a_save, trial
from .support.launch import require_mpirun

ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")},
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
}


@pytest.mark.parametrize(
    ("engine", "trials", "window"), [("single", 6, 0.6), ("torchrun", 1, 3.0), ("mpirun", 2, 3.0)]
)
def test_a_killed_save_leaves_a_whole_checkpoint(engine, trials, window, tmp_path):
    if engine == "torchrun":
        pytest.importorskip("torch.distributed")
    if engine == "mpirun":
        require_mpirun()
        pytest.importorskip("mlx.core")
    rng = random.Random(f"crash-{engine}")
    path = tmp_path / "ck"
    results = [
        trial(engine, path, tmp_path / "logs", rng.uniform(0, window), ENV) for _ in range(trials)
    ]
    broken = [r for r in results if r["outcome"] != "previous" and r["outcome"] != "new"]
    assert not broken, broken
    assert all(r["saves"] >= 1 for r in results), results
    assert leftovers_after_a_save(path) == []
