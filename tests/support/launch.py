"""Starting real launchers from the tests: bounded in time, killed by process group on timeout."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from unimesh.cli.ending import kill_tree


def run_bounded(
    cmd: list[str], env: dict[str, str], limit: float, cwd: Path | None = None
) -> tuple[int, str]:
    """Run ``cmd`` in its own session; return (exit code, stdout+stderr). If it outlives
    ``limit`` seconds, kill its whole process group and fail the test with the output so far.

    Under a launcher (torchrun, mpirun, mlx.launch) each rank writes to a file of its own
    (tests/rank_log/sitecustomize.py): the output is the launcher's, then every rank's whole in
    rank order, so no two ranks' lines run together. A launcher gets a TMPDIR of its own,
    removed afterwards (torchrun, OpenMPI and mlx.launch leave files there)."""
    import tempfile

    with contextlib.ExitStack() as stack:
        logs = None
        if is_launcher(cmd):
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="unimesh-ranks-")))
            path = [str(RANK_LOG), *filter(None, [env.get("PYTHONPATH")])]
            env = dict(env, UNIMESH_TEST_RANK_LOG=str(logs), PYTHONPATH=os.pathsep.join(path))
            # a temporary directory of the launch's own, removed afterwards: torchrun leaves
            # torchelastic_* folders, OpenMPI its session folder, mlx.launch a pid file and a
            # hostfile per rank
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="unimesh-launch-"))
            env = dict(env, TMPDIR=scratch)
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
    it is killed as soon as every other process has ended, not waited for."""
    import tempfile
    import time

    with contextlib.ExitStack() as stack:
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
