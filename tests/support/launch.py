"""Starting real launchers from the tests: bounded in time, killed by process group on timeout."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unimesh.cli.ending import descendants, kill_tree

# -- the run's own launches: what the session-end check (tests/conftest.py) judges ------------
#: the environment variable that marks every process the run starts: the whole session's
#: value (tests/conftest.py sets it), one value per launch here, so that the end-of-run check
#: finds the run's own processes, those a launcher left behind outside this process's tree too,
#: and never another program's
LAUNCH_VAR = "UNIMESH_TEST_LAUNCH"
#: this process's run, under the mark it inherited (a run started by a launch of another run
#: is part of that run: the enclosing run's check finds what it left behind too)
RUN = f"{os.environ.get(LAUNCH_VAR, '')}/{os.getpid()}-{os.urandom(4).hex()}"


@dataclass(frozen=True)
class Launch:
    """One start of processes by these helpers: its mark (``LAUNCH_VAR``), what it ran, the
    test that ran it, and the temporary folder of its own (a launcher's TMPDIR) if any."""

    tag: str
    command: str
    test: str
    scratch: Path | None = None

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with this launch's mark (and its TMPDIR, where it has one)."""
        extra = {LAUNCH_VAR: self.tag}
        if self.scratch is not None:
            extra["TMPDIR"] = str(self.scratch)
        return dict(env, **extra)

    def __str__(self) -> str:
        return f"launch `{self.command}` in {self.test or 'no test'}"


#: every launch of this run, in order
LAUNCHES: list[Launch] = []


@contextlib.contextmanager
def launching(cmd: list[str], scratch: bool) -> Iterator[Launch]:
    """Record a launch of ``cmd`` (with a temporary folder of its own where ``scratch``: a
    launcher's files go there, torchrun's ``torchelastic_*``, OpenMPI's session folder,
    mlx.launch's pid file and hostfiles); its folder is removed when the block ends (the
    processes have ended by then). A folder that could not be removed, or that a straggler
    wrote into again, is left for the session's end to report."""
    import shlex
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="unimesh-launch-")) if scratch else None
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    launch = Launch(f"{RUN}/{len(LAUNCHES)}", shlex.join(cmd)[:160], test, folder)
    LAUNCHES.append(launch)
    try:
        yield launch
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Leftovers:
    """What the run left behind: launches' folders still there, and processes of the run
    still running (process id, command line, the launch that started it where known)."""

    folders: list[Launch]
    processes: list[tuple[int, str, Launch | None]]

    def __bool__(self) -> bool:
        return bool(self.folders or self.processes)

    def lines(self) -> list[str]:
        out = []
        for pid, cmd, launch in self.processes:
            out.append(f"still running: pid {pid} ({launch or 'started by the run'}): {cmd}")
        for launch in self.folders:
            assert launch.scratch is not None
            try:
                names = sorted(p.name for p in launch.scratch.iterdir())
            except OSError:
                names = []
            held = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "") or "nothing"
            out.append(f"not removed: {launch.scratch}, the TMPDIR of {launch}, holding {held}")
        return out

    def clean(self) -> None:
        """End the processes (by process id, with what they started), then remove the folders."""
        for pid, _, _ in self.processes:
            kill_tree(pid)
        for launch in self.folders:
            if launch.scratch is not None:
                shutil.rmtree(launch.scratch, ignore_errors=True)


