"""Real multi-process JAX: N local processes joined by jax.distributed.initialize on 127.0.0.1
(gloo CPU collectives, 2 devices each), started from pytest, bounded in time."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from .support.launch import WORKERS

pytest.importorskip("jax")

WORKER = WORKERS / "jax_worker.py"
LIMIT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(n: int) -> tuple[list[int], str]:
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), address, str(n), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + LIMIT
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        text = "\n".join(p.communicate()[0] or "" for p in procs)
        pytest.fail(f"{n} JAX processes did not finish within {LIMIT} s:\n{text[-4000:]}")
    return [p.returncode for p in procs], "\n".join(outs)


@pytest.mark.parametrize("n", [2, 4])
def test_jax_distributed(n: int) -> None:
    codes, out = run_processes(n)
    assert codes == [0] * n, out[-6000:]
    done = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"PROCESS (\d+) OK (\d+)", out)}
    assert sorted(done) == list(range(n)), out[-6000:]
    assert len(set(done.values())) == 1 and min(done.values()) >= 20, done
