"""unimesh.initialize and unimesh.verify on the real distributed engines: torch gloo (torchrun,
and plain processes where torchrun would kill the survivors itself), jax.distributed, MLX over
MPI and ring. Clean runs exit 0 everywhere; different meshes raise MeshMismatchError on every
process; a peer killed during set-up makes the others fail, saying so, within 60 s."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import unimesh

from .support.launch import free_port, run_bounded, run_ranks_timed
from .support.verify import (
    GONE_BOUND,
    LIMIT,
    NEVER_BOUND,
    WORKER,
    N,
    base_env,
    jax_envs,
    lines,
    mlx_command,
    torch_envs,
)

#: the cases that share one launch per engine (verify_worker.py runs them one after another)
SHARED = ("clean", "disagree", "small")
_SHARED_RUNS: dict[str, tuple[dict[str, dict[int, str]], dict[str, dict[int, int]], str]] = {}

#: the fault launches (a peer killed, stuck or never started), by the name of the test that
#: checks each: most of their time is the survivors waiting out their timeouts, so three run
#: side by side (three launches of 4 processes on 2 cores, started 5 s apart; a fourth at once
#: made a torch rank too slow to reach its store in one run), the longest first, at most
#: ENGINE_CAP[engine] of one engine at a time (two mlx.launch rings at once could be given the
#: same ports; torch's imports are the heaviest), each its own launch, all of them when the
#: first of their tests asks, while no other test runs; each test then checks its own
#: launch's results, which carry their own timings.
FAULTS: dict[str, tuple[str, Callable[[Path], Any]]] = {}
_FAULT_RESULTS: dict[str, Future[Any]] = {}
SLOTS = 3
ENGINE_CAP = {"mlx": 1, "torch": 2, "jax": 2}


def fault(engine: str, name: str) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    """Register ``launch`` (given a scratch folder, it returns what its test checks) as the
    launch of test ``name`` on ``engine``."""

    def register(launch: Callable[[Path], Any]) -> Callable[[Path], Any]:
        FAULTS[name] = (engine, launch)
        return launch

    return register


def _expected_cost(name: str) -> int:
    """The order launches start in (the longest first, so that the three slots end together):
    a never-started peer waits out the set-up timeout, a stuck one the check's."""
    return 3 if "never" in name else 2 if ("stuck" in name or "save" in name) else 1


#: the first fault test's setup runs the whole batch; each launch within its own bound
#: (LIMIT + 30 s). With every launch at its bound, the 6 MLX launches one after another take
#: 540 s, beside the 12 others in two slots (6 each): the batch ends within 7 bounds
BATCH_TIMEOUT = pytest.mark.timeout(7 * (LIMIT + 30) + 120)


@pytest.fixture
def faulted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """This test's fault launch's results (every selected fault test's launch made at once,
    on the first ask)."""
    name = request.node.name
    if name not in FAULTS:  # a shared or single-process case of a fault test's function
        return None
    if name not in _FAULT_RESULTS:
        wanted = [i.name for i in request.session.items
                  if getattr(i, "module", None) is request.module
                  and i.name in FAULTS and i.name not in _FAULT_RESULTS]  # fmt: skip
        pending = sorted(wanted, key=lambda n: (-_expected_cost(n), wanted.index(n)))
        futures: dict[str, Future[Any]] = {n: Future() for n in wanted}
        stop = threading.Event()  # set when the batch is interrupted: no new launch starts
        lock = threading.Condition()
        busy: list[str] = []  # the engines of the launches under way

        def take() -> str | None:
            """The next launch this slot may start (None: nothing left)."""
            with lock:
                while pending and not stop.is_set():
                    for n in pending:
                        engine = FAULTS[n][0]
                        if busy.count(engine) < ENGINE_CAP.get(engine, SLOTS):
                            pending.remove(n)
                            busy.append(FAULTS[n][0])
                            return n
                    lock.wait(1)
                return None

        def run(slot: int) -> None:
            if stop.wait(5 * slot):  # the slots' first imports apart: 4 processes each
                return
            while (n := take()) is not None:
                try:
                    futures[n].set_result(FAULTS[n][1](tmp_path_factory.mktemp("fault")))
                except BaseException as exc:  # noqa: BLE001 - raised again in its own test
                    futures[n].set_exception(exc)
                finally:
                    with lock:
                        busy.remove(FAULTS[n][0])
                        lock.notify_all()

        try:
            with ThreadPoolExecutor(SLOTS) as pool:
                running = [pool.submit(run, i) for i in range(SLOTS)]
                try:
                    for done in running:
                        done.result()
                finally:  # a timeout or ^C here: the launches under way end within their bound
                    stop.set()
                    with lock:
                        lock.notify_all()
        finally:  # every launch's result kept, so that no later test starts the batch again
            for n, future in futures.items():
                if not future.done():
                    future.set_exception(
                        RuntimeError(f"{n}: not launched, the fault batch was interrupted")
                    )
            _FAULT_RESULTS.update(futures)
    return _FAULT_RESULTS[name].result()