def _running(pid: int) -> tuple[str, str] | None:
    """(state letter, command line) of ``pid``; None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return None
    return state, cmd[:200]


def _marked() -> dict[int, str]:
    """The processes whose environment carries this run's mark (``LAUNCH_VAR``: the run's
    value, or a value under it), with that value. Every other process is passed over, and so
    is one whose environment cannot be read (another user's, where this one is not root)."""
    found: dict[int, str] = {}
    key = LAUNCH_VAR.encode() + b"="
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        for item in environ.split(b"\0"):
            if item.startswith(key):
                value = item[len(key) :].decode(errors="replace")
                if value == RUN or value.startswith(RUN + "/"):
                    found[int(entry)] = value
                break
    return found


#: seconds the run's processes still running at its end have to end on their own before they
#: count as left behind (a launched rank's watchdog sees its pipe close and exits a moment after
#: the rank; a test's forked child may outlive its parent by design, for a second or two)
GRACE = 5.0


def _alive(pid: int) -> str | None:
    """``pid``'s command line while it runs (None: gone, a zombie, or one of the helpers that
    live exactly as long as this process by design: multiprocessing's resource tracker;
    OpenMPI's singleton daemon, which MLX's ``mx.distributed.init`` starts in a process not
    launched by mpirun, and which exits when its pipe to this process closes)."""
    found = _running(pid)
    if found is None:
        return None
    state, cmd = found
    if state == "Z" or "resource_tracker" in cmd or "--singleton-died-pipe" in cmd:
        return None
    return cmd


def left_behind(grace: float = GRACE) -> Leftovers:
    """What the run itself left: each process still running ``grace`` seconds on that this
    process started (its descendants) or that carries the run's mark (one a launcher left
    behind, now outside this process's tree), and each launch's folder not removed. Whatever
    other programs on the machine make, in the temporary folder or elsewhere, is not looked
    at."""
    import time

    marked = _marked()
    running = {pid: cmd for pid in set(descendants(os.getpid())) | set(marked)
               if (cmd := _alive(pid)) is not None}  # fmt: skip
    end = time.monotonic() + grace
    while running and time.monotonic() < end:
        time.sleep(0.05)
        running = {pid: cmd for pid, cmd in running.items() if _alive(pid) is not None}
    by_tag = {launch.tag: launch for launch in LAUNCHES}
    processes: list[tuple[int, str, Launch | None]] = []
    for pid, cmd in sorted(running.items()):
        tag = marked.get(pid, "")  # a launch's own, or one of a run that launch started
        while tag and tag not in by_tag:
            tag = tag.rpartition("/")[0]
        processes.append((pid, cmd, by_tag.get(tag)))
    folders = [launch for launch in LAUNCHES if launch.scratch and launch.scratch.exists()]
    return Leftovers(folders, processes)


def run_bounded(
    cmd: list[str], env: dict[str, str], limit: float, cwd: Path | None = None
) -> tuple[int, str]:
    """Run ``cmd`` in its own session; return (exit code, stdout+stderr). If it outlives
    ``limit`` seconds, kill its whole process group and fail the test with the output so far.

    Under a launcher (torchrun, mpirun, mlx.launch) each rank writes to a file of its own
    (tests/rank_log/sitecustomize.py): the output is the launcher's, then every rank's whole in
    rank order, so no two ranks' lines run together. A launcher gets a TMPDIR of its own,
    removed afterwards (torchrun, OpenMPI and mlx.launch leave files there); every launch is
    recorded for the session's end (:func:`left_behind`)."""
    import tempfile

    with contextlib.ExitStack() as stack:
        logs = None
        launch = stack.enter_context(launching(cmd, scratch=is_launcher(cmd)))
        env = launch.env(env)
        if is_launcher(cmd):
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="unimesh-ranks-")))
            path = [str(RANK_LOG), *filter(None, [env.get("PYTHONPATH")])]
            env = dict(env, UNIMESH_TEST_RANK_LOG=str(logs), PYTHONPATH=os.pathsep.join(path))
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, _ = proc.communicate()
            out += rank_logs(logs)
            pytest.fail(f"{cmd} did not finish within {limit} s; output:\n{out[-4000:]}")
        out += rank_logs(logs)
    return proc.returncode, out


RANK_LOG = Path(__file__).resolve().parents[1] / "rank_log"
#: the scripts the tests launch, and the modules they share with the tests
WORKERS = Path(__file__).resolve().parents[1] / "workers"
SUPPORT = Path(__file__).resolve().parent


def is_launcher(cmd: list[str]) -> bool:
    """Whether ``cmd`` starts ranks: torchrun, mpirun or mlx.launch."""
    names = ("mpirun", "mlx.launch", "torchrun")
    return Path(cmd[0]).name in names or "torch.distributed.run" in cmd


def rank_logs(folder: Path | None) -> str:
    """Every rank's log in ``folder``, in rank order (empty without one)."""
    if folder is None:
        return ""
    files = sorted(folder.glob("rank-*.log"), key=lambda f: int(f.stem.split("-")[1]))
    texts = (f.read_text(errors="replace") for f in files)
    return "".join(t if t.endswith("\n") else t + "\n" for t in texts if t)


