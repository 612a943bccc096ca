"""Kill a saving job at a random moment and say what its checkpoint path holds (used by
tests/test_checkpoint_crash.py and benchmarks/crash.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import unimesh

from .launch import WORKERS, kill_tree

WORKER = str(WORKERS / "checkpoint_crash_worker.py")


def command(engine: str, path: Path, logs: Path, processes: int = 4) -> list[str]:
    """The worker under ``engine``: ``single`` (one process, numpy), ``torchrun`` or
    ``mpirun`` (``processes`` processes, sharded arrays)."""
    args = [WORKER, {"single": "numpy", "torchrun": "torch", "mpirun": "mlx"}[engine],
            str(path), str(logs)]  # fmt: skip
    if engine == "single":
        return [sys.executable, *args]
    if engine == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={processes}", *args]  # fmt: skip
    mpirun = shutil.which("mpirun") or "mpirun"
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(processes),
            sys.executable, *args]  # fmt: skip


def _finished(logs: Path) -> list[int]:
    path = logs / "rank-0.log"
    if not path.exists():
        return []
    return [int(line) for line in path.read_text().split()]


def trial(engine: str, path: Path, logs: Path, delay: float, env: dict[str, str]) -> dict[str, Any]:
    """Start the worker, wait for its first save to finish (so the previous checkpoint is this
    trial's), wait ``delay`` seconds more, SIGKILL every process of the job, then read what
    ``path`` holds. Returns ``outcome``: ``previous`` (the last save that had returned),
    ``new`` (the one in flight, already committed) or ``broken`` (with ``why``)."""
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    scratch = logs / "tmp"  # the launcher's temporary files (torchelastic, OpenMPI), removed
    scratch.mkdir()  # with ``logs`` by the next trial or the test's tmp_path
    proc = subprocess.Popen(
        command(engine, path, logs),
        env=dict(env, TMPDIR=str(scratch)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _finished(logs):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                return {"outcome": "broken", "why": f"no first save (rc {proc.returncode}): "
                        f"{err[-2000:]}"}  # fmt: skip
            time.sleep(0.02)
        time.sleep(delay)
    finally:
        kill_tree(proc.pid)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
    done = _finished(logs)
    last = done[-1]
    try:
        ckpt = unimesh.open_checkpoint(path)
        gen = int(ckpt.read("gen")[0])
        for name in ckpt.names:
            values = np.unique(ckpt.read(name))
            if values.tolist() != [gen]:
                return {"outcome": "broken", "why": f"{name} holds {values[:4]}, gen is {gen}"}
    except unimesh.CheckpointError as exc:
        return {"outcome": "broken", "why": str(exc)}
    if gen == last:
        outcome = "previous"
    elif gen == last + 1:
        outcome = "new"
    else:
        outcome = "broken"
    files = sum(1 for p in path.iterdir() if p.name.startswith(("data-", ".manifest")))
    why = "" if outcome != "broken" else f"gen {gen}, last finished save {last}"
    return {"outcome": outcome, "gen": gen, "last": last, "saves": len(done), "files": files,
            "why": why}  # fmt: skip


def leftovers_after_a_save(path: Path) -> list[str]:
    """Save once more into ``path`` (one process): the files left that the new manifest does
    not name (the next save must have removed what killed saves left)."""
    unimesh.save(path, {"gen": np.array([0], np.int64)})
    ckpt = unimesh.open_checkpoint(path)
    named = {box.file for name in ckpt.names for box in ckpt.tensor(name).boxes}
    return sorted(p.name for p in path.iterdir() if p.name != "manifest.json" and
                  p.name not in named)  # fmt: skip