def shared_verdicts(out: str) -> tuple[dict[str, dict[int, str]], dict[str, dict[int, int]]]:
    """Each shared case's VERIFY line and exit code (the code it alone would give) per rank."""
    verdicts: dict[str, dict[int, str]] = {m: {} for m in SHARED}
    codes: dict[str, dict[int, int]] = {m: {} for m in SHARED}
    pattern = r"VERIFY \[(\w+)\] rank (\d+) of \d+ code=(-?\d+)(?:(?!VERIFY ).)*"
    for m in re.finditer(pattern, out):
        verdicts[m[1]][int(m[2])] = m[0]
        codes[m[1]][int(m[2])] = int(m[3])
    return verdicts, codes


def shared_launch(
    key: str, start: Callable[[], str]
) -> tuple[dict[str, dict[int, str]], dict[str, dict[int, int]], str]:
    """The clean, disagree and small cases of one engine in one launch (``start`` runs it and
    returns its output), made by the first test that asks; each case is then its own test."""
    if key not in _SHARED_RUNS:
        out = start()
        _SHARED_RUNS[key] = (*shared_verdicts(out), out)
    return _SHARED_RUNS[key]


def absent(mode: str) -> int | None:
    """The process that is killed, stuck or never starts in ``mode``."""
    return {"die": 1, "stuck": 1, "never": 1, "never0": 0}.get(mode.removeprefix("save-"))


def check_mode(
    mode: str, verdicts: dict[int, str], codes: dict[int, int] | None, names: str | None = None
) -> None:
    """What every rank must have said and returned for ``mode`` (its exit code unless
    ``codes`` is None: a launcher that ends the others on the first failure decides theirs);
    with ``names`` (a regex), every surviving rank must name the missing process so."""
    alive = [r for r in range(N) if r != absent(mode)]
    assert sorted(verdicts) == alive, verdicts
    codes = codes or {r: {"never": 6, "never0": 6}.get(mode, 4) for r in alive}
    for r in alive:
        text = verdicts[r]
        if mode == "clean":
            assert " ok after" in text and codes[r] == 0, (r, text, codes)
        elif mode == "disagree":
            assert " mismatch after" in text and codes[r] == 3, (r, text, codes)
            assert "processes [1] have device_order" in text, text
            assert "processes [0, 2, 3] have" in text, text
        elif mode.startswith("save-"):
            assert " gone after" in text and "checkpoint intact" in text, (r, text, codes)
            assert "saving" in text and "unchanged" in text, (r, text)
            assert codes[r] in (4, -6), (r, text, codes)  # -6: JAX aborting at exit, as above
        elif mode in ("die", "stuck"):  # 4 from the worker, or JAX aborting at exit once it saw
            assert " gone after" in text and codes[r] in (4, -6), (r, text, codes)  # the peer go
            assert float(re.search(r"after ([\d.]+)s", text)[1]) < GONE_BOUND, text
        elif mode in ("never", "never0"):  # initialize's LaunchError
            assert " launch after" in text and codes[r] == 6, (r, text, codes)
            assert float(re.search(r"after ([\d.]+)s", text)[1]) < NEVER_BOUND, text
        else:
            assert " devices after" in text and codes[r] == 5, (r, text)
            assert f"uses device {N + 1}" in text, text
        if names and absent(mode) is not None:
            assert re.search(names, text), (r, names, text)
        seconds = float(re.search(r"after ([\d.]+)s", text)[1])
        assert seconds < LIMIT, text


