"""``unimesh.link``: weights between two jobs, each started under its own launcher by the test
(torchrun, ``jax.distributed`` processes, mpirun), both on 127.0.0.1 with ports of their own.
Every process of both jobs writes what it checked (tests/workers/link_worker.py); each
receiving process's blocks are compared bit for bit with the sent values (and with the
receiving framework's own cast for a cast target), and its ``bytes_received`` with the bytes
of its distinct target blocks."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import unimesh
from unimesh import Concat, Slice

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


@pytest.mark.parametrize("scenario", ["kill-sender", "kill-receiver", "stall-receiver"])
def test_a_killed_or_stopped_process_ends_every_survivor_of_both_jobs_with_a_link_error(
    tmp_path: Path, scenario: str
) -> None:
    pytest.importorskip("jax")
    port = free_port()
    env = {"LINK_TIMEOUT": str(FAULT_TIMEOUT)}
    a = commands("jax", 2, [scenario, "a", str(port), str(tmp_path)])
    b = commands("jax", 2, [scenario, "b", str(port), str(tmp_path)])
    procs = [(cmd, dict(e, **env)) for cmd, e in a + b]
    victim = ("a", 1) if scenario.endswith("sender") else ("b", 1)
    stopped = {3} if scenario.startswith("stall") else set()  # killed once the others end
    codes, text = run_jobs(procs, LIMIT, idle=stopped)
    for job in ("a", "b"):
        for i, r in enumerate(results(tmp_path, job, 2)):
            if (job, i) == victim:
                assert r["checks"][-1] == ("stopping" if stopped else "killing myself")
                continue
            assert r.get("ok") and len(r["errors"]) == 1, (job, i, r, text[-4000:])
            assert f"process 1 of job {victim[0]!r}" in r["errors"][0], r["errors"]
            assert r["seconds"] < FAULT_TIMEOUT + 15, r
    killed = [c for c in codes if c != 0]
    assert len(killed) == 1 and killed[0] in (-9, -15), codes  # the victim only


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


# -- one process per job, the two jobs in two threads of the test process (numpy) --------------


def pair(a_side, b_side, timeout: float = 30.0) -> tuple[object, object]:
    """Run ``a_side(link)`` and ``b_side(link)`` as two one-process jobs in two threads;
    return what each gave back (or raised)."""
    port = free_port()
    out: dict[str, object] = {}

    def run(job: str, peer: str, side) -> None:
        try:
            with unimesh.link(f"127.0.0.1:{port}", job=job, peer=peer, timeout=timeout) as ln:
                out[job] = side(ln)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out[job] = exc

    threads = [threading.Thread(target=run, args=("a", "b", a_side)),
               threading.Thread(target=run, args=("b", "a", b_side))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 3)
    assert not any(t.is_alive() for t in threads), "a link thread hung"
    return out["a"], out["b"]


@pytest.mark.quick
def test_numpy_jobs_rename_fuse_slice_and_cast() -> None:
    import ml_dtypes

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 4)).astype(np.float32) for n in (3, 2, 2))
    qkv = np.concatenate([q, k, v])

    def a(ln):
        stats: dict[str, int] = {}
        ln.send({"q": q, "k": k, "v": v, "qkv": qkv}, version=7, stats=stats)
        return stats, ln.version

    def b(ln):
        stats: dict[str, int] = {}
        target = {
            "fused": np.zeros((7, 4), np.float32),
            "k2": np.zeros((2, 4), np.float32),
            "half": np.zeros((3, 4), ml_dtypes.bfloat16),
            "q": np.zeros((3, 4), np.float32),
        }
        got = ln.receive(
            target,
            stats=stats,
            version=7,
            sources={
                "fused": Concat(["q", "k", "v"], 0),
                "k2": Slice("qkv", 0, 3, 5),
                "half": "q",
                "q": Slice("qkv", 0, 0, 3),
            },
        )
        return got, target, stats, ln.version

    (sent, sent_version), (got, target, stats, version) = pair(a, b)
    assert got["fused"] is target["fused"] and (got["fused"] == qkv).all()
    assert (got["k2"] == k).all() and (got["q"] == q).all()
    assert got["half"].tobytes() == q.astype(ml_dtypes.bfloat16).tobytes()  # cast at the sender
    assert stats["bytes_received"] == (7 + 2 + 3) * 4 * 4 + 3 * 4 * 2
    assert sent["bytes_sent"] == stats["bytes_received"] and version == sent_version == 7


@pytest.mark.quick
@pytest.mark.parametrize(
    ("sends", "receives", "words"),
    [
        ({"w": np.zeros((2, 3), np.float32)}, {"w": np.zeros((3, 2), np.float32)},
         ["'w'", "(2, 3)", "(3, 2)"]),
        ({"w": np.zeros(3, np.float32)}, {"w": np.zeros(3, np.int32)},
         ["'w'", "float32", "int32", "does not cast"]),
        ({"w": np.zeros(3, np.float32)}, {"x": np.zeros(3, np.float32)},
         ["'x'", "nothing sent provides"]),
    ],
)  # fmt: skip
def test_a_mismatch_is_a_link_error_on_both_jobs_and_the_link_stays_usable(
    sends, receives, words
) -> None:
    def a(ln):
        errors = []
        try:
            ln.send(sends)
        except unimesh.LinkError as exc:
            errors.append(str(exc))
        ln.send({"ok": np.arange(3.0)})
        return errors

    def b(ln):
        errors = []
        try:
            ln.receive(receives)
        except unimesh.LinkError as exc:
            errors.append(str(exc))
        return errors, ln.receive({"ok": np.zeros(3)})["ok"]

    sent, (received, ok) = pair(a, b)
    assert len(sent) == len(received) == 1 and sent == received, (sent, received)
    assert all(w in sent[0] for w in words), sent[0]
    assert (ok == np.arange(3.0)).all()


@pytest.mark.quick
def test_runs_that_are_one_stretch_at_both_ends_move_unstaged_the_rest_in_bounded_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A piece that is one run of memory in the sent block and in the target block, with no
    cast, goes as one message from the one into the other; column cuts and casts are staged
    in rounds whose arenas stay within ``IN_FLIGHT`` (made small here: many rounds)."""
    monkeypatch.setattr(sys.modules["unimesh.link"], "IN_FLIGHT", 2048)
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)

    def sent(base):  # a Fortran-order leaf (its free runs packed after all) and a 0-d one
        f = np.asfortranarray(base)
        return {"rows": base, "cols": base, "cast": base, "f": f, "s": np.array(base[3, 3])}

    def a(ln):
        ln.send(sent(w))
        ln.send(sent(w + 1))  # the plan replayed

    def b(ln):
        target = {
            "rows": np.zeros((64, 8), np.float32),
            "cols": np.zeros((64, 4), np.float32),
            "cast": np.zeros((64, 8), np.float64),
            "f": np.zeros((64, 8), np.float32),
            "s": np.zeros((), np.float32),
        }
        ln.receive(target, sources={"cols": Slice("cols", 1, 2, 6)})
        first = {k: v.copy() for k, v in target.items()}
        ln.receive(target, sources={"cols": Slice("cols", 1, 2, 6)})
        (schedule,) = ln._schedules.values()
        return first, target, schedule, ln.plans

    sender, got = pair(a, b)
    assert not isinstance(got, Exception), (got, sender)
    first, second, schedule, plans = got
    for got, base in ((first, w), (second, w + 1)):
        assert (got["rows"] == base).all() and (got["cast"] == base.astype(np.float64)).all()
        assert (got["cols"] == base[:, 2:6]).all()
        assert (got["f"] == base).all() and got["s"] == base[3, 3]
    assert plans == 1
    # straight in, in runs of at most 1 KiB
    assert {u.name for _, u in schedule.free} == {"rows", "f", "s"}
    assert max(u.nbytes for _, u in schedule.free) == 1024
    staged = [u for units in schedule.staged for _, u in units]
    assert {u.name for u in staged} == {"cols", "cast"}
    # 1 KiB a round (two in flight): the column cut, then the cast in four runs of rows
    assert [sum(u.nbytes for _, u in units) for units in schedule.staged] == [1024] * 5
    assert schedule.arena == 1024
    assert sum(u.nbytes for u in staged) == 64 * 4 * 4 + 64 * 8 * 8


