"""``unimesh.link``: weights between two jobs, each started under its own launcher by the test
(torchrun, ``jax.distributed`` processes, mpirun), both on 127.0.0.1 with ports of their own.
Every process of both jobs writes what it checked (tests/workers/link_worker.py); each
receiving process's blocks are compared bit for bit with the sent values (and with the
receiving framework's own cast for a cast target), and its ``bytes_received`` with the bytes
of its distinct target blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))
from launch import free_port
from link_jobs import commands, run_jobs

pytest.importorskip("torch")

#: each job's bound: a loaded 2-core machine starts six framework processes
LIMIT = 400.0


def results(out: Path, job: str, n: int) -> list[dict]:
    found = []
    for i in range(n):
        path = out / f"{job}-{i}.json"
        assert path.exists(), f"{job} process {i} wrote nothing"
        found.append(json.loads(path.read_text()))
    return found


def test_torchrun_to_jax_and_back(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    port = free_port()
    trainer = commands("torch", 4, ["torch-jax", "trainer", str(port), str(tmp_path)])
    server = commands("jax", 2, ["torch-jax", "server", str(port), str(tmp_path)], devices=2)
    codes, text = run_jobs(trainer + server, LIMIT)
    assert codes == [0, 0, 0], text[-8000:]
    sent = results(tmp_path, "trainer", 4)
    got = results(tmp_path, "server", 2)
    for r in sent + got:
        assert r.get("ok"), text[-8000:]
        assert [e.split(":")[0] for e in r["errors"]] == [
            "version",
            "shape",
            "dtype",
            "nothing",
            "devices",
        ], r["errors"]
    for r in got:  # each server process: exactly its distinct blocks, once
        assert r["received"] == r["min"] > 0
        assert r["copied"] == r["copies1"] > 0  # the replicated emb, to a second device
        assert r["received3"] == r["received"]
        assert r["plans1"] == 1 and r["plans3"] == 1  # the repeated transfer replays its plan
    assert sum(r["sent1"] for r in sent) == sum(r["received"] for r in got)
    assert sum(r["sent3"] for r in sent) == sum(r["received"] for r in got)
    for r in sent:  # back from JAX onto uneven torch blocks
        assert r["received"] == r["min"]
        assert r["plans3"] == 1
    assert sum(r["sent4"] for r in got) == sum(r["received"] for r in sent)