#: a stuck or never-started process sleeps past the others' end; its own end is not checked,
#: so it is killed once they have all ended
IDLE = ("stuck", "never", "never0", "save-stuck")


def plain_launch(backend: str, mode: str, envs: Callable[[Path], list[dict[str, str]]]) -> Any:
    """The worker in N processes for a fault ``mode``: (codes, outputs, end times)."""

    def launch(tmp: Path) -> tuple[list[int], list[str], list[float]]:
        idle = absent(mode) if mode in IDLE else None
        command = [sys.executable, WORKER, backend, mode]
        return run_ranks_timed(command, envs(tmp), LIMIT + 30, tmp, idle=idle)

    return launch


def plain_processes(
    backend: str,
    mode: str,
    envs: list[dict[str, str]],
    tmp_path: Path,
    names: str | None = None,
    ran: Any = None,
) -> None:
    """The worker in N processes started here (the engine's own rendezvous, no launcher that
    could end the survivors itself); every rank's verdict and exit code checked, and the time
    at which every surviving process ended: within the timeout plus 15 s (twice the timeout,
    for a loaded machine) of a peer that is gone, stuck or never started."""
    if mode in SHARED:

        def start() -> str:
            codes, outs, ends = run_ranks_timed(
                [sys.executable, WORKER, backend, "+".join(SHARED)], envs, LIMIT + 30, tmp_path
            )
            assert max(ends) < LIMIT + 10, f"took {max(ends):.0f} s"
            assert codes == [0] * N, (codes, outs)
            return "".join(outs)

        verdicts, codes, _ = shared_launch(f"plain-{backend}", start)
        check_mode(mode, verdicts[mode], codes[mode], names)
        return
    gone = absent(mode)
    assert ran is not None, "a fault case's launch comes from the faulted fixture"
    codes, outs, ends = ran
    assert max(ends) < LIMIT + 10, f"took {max(ends):.0f} s"
    verdicts: dict[int, str] = {}
    for out in outs:
        verdicts.update(lines(out))
    if mode in ("die", "save-die"):
        assert codes[1] == -9, codes
    if mode in IDLE:
        verdicts.pop(gone, None)  # killed once the others ended: its own end is not checked
    check_mode(mode, verdicts, dict(enumerate(codes)), names)
    bound = {"die": GONE_BOUND, "stuck": GONE_BOUND}.get(mode.removeprefix("save-"), NEVER_BOUND)
    for r in range(N):
        if r != gone:
            assert ends[r] < bound, f"process {r} ended after {ends[r]:.1f} s (bound {bound} s)"


# -- torch ------------------------------------------------------------------------------------
def _torch_envs(tmp: Path) -> list[dict[str, str]]:
    pytest.importorskip("torch.distributed")
    return [dict(env, CHECKPOINT_DIR=str(tmp / "ck")) for env in torch_envs()]


for _mode in ("die", "stuck", "never"):
    fault("torch", f"test_torch_gloo_processes[{_mode}]")(plain_launch("torch", _mode, _torch_envs))
fault("torch", "test_torch_save_with_a_peer_gone[save-die]")(
    plain_launch("torch", "save-die", _torch_envs)
)


@pytest.mark.parametrize("mode", ["clean", "disagree", "die", "small", "stuck", "never"])
@BATCH_TIMEOUT
def test_torch_gloo_processes(mode, tmp_path, faulted):
    """Every surviving rank names rank 1 when it is gone, stuck or never started (read from
    the rendezvous store, which every rank can ask), not only rank 0."""
    pytest.importorskip("torch.distributed")
    plain_processes(
        "torch", mode, torch_envs(), tmp_path, names=r"rank 1 did not arrive", ran=faulted
    )