@pytest.mark.quick
def test_versions_are_checked_before_anything_moves() -> None:
    def a(ln):
        ln.send({"w": np.ones(2)}, version=3)
        try:
            ln.send({"w": np.ones(2)}, version=4)
        except unimesh.LinkError as exc:
            return str(exc)

    def b(ln):
        target = np.zeros(2)
        ln.receive({"w": target}, version=3)
        target[:] = 5
        try:
            ln.receive({"w": target}, version=5)
        except unimesh.LinkError as exc:
            return str(exc), target.copy(), ln.version

    sent, (received, target, version) = pair(a, b)
    assert sent == received and "version 4" in sent and "version 5" in sent
    assert (target == 5).all() and version == 3  # nothing was written; the last version kept


@pytest.mark.quick
def test_a_peer_that_never_joins_is_a_launch_error() -> None:
    with pytest.raises(unimesh.LaunchError, match="job 'nobody' did not join"):
        unimesh.link(f"127.0.0.1:{free_port()}", job="alone", peer="nobody", timeout=1.5)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"address": "localhost"}, "host:port"),
        ({"address": "127.0.0.1:0"}, "1..65535"),
        ({"address": 29500}, "host:port"),
        ({"job": "same", "peer": "same"}, "different names"),
        ({"job": ""}, "job's name"),
        ({"job": "a/b"}, "no '/'"),
        ({"timeout": -1}, "seconds > 0"),
        ({"timeout": float("inf")}, "seconds > 0"),
    ],
)
def test_bad_link_arguments_name_the_value_and_the_fix(kwargs: dict, words: str) -> None:
    args = {"address": "127.0.0.1:1234", "job": "a", "peer": "b", "timeout": 1.0, **kwargs}
    with pytest.raises(unimesh.LinkError, match=words):
        unimesh.link(args.pop("address"), **args)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Concat([], 0), "non-empty list"),
        (lambda: Concat("qkv", 0), "non-empty list"),
        (lambda: Concat(["q"], -1), "Concat dim"),
        (lambda: Slice("", 0, 0, 1), "sent tensor's name"),
        (lambda: Slice("qkv", 0, 5, 2), "stop must be >= start"),
        (lambda: Slice("qkv", 0, 2**80, 2**81), "Slice start"),
    ],
)
def test_bad_sources_name_the_value_and_the_fix(make, words: str) -> None:
    with pytest.raises(unimesh.UnimeshError, match=words):
        make()


def test_the_trainer_to_server_example_serves_what_the_trainer_trained() -> None:
    pytest.importorskip("jax")
    import re
    import subprocess

    example = Path(__file__).parents[1] / "examples" / "trainer_to_server.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                          timeout=LIMIT, start_new_session=True, check=False)  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    said = {
        (who, int(step)): words
        for who, step, words in re.findall(
            r"^(trainer|server) step (\d+)[^:]*: (.*)$", text, re.MULTILINE
        )
    }
    assert len(said) == 8, text[-6000:]
    for step in range(4):  # the server's bfloat16 weights give what torch's cast of them gives
        assert said["server", step] == said["trainer", step], said
