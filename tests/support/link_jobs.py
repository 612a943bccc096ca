"""Two jobs started by one test, each under its own launcher (``unimesh.link``'s tests): torchrun,
mpirun, or N ``python`` processes joined by ``jax.distributed``; each bounded in time, killed by
process group when it outlives its limit."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from launch import RANK_LOG, WORKERS, free_port, rank_logs, require_mpirun

from unimesh.cli.ending import kill_tree

WORKER = WORKERS / "link_worker.py"


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "UNIMESH_BACKEND")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def commands(
    kind: str, n: int, args: list[str], devices: int = 1
) -> list[tuple[list[str], dict[str, str]]]:
    """The processes of one job: ``torch`` (torchrun), ``mpi`` (mpirun) or ``jax`` (``n``
    python processes, ``devices`` CPU devices each)."""
    worker = [str(WORKER), *args]
    if kind == "torch":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(n), *worker]  # fmt: skip
        return [(cmd, base_env())]
    if kind == "mpi":
        cmd = [require_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", str(n),
               sys.executable, *worker]  # fmt: skip
        return [(cmd, base_env())]
    port = free_port()
    flags = (
        {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"} if devices > 1 else {}
    )
    return [
        ([sys.executable, *worker],
         base_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n),
                  JAX_PROCESS_ID=str(i), JAX_PLATFORMS="cpu", **flags))
        for i in range(n)
    ]  # fmt: skip


def run_jobs(
    procs: list[tuple[list[str], dict[str, str]]], limit: float, idle: set[int] = frozenset()
) -> tuple[list[int], str]:
    """Start every process (each in its own session, a launcher with a TMPDIR and rank logs of
    its own), wait for all but ``idle`` within ``limit`` seconds, then kill what is left;
    return the exit codes and everything they printed. A process still running at the limit
    fails the test."""
    with contextlib.ExitStack() as stack:
        started = []
        t0 = time.monotonic()
        for cmd, env in procs:
            env = dict(env)
            logs = None
            if cmd[0] != sys.executable:  # a launcher
                logs = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="unimesh-ranks-"))
                )
                scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="unimesh-launch-"))
                path = [str(RANK_LOG), *filter(None, [env.get("PYTHONPATH")])]
                env.update(UNIMESH_TEST_RANK_LOG=str(logs), TMPDIR=scratch,
                           PYTHONPATH=os.pathsep.join(path))  # fmt: skip
            out = stack.enter_context(tempfile.TemporaryFile("w+"))
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                 start_new_session=True)  # fmt: skip
            started.append((p, out, logs))
        try:
            while time.monotonic() - t0 < limit:
                if all(
                    p.poll() is not None for i, (p, _, _) in enumerate(started) if i not in idle
                ):
                    break
                time.sleep(0.1)
            late = [i for i, (p, _, _) in enumerate(started) if p.poll() is None and i not in idle]
        finally:
            for p, _, _ in started:
                if p.poll() is None:
                    kill_tree(p.pid)
                    p.wait()
        texts = []
        for _, out, logs in started:
            out.seek(0)
            texts.append(out.read() + rank_logs(logs))
        text = "\n---\n".join(texts)
        if late:
            pytest.fail(f"processes {late} did not finish within {limit} s:\n{text[-6000:]}")
        return [p.returncode for p, _, _ in started], text