@pytest.mark.parametrize("mode", ["save-die"])
@BATCH_TIMEOUT
def test_torch_save_with_a_peer_gone(mode, tmp_path, faulted):
    """unimesh.save on 4 gloo processes when process 1 is killed before the second save
    (save-stuck, a process that does not come, reads the same and is in benchmarks/faults.py):
    every survivor raises CheckpointError naming rank 1 within the timeout, and the
    checkpoint saved before is still there, whole."""
    pytest.importorskip("torch.distributed")
    plain_processes("torch", mode, [], tmp_path, names=r"rank 1 did not arrive", ran=faulted)


def torchrun(mode: str, tmp: Path, limit: float = LIMIT + 30) -> tuple[int, str, float]:
    """The worker under torchrun: (exit code, output, seconds it took)."""
    pytest.importorskip("torch.distributed")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={N}", WORKER, "torch", mode]  # fmt: skip
    t0 = time.monotonic()
    rc, out = run_bounded(command, base_env(), limit, tmp)
    return rc, out, time.monotonic() - t0


for _mode in ("stuck", "never"):
    fault("torch", f"test_torch_under_torchrun[{_mode}]")(
        lambda tmp, mode=_mode: torchrun(mode, tmp)
    )
fault("torch", "test_torchrun_with_a_killed_worker_stops_every_rank")(
    lambda tmp: torchrun("die", tmp, LIMIT)
)


@pytest.mark.parametrize("mode", ["clean", "disagree", "stuck", "never"])
@BATCH_TIMEOUT
def test_torch_under_torchrun(mode, tmp_path, faulted):
    """Under torchrun (its agent hosts the store): every rank that is not the stuck or
    never-started one names rank 1 before the agent ends the job on the first failure."""
    pytest.importorskip("torch.distributed")

    if mode in ("clean", "disagree"):  # one launch for both (and small, checked there too)

        def start() -> str:
            rc, out, _ = torchrun("+".join(SHARED), tmp_path)
            assert rc == 0, out[-3000:]
            return out

        shared, codes, out = shared_launch("torchrun", start)
        verdicts = shared[mode]
        assert sorted(verdicts) == list(range(N)), out[-3000:]
        if mode == "clean":
            assert all(" ok after" in v for v in verdicts.values()), out[-3000:]
            assert set(codes[mode].values()) == {0}, codes
        else:
            assert all("processes [1] have device_order" in v for v in verdicts.values()), out[
                -3000:
            ]
            assert set(codes[mode].values()) == {3}, codes
        return
    rc, out, took = faulted
    verdicts = lines(out)
    assert rc != 0, out[-3000:]
    check_mode(mode, verdicts, None, names=r"rank 1 did not arrive")
    # the agent ends the job once the first rank fails, the stuck one too
    assert took < (GONE_BOUND if mode == "stuck" else NEVER_BOUND), (took, out[-3000:])


@BATCH_TIMEOUT
def test_torchrun_with_a_killed_worker_stops_every_rank(faulted):
    """Under torchrun the agent itself ends the other workers when one dies; nothing hangs."""
    pytest.importorskip("torch.distributed")
    rc, out, _ = faulted
    assert rc != 0
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", out) and "Signal 9" in out, out[-3000:]


# -- jax.distributed --------------------------------------------------------------------------
def _jax_envs(tmp: Path) -> list[dict[str, str]]:
    pytest.importorskip("jax")
    return [dict(env, CHECKPOINT_DIR=str(tmp / "ck")) for env in jax_envs()]


for _mode in ("die", "stuck", "never", "never0"):
    fault("jax", f"test_jax_distributed_processes[{_mode}]")(plain_launch("jax", _mode, _jax_envs))
fault("jax", "test_jax_save_with_a_peer_gone")(plain_launch("jax", "save-die", _jax_envs))


