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


def test_torchrun_to_torchrun_in_place_slices_and_rules(tmp_path: Path) -> None:
    port = free_port()
    trainer = commands("torch", 4, ["torch-torch", "trainer", str(port), str(tmp_path)])
    server = commands("torch", 2, ["torch-torch", "server", str(port), str(tmp_path)])
    codes, text = run_jobs(trainer + server, LIMIT)
    assert codes == [0, 0], text[-8000:]
    sent = results(tmp_path, "trainer", 4)
    got = results(tmp_path, "server", 2)
    assert all(r.get("ok") for r in sent + got), text[-8000:]
    for r in got:
        assert r["received"] == r["min"] > 0
    assert sum(r["sent1"] for r in sent) == sum(r["received"] for r in got)


def test_torchrun_to_mlx_under_mpirun_and_back(tmp_path: Path) -> None:
    pytest.importorskip("mlx.core")
    port = free_port()
    trainer = commands("torch", 2, ["torch-mlx", "trainer", str(port), str(tmp_path)])
    server = commands("mpi", 2, ["torch-mlx", "server", str(port), str(tmp_path)])
    codes, text = run_jobs(trainer + server, LIMIT)
    assert codes == [0, 0], text[-8000:]
    for r in results(tmp_path, "trainer", 2) + results(tmp_path, "server", 2):
        assert r.get("ok"), text[-8000:]
        assert r["received"] == r["min"] > 0


#: the link's timeout in the fault cases; every survivor must raise within it + 15 s
FAULT_TIMEOUT = 20.0


@pytest.mark.parametrize("scenario", ["kill-sender", "kill-receiver"])
def test_a_killed_process_ends_every_survivor_of_both_jobs_with_a_link_error(
    tmp_path: Path, scenario: str
) -> None:
    pytest.importorskip("jax")
    port = free_port()
    env = {"LINK_TIMEOUT": str(FAULT_TIMEOUT)}
    a = commands("jax", 2, [scenario, "a", str(port), str(tmp_path)])
    b = commands("jax", 2, [scenario, "b", str(port), str(tmp_path)])
    procs = [(cmd, dict(e, **env)) for cmd, e in a + b]
    codes, text = run_jobs(procs, LIMIT)
    victim = ("a", 1) if scenario == "kill-sender" else ("b", 1)
    for job in ("a", "b"):
        for i, r in enumerate(results(tmp_path, job, 2)):
            if (job, i) == victim:
                assert r["checks"][-1] == "killing myself"
                continue
            assert r.get("ok") and len(r["errors"]) == 1, (job, i, r, text[-4000:])
            assert f"process 1 of job {victim[0]!r}" in r["errors"][0], r["errors"]
            assert r["seconds"] < FAULT_TIMEOUT + 15, r
    killed = [c for c in codes if c != 0]
    assert killed == [-9], codes


def test_a_process_that_never_joins_is_named(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    port = free_port()
    env = {"LINK_TIMEOUT": "10"}
    a = commands("jax", 2, ["missing", "a", str(port), str(tmp_path)])
    b = commands("jax", 2, ["missing", "b", str(port), str(tmp_path)])
    procs = [(cmd, dict(e, **env)) for cmd, e in a + b]
    codes, text = run_jobs(procs, LIMIT, idle={3})
    assert codes[:3] == [0, 0, 0], text[-4000:]
    for job, i in (("a", 0), ("a", 1), ("b", 0)):
        (r,) = [results(tmp_path, job, 2)[i]] if job == "a" else [results(tmp_path, "b", 1)[0]]
        (error,) = r["errors"]
        assert error.startswith("LaunchError") and "job 'b' processes [1]" in error, error
