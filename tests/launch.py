"""Starting real launchers from the tests: bounded in time, killed by process group on timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest


def run_bounded(
    cmd: list[str], env: dict[str, str], limit: float, cwd: Path | None = None
) -> tuple[int, str]:
    """Run ``cmd`` in its own session; return (exit code, stdout+stderr). If it outlives
    ``limit`` seconds, kill its whole process group and fail the test with the output so far."""
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
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {limit} s; output:\n{out[-4000:]}")
    return proc.returncode, out


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
    import time

    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        for env in envs
    ]
    outs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, limit - (time.monotonic() - t0)))
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        rest = [p.communicate()[0] for p in procs[len(outs) :]]
        pytest.fail(
            f"{cmd} did not finish within {limit} s; outputs:\n"
            + "\n---\n".join(o[-1500:] for o in outs + rest)
        )
    return [p.returncode for p in procs], outs, time.monotonic() - t0