@pytest.mark.parametrize("mode", ["clean", "disagree", "die", "small", "stuck", "never", "never0"])
@BATCH_TIMEOUT
def test_jax_distributed_processes(mode, tmp_path, faulted):
    """Every surviving process names the one that is gone, stuck or never started: the check's
    key-value exchange for the first two, initialize's own rendezvous before
    jax.distributed.initialize for the last (JAX alone would abort the others from C++ with
    no name), and ends in time: after a lost peer, exit skips JAX's shutdown barrier."""
    pytest.importorskip("jax")
    names = {
        "die": r"process 1 did not take part in the check",
        "stuck": r"process 1 did not take part in the check",
        "never": r"process 1 of 4 did not start within 20 s \(the coordinator 127\.0\.0\.1:\d+ "
        r"heard from processes \[0, 2, 3\]\)",
        "never0": r"process 0 of 4 \(the coordinator, 127\.0\.0\.1:\d+\) did not start within 20 s",
    }.get(mode)
    plain_processes("jax", mode, jax_envs(), tmp_path, names, ran=faulted)


@BATCH_TIMEOUT
def test_jax_save_with_a_peer_gone(tmp_path, faulted):
    """unimesh.save on 4 jax.distributed processes when process 1 is killed before the second
    save: every survivor raises CheckpointError naming process 1, the first checkpoint whole."""
    pytest.importorskip("jax")
    plain_processes("jax", "save-die", [], tmp_path, r"process 1 did not take part", faulted)


def meet(procs: int, ids: list[int], counts: list[int] | None = None, timeout: float = 2.0):
    """Run JAX's rendezvous for ``ids`` (one thread each, this process) on a free port;
    return each one's LaunchError message, or None."""
    from concurrent.futures import ThreadPoolExecutor

    from unimesh_jax.rendezvous import rendezvous

    address = f"127.0.0.1:{free_port()}"

    def one(i: int) -> str | None:
        try:
            rendezvous(address, (counts or [procs] * len(ids))[i], ids[i], timeout)
        except unimesh.LaunchError as exc:
            return str(exc)
        return None

    with ThreadPoolExecutor(len(ids)) as pool:
        return list(pool.map(one, range(len(ids)))), address


def test_jax_rendezvous_names_who_did_not_come():
    """initialize's meeting before jax.distributed.initialize, in threads: all here; a process
    missing; process 0 missing; two with one id; a different process count."""
    said, _ = meet(3, [0, 1, 2])
    assert said == [None, None, None]
    said, address = meet(3, [0, 1])
    for pid, text in enumerate(said):
        assert text.startswith(f"jax.distributed (this is process {pid} of 3): process 2 of 3 "), (
            text
        )
        assert (
            f"did not start within 2 s (the coordinator {address} heard from processes [0, 1])"
            in text
        )
    said, address = meet(2, [1])
    assert f"process 0 of 2 (the coordinator, {address}) did not start within 2 s" in said[0]
    # two with one id: caught while the meeting still waits (here for process 2, who never
    # comes); a twin arriving after the others have met finds the port closed instead
    said, _ = meet(3, [0, 1, 1])
    assert all(t and "two processes have JAX_PROCESS_ID=1" in t for t in said), said
    assert all("process 2 of 3 did not start" in t for t in said), said
    said, _ = meet(3, [0, 1, 2], counts=[3, 4, 3])
    assert all(t and "process 1 has JAX_NUM_PROCESSES=4 where process 0 has 3" in t for t in said)
    said, _ = meet(3, [0, 1, 3])
    assert all(t and "a process has JAX_PROCESS_ID=3, outside 0..2" in t for t in said), said


