"""The fault-verification launches' shared parts (tests/test_verify.py, the disk-full
checkpoint tests, benchmarks/faults.py): the worker, the bounds, and each engine's process
environments and launch commands."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from .launch import WORKERS, free_port, require_mpirun

WORKER = str(WORKERS / "verify_worker.py")
N = 4
LIMIT = 60  # the bound: every process has answered within a minute
CHECK_TIMEOUT = 15  # verify(timeout=...) in verify_worker.py
# a gone or stuck peer is reported within the timeout plus 15 s (issue 17), twice the timeout
# here, for a loaded 2-core machine
GONE_BOUND = 2 * CHECK_TIMEOUT + 15
INIT_TIMEOUT = 20  # initialize(timeout=...) in verify_worker.py
NEVER_BOUND = 2 * INIT_TIMEOUT + 15


def base_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "KERAS_BACKEND", "UNIMESH_BACKEND")
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        **extra,
    )
    return env


def lines(out: str) -> dict[int, str]:
    """Each rank's VERIFY line (launchers may run two ranks' lines together)."""
    return {
        int(m[1]): m[0] for m in re.finditer(r"VERIFY rank (\d+) of \d+ (?:(?!VERIFY rank).)*", out)
    }


def torch_envs() -> list[dict[str, str]]:
    """N processes' torch.distributed variables (env://), rank 0's store on a free port."""
    port = str(free_port())
    return [
        base_env(
            RANK=str(r),
            WORLD_SIZE=str(N),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for r in range(N)
    ]


def jax_envs() -> list[dict[str, str]]:
    """N processes' jax.distributed variables, one coordinator on a free port."""
    address = f"127.0.0.1:{free_port()}"
    return [
        base_env(
            JAX_COORDINATOR_ADDRESS=address,
            JAX_NUM_PROCESSES=str(N),
            JAX_PROCESS_ID=str(r),
            JAX_PLATFORMS="cpu",
        )
        for r in range(N)
    ]


def mlx_command(launcher: str, mode: str) -> list[str]:
    if launcher == "mpi":
        return [
            require_mpirun(),
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            str(N),
            sys.executable,
            WORKER,
            "mlx",
            mode,
        ]
    return [
        str(Path(sys.executable).with_name("mlx.launch")),
        "-n",
        str(N),
        "--backend",
        "ring",
        "--",
        sys.executable,
        WORKER,
        "mlx",
        mode,
    ]