def require_mpirun() -> str:
    """Path of mpirun. Missing: a failure in CI (``.ci/run`` installs openmpi), a skip that
    names the package elsewhere."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        hint = "mpirun is not installed: apt-get install openmpi-bin libopenmpi-dev"
        if os.environ.get("CI"):
            pytest.fail(hint + " (.ci/run does)")
        pytest.skip(hint)
    return mpirun


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    cmd: list[str], envs: list[dict[str, str]], limit: float, cwd: Path | None = None
) -> tuple[list[int], list[str], float]:
    """Start one process per env (each in its own session), wait for all within ``limit``
    seconds; return exit codes, outputs and the seconds it took. On timeout every process
    group is killed and the test fails with what each printed."""
    codes, outs, ends = run_ranks_timed(cmd, envs, limit, cwd)
    return codes, outs, max(ends)


def run_ranks_timed(
    cmd: list[str],
    envs: list[dict[str, str]],
    limit: float,
    cwd: Path | None = None,
    idle: int | None = None,
) -> tuple[list[int], list[str], list[float]]:
    """:func:`run_ranks`, giving the seconds after the start at which each process ended.

    ``idle``: a process whose own end is not checked (one that sleeps so as to be missing):
    it is killed as soon as every other process has ended, not waited for. The processes
    share one TMPDIR of the job's own (MLX's sign-ins), removed afterwards."""
    import tempfile
    import time

    with contextlib.ExitStack() as stack:
        launch = stack.enter_context(launching(cmd, scratch=True))
        envs = [launch.env(env) for env in envs]
        files = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in envs]
        t0 = time.monotonic()
        procs = [
            subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
            for env, f in zip(envs, files, strict=True)
        ]
        ends: list[float | None] = [None] * len(procs)
        while any(e is None for e in ends) and time.monotonic() - t0 < limit:
            for i, p in enumerate(procs):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.monotonic() - t0
            others = (e is not None for i, e in enumerate(ends) if i != idle)
            if idle is not None and ends[idle] is None and all(others):
                kill_tree(procs[idle].pid)
                procs[idle].wait()
                ends[idle] = time.monotonic() - t0
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
        outs = []
        for f in files:
            f.seek(0)
            outs.append(f.read())
    if any(e is None for e in ends):
        pytest.fail(
            f"{cmd} did not finish within {limit} s (processes "
            f"{[i for i, e in enumerate(ends) if e is None]} were killed); outputs:\n"
            + "\n---\n".join(o[-1500:] for o in outs)
        )
    return [p.returncode for p in procs], outs, [float(e or 0.0) for e in ends]


def run_worker(
    worker: Path, launcher: str, args: list[str], limit: float, **extra_env: str
) -> tuple[int, str]:
    """``python worker args...`` under ``launcher``: ``torch`` (torchrun --standalone, 4
    processes), ``mlx`` (mpirun -np 4) or anything else (one process), with the tests folder
    on PYTHONPATH, one OpenMP thread and ``extra_env``; bounded by ``limit`` seconds."""
    import sys

    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")]),
        **extra_env,
    )
    cmd = [str(worker), *args]
    if launcher == "torch":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", *cmd]  # fmt: skip
    elif launcher == "mlx":
        cmd = [require_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "4",
               sys.executable, *cmd]  # fmt: skip
    else:
        cmd = [sys.executable, *cmd]
    return run_bounded(cmd, env, limit)


def worker_output(
    worker: Path, launcher: str, args: list[str], limit: float, **extra_env: str
) -> str:
    """:func:`run_worker`, failing the test with the end of its output unless it exits 0."""
    rc, output = run_worker(worker, launcher, args, limit, **extra_env)
    assert rc == 0, output[-6000:]
    return output


def need(*modules: str) -> None:
    """Skip unless each module is installed, without importing it (``pytest.importorskip``
    would load it into this process)."""
    import importlib.util

    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            pytest.skip(f"{name} is not installed")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m unimesh ARGS`` (``python -c CODE`` when args start with ``-c``)."""
    command = list(args) if args[:1] == ("-c",) else ["-m", "unimesh", *args]
    return subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
        env=env,
    )