def test_jax_rendezvous_ignores_strangers():
    """Something else connecting to the coordinator port (a scanner, an HTTP client, a flood of
    bytes) is dropped; the processes still meet."""
    import socket
    import threading

    from unimesh_jax.rendezvous import rendezvous

    address = f"127.0.0.1:{free_port()}"
    said: list[object] = []

    def zero() -> None:
        try:
            rendezvous(address, 2, 0, 5.0)
            said.append(None)
        except unimesh.LaunchError as exc:
            said.append(exc)

    thread = threading.Thread(target=zero)
    thread.start()
    port = int(address.rsplit(":", 1)[1])
    for junk in (b"GET / HTTP/1.1\r\n\r\n", b"x" * 100_000, b"unimesh-jax 1\n", b"\xff\n", b""):
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(junk)
                break
            except OSError:
                time.sleep(0.02)
    rendezvous(address, 2, 1, 5.0)
    thread.join(10)
    assert said == [None]


@pytest.mark.parametrize("address", ["nohost", "host:", ":80", "host:99999", "host:\u0662", "h:-1"])
def test_jax_coordinator_address_is_checked(address):
    from unimesh_jax.rendezvous import split_address

    with pytest.raises(unimesh.LaunchError, match="JAX_COORDINATOR_ADDRESS must be host:port"):
        split_address(address)


def test_jax_coordinator_address_forms():
    from unimesh_jax.rendezvous import split_address

    assert split_address("10.0.0.1:1234") == ("10.0.0.1", 1234)
    assert split_address("[::1]:80") == ("::1", 80)
    assert split_address("node-7.cluster:65535") == ("node-7.cluster", 65535)


# -- MLX --------------------------------------------------------------------------------------
def ring_codes(out: str) -> dict[int, int]:
    """mlx.launch exits 0 whatever its processes return; it reports each failed one."""
    return {
        int(r): int(c) for r, c in re.findall(r"Node with rank (\d+) exited with code (-?\d+)", out)
    }


@pytest.mark.parametrize("launcher", ["mpi", "ring"])
@pytest.mark.parametrize("mode", ["clean", "disagree", "small"])
def test_mlx(launcher, mode, tmp_path):
    """The three cases share one launch per launcher; each rank's exit code for its case is the
    one the case alone gives (0, 3, 5), and the launcher's own handling of a failing process is
    checked by the die, stuck and never launches below."""
    pytest.importorskip("mlx.core")

    def start() -> str:
        command = mlx_command(launcher, "+".join(SHARED))
        rc, out = run_bounded(command, base_env(), LIMIT + 30, tmp_path)
        assert rc == 0 and not ring_codes(out), out[-3000:]
        return out

    shared, codes, out = shared_launch(f"mlx-{launcher}", start)
    verdicts = shared[mode]
    assert sorted(verdicts) == list(range(N)), out[-3000:]
    want = {"clean": " ok after", "disagree": " mismatch after", "small": " devices after"}[mode]
    assert all(want in v for v in verdicts.values()), out[-3000:]
    assert set(codes[mode].values()) == {{"clean": 0, "disagree": 3, "small": 5}[mode]}, codes
    assert all(float(re.search(r"after ([\d.]+)s", v)[1]) < LIMIT for v in verdicts.values())
    if mode == "disagree":
        assert all("processes [1] have device_order" in v for v in verdicts.values())


def mlx_launch(launcher: str, mode: str, tmp: Path) -> tuple[int, str, float]:
    """The worker under mpirun or mlx.launch: (exit code, output, seconds it took)."""
    pytest.importorskip("mlx.core")
    t0 = time.monotonic()
    rc, out = run_bounded(mlx_command(launcher, mode), base_env(), LIMIT + 30, tmp)
    return rc, out, time.monotonic() - t0


for _launcher in ("mpi", "ring"):
    for _name, _mode in (("killed_process", "die"), ("stuck_process", "stuck"),
                         ("process_that_never_starts", "never")):  # fmt: skip
        fault("mlx", f"test_mlx_with_a_{_name}[{_launcher}]")(
            lambda tmp, launcher=_launcher, mode=_mode: mlx_launch(launcher, mode, tmp)
        )


@pytest.mark.parametrize("launcher", ["mpi", "ring"])
@BATCH_TIMEOUT
def test_mlx_with_a_killed_process(launcher, faulted):
    """Both launchers end the job when a process is killed and name it: mpirun with its
    message and exit code, mlx.launch by ending the others (SIGTERM) and reporting each."""
    pytest.importorskip("mlx.core")
    rc, out, took = faulted
    assert took < LIMIT + 10
    if launcher == "mpi":
        assert rc != 0, out[-3000:]
        assert re.search(r"rank 1 .*signal 9|signal 9.*rank 1", out, re.DOTALL | re.IGNORECASE), (
            out[-3000:]
        )
    else:
        codes = ring_codes(out)
        assert codes.get(1) == -9 and sorted(codes) == list(range(N)), out[-3000:]
        assert all(c != 0 for c in codes.values()), codes


@pytest.mark.parametrize("launcher", ["mpi", "ring"])
@BATCH_TIMEOUT
def test_mlx_with_a_stuck_process(launcher, faulted):
    """A process that never comes to the check: the others' watchdog ends them with the
    message within their 15 s timeout (MLX collectives cannot be interrupted)."""
    pytest.importorskip("mlx.core")
    rc, out, took = faulted
    assert took < 40, out[-3000:]  # before the stuck process wakes up
    said = re.findall(
        r"unimesh: the mesh check on rank (\d+) of 4 did not finish within 15 s: a peer process "
        r"never started, is gone or is stuck: rank 1 never reached it \(of 4 processes, all on "
        r"this machine\); MLX cannot interrupt it",
        out,
    )
    # every one that says so names rank 1 (read from the job's sign-ins on this machine)
    assert said and "1" not in said, out[-3000:]
    assert out.count("did not finish within") == len(said), out[-3000:]
    if launcher == "mpi":
        assert rc != 0
    else:  # the watchdog process ends the waiting ones with SIGTERM
        assert any(c == -15 for c in ring_codes(out).values()), out[-3000:]


@pytest.mark.parametrize("launcher", ["mpi", "ring"])
@BATCH_TIMEOUT
def test_mlx_with_a_process_that_never_starts(launcher, faulted):
    """Process 1 never starts MLX's runtime. Under mpirun, mx.distributed.init() then waits
    holding the GIL (no Python thread can run); the watchdog process ends each of the others
    with its message within initialize's 20 s timeout."""
    pytest.importorskip("mlx.core")
    rc, out, took = faulted
    assert took < NEVER_BOUND, (took, out[-3000:])
    said = re.findall(
        r"unimesh: mx.distributed.init\(\) on rank (\d+) did not finish within 20 s: a peer "
        r"process never started, is gone or is stuck: rank 1 never reached it \(of 4 processes, "
        r"all on this machine\)",
        out,
    )
    assert out.count("did not finish within") == len(said), out[-3000:]
    # the launcher ends the job once the first one ends: at least one says so, never rank 1
    assert said and "1" not in said, out[-3000:]
    if launcher == "mpi":
        assert rc != 0, out[-3000:]
    else:
        assert any(c == -15 for c in ring_codes(out).values()), out[-3000:]


def test_mlx_without_its_launcher_names_the_variable(tmp_path):
    """MLX's init() gives a 1-process group when no distributed backend answers; the launcher
    said 4: initialize must not carry on with 1."""
    pytest.importorskip("mlx.core")
    code = (
        "import unimesh\ntry:\n    unimesh.initialize('mlx')\n"
        "except unimesh.LaunchError as exc:\n    print('LAUNCH', exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=base_env(MLX_WORLD_SIZE="4"),
        timeout=120,
        check=False,
    )
    assert "LAUNCH the launcher started 4 processes (MLX_WORLD_SIZE=4)" in proc.stdout, (
        proc.stdout + proc.stderr
    )
    assert "gave a group of 1" in proc.stdout


# -- single process: the launcher's variables ---------------------------------------------------
def test_initialize_names_missing_variables(monkeypatch):
    pytest.importorskip("torch.distributed")
    for var in (
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        unimesh.LaunchError,
        match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set: run under torchrun",
    ):
        unimesh.initialize("torch")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(unimesh.LaunchError, match="MASTER_PORT is not set"):
        unimesh.initialize("torch")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    with pytest.raises(unimesh.LaunchError, match="JAX_NUM_PROCESSES, JAX_PROCESS_ID are not set"):
        unimesh.initialize("jax")
    with pytest.raises(
        unimesh.UnimeshError, match="timeout must be a number of seconds > 0, got -1"
    ):
        unimesh.initialize("jax", timeout=-1)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "5")
    with pytest.raises(unimesh.LaunchError, match=r"JAX_PROCESS_ID=5 must be in 0\.\."):
        unimesh.initialize("jax")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1")
    with pytest.raises(unimesh.LaunchError, match="must be host:port .* got '127.0.0.1'"):
        unimesh.initialize("jax")
    assert isinstance(unimesh.LaunchError("x"), unimesh.MeshMismatchError)


def test_tensorflow_is_one_client(monkeypatch):
    pytest.importorskip("tensorflow")
    assert unimesh.initialize("tensorflow") == (0, 1)
    monkeypatch.setenv("DTENSOR_NUM_CLIENTS", "2")
    with pytest.raises(
        unimesh.UnsupportedError,
        match="DTENSOR_NUM_CLIENTS=2: the tensorflow backend runs one DTensor client",
    ):
        unimesh.initialize("tensorflow")


def test_single_process_verify_and_its_bad_input():
    pytest.importorskip("jax")
    mesh = unimesh.Mesh((2, 4), ("dp", "tp"))
    assert unimesh.initialize("jax") == (0, 1) == unimesh.initialize("jax")  # idempotent
    unimesh.verify(mesh, "jax", layout=unimesh.Layout(mesh, unimesh.P("dp")))
    with pytest.raises(
        unimesh.MeshMismatchError, match="uses device 63, but the jax runtime has 8 devices"
    ):
        unimesh.verify(unimesh.Mesh((8, 8), ("a", "b")), "jax")
    with pytest.raises(unimesh.MeshMismatchError, match="needs a unimesh.Mesh, got 'dp=2'"):
        unimesh.verify("dp=2", "jax")  # type: ignore[arg-type]
    with pytest.raises(unimesh.LayoutError, match="needs a unimesh.Layout, got 3"):
        unimesh.verify(mesh, "jax", layout=3)
    with pytest.raises(unimesh.LayoutError, match="the layout is on"):
        unimesh.verify(
            mesh, "jax", layout=unimesh.Layout(unimesh.Mesh((8,), ("x",)), unimesh.P("x"))
        )
    with pytest.raises(
        unimesh.UnimeshError, match="timeout must be a number of seconds > 0, got 'soon'"
    ):
        unimesh.verify(mesh, "jax", timeout="soon")  # type: ignore[arg-type]


def test_mismatch_message_names_processes_and_fields():
    from unimesh.runtime import _describe, fingerprint

    a = unimesh.Mesh((2, 4), ("dp", "tp"))
    b = unimesh.Mesh((4, 2), ("dp", "tp"))
    c = unimesh.Mesh((2, 4), ("x", "tp"))
    prints = [fingerprint(a), fingerprint(b), fingerprint(a), fingerprint(c), fingerprint(a)]
    text = _describe(prints)
    assert "processes [1] have shape [4, 2] where processes [0, 2, 4] have [2, 4]" in text
    assert "processes [3] have axis_names ['x', 'tp'] where processes [0, 2, 4]" in text


def test_the_fault_benchmark_reports_a_run(tmp_path):
    """benchmarks/faults.py (the exit-time table of docs/robustness.md) runs and reads its run:
    every process named the differing one."""
    pytest.importorskip("jax")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "faults.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--engines", "jax", "--modes", "disagree"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=base_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = re.search(
        r"^\| jax \| disagree \| 15 s \| ([\d.]+)-([\d.]+) s \| ([\d.]+) s \| 4 of 4 "
        r"\| 3, 3, 3, 3 \|$",
        proc.stdout,
        re.MULTILINE,
    )
    assert row and float(row[2]) <= float(row[3]) < LIMIT, proc.stdout
