"""One process of a unimesh.verify run: python verify_worker.py BACKEND MODE [WORLD].

clean: every process builds the same mesh; verify passes; exit 0.
disagree: process 1 builds the mesh with its device order reversed; every process must raise
    MeshMismatchError (exit 3).
die: after a first check that every process passes (so every runtime has started: killed
    earlier, process 1 could end a peer's initialize instead), process 1 kills itself
    (SIGKILL); the others' next verify must say a peer is gone (exit 4).
small: the mesh needs one device more than the world has (exit 5).
stuck: process 1 sleeps 40 s before its check; the others must say a peer is gone or stuck
    within their 15 s timeout instead of waiting (exit 4).
never: process 1 never starts the runtime (it sleeps 40 s first); the others' initialize must
    end within its 20 s timeout, naming the process that did not join (exit 6).
never0: the same with process 0, the coordinator (JAX).
save-die, save-stuck: every process saves a checkpoint into $CHECKPOINT_DIR, then process 1
    kills itself (or sleeps 40 s) and the others save again with a 15 s timeout: each must
    raise CheckpointError naming rank 1, the previous checkpoint intact (exit 4).
save-full: a first small save into $CHECKPOINT_DIR (a small tmpfs), then one of 1 MiB a process
    that the disk cannot hold: every process must raise CheckpointError saying so, the
    previous checkpoint intact (exit 4).
Each process prints one VERIFY line saying what it checked.

Several of clean, disagree and small joined by "+" (clean+disagree+small) run one after the
other in one launch (a MeshMismatchError leaves the runtime usable); each case's line is tagged
[MODE], its clock starts with the case, it carries the exit code the case alone would give
(code=N), and the process exits 0 after the last.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

import numpy as np

import unimesh

# a process still running after 75 s (the tests kill it at 90) shows where it waits
faulthandler.dump_traceback_later(75)
backend, mode = sys.argv[1], sys.argv[2]
t0 = time.monotonic()
launched_rank = next(
    (
        os.environ[v]
        for v in ("RANK", "JAX_PROCESS_ID", "OMPI_COMM_WORLD_RANK", "MLX_RANK")
        if v in os.environ
    ),
    "0",
)
launched_world = next(
    (
        os.environ[v]
        for v in ("WORLD_SIZE", "JAX_NUM_PROCESSES", "OMPI_COMM_WORLD_SIZE", "MLX_WORLD_SIZE")
        if v in os.environ
    ),
    "0",
)
if (mode, launched_rank) in (("never", "1"), ("never0", "0")):
    time.sleep(40)
    sys.exit(0)
try:
    rank, world = unimesh.initialize(backend, timeout=20)
except unimesh.LaunchError as exc:
    print(
        f"VERIFY rank {launched_rank} of {launched_world} launch after "
        f"{time.monotonic() - t0:.1f}s: {exc}",
        flush=True,
    )
    time.sleep(1.0)  # as below: every rank prints before a launcher ends the rest
    sys.exit(6)
size = world


def mesh_for(case: str) -> unimesh.Mesh:
    if case == "disagree" and rank == 1:
        return unimesh.Mesh((2, size // 2), ("dp", "tp"), np.arange(size)[::-1].reshape(2, -1))
    if case == "small":
        return unimesh.Mesh((2, size // 2 + 1), ("dp", "tp"))
    return unimesh.Mesh((2, size // 2), ("dp", "tp"))


if "+" in mode:  # the cases that share a launch
    for case in mode.split("+"):
        t0 = time.monotonic()
        mesh = mesh_for(case)
        try:
            layout = unimesh.Layout(mesh, unimesh.P("dp"))
            unimesh.verify(mesh, backend, layout=layout, timeout=15)
            kind, code, said = "ok", 0, ""
        except unimesh.MeshMismatchError as exc:
            kind = (
                "gone" if "gone" in str(exc) else "devices" if "uses device" in str(exc)
                else "mismatch"
            )  # fmt: skip
            code, said = {"mismatch": 3, "gone": 4, "devices": 5}[kind], f": {exc}"
        print(
            f"VERIFY [{case}] rank {rank} of {world} code={code} {kind} after "
            f"{time.monotonic() - t0:.1f}s{said}",
            flush=True,
        )
    sys.exit(0)
mesh = mesh_for(mode)
if mode.startswith("save-"):  # a second save that fails; CHECKPOINT_DIR holds the first
    path = os.environ["CHECKPOINT_DIR"]
    tree = {"w": np.full((4, 4), 1.0, np.float32)}
    unimesh.save(path, tree, backend=backend, timeout=15)  # the previous checkpoint
    if mode == "save-full":  # sharded, 1 MiB a process: more than the small tmpfs holds
        line = unimesh.Mesh((world,), ("x",))
        big = np.ones((world * 256, 1024), np.float32)
        second = {"w": unimesh.distribute(big, unimesh.Layout(line, unimesh.P("x")), backend)}
    else:  # a peer gone (save-die) or stuck (save-stuck)
        if rank == 1:
            if mode == "save-die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(40)
            sys.exit(0)
        second = {"w": np.full((4, 4), 2.0, np.float32)}
    try:
        unimesh.save(path, second, backend=backend, timeout=15)
    except unimesh.CheckpointError as exc:
        kept = unimesh.open_checkpoint(path).read("w").tolist() == tree["w"].tolist()
        print(
            f"VERIFY rank {rank} of {world} {'full' if mode == 'save-full' else 'gone'} after "
            f"{time.monotonic() - t0:.1f}s (previous checkpoint {'intact' if kept else 'LOST'}): "
            f"{exc}",
            flush=True,
        )
        time.sleep(1.0)  # let every rank print before the first exit ends the rest
        sys.exit(4)
    print(f"VERIFY rank {rank} of {world} saved after {time.monotonic() - t0:.1f}s", flush=True)
    sys.exit(0)
if mode == "stuck" and rank == 1:
    time.sleep(40)
try:
    if mode == "die":  # a first check, so that process 1 dies once every runtime has started
        unimesh.verify(mesh, backend, layout=unimesh.Layout(mesh, unimesh.P("dp")), timeout=15)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    unimesh.verify(mesh, backend, layout=unimesh.Layout(mesh, unimesh.P("dp")), timeout=15)
except unimesh.MeshMismatchError as exc:
    kind = "gone" if "gone" in str(exc) else "devices" if "uses device" in str(exc) else "mismatch"
    print(
        f"VERIFY rank {rank} of {world} {kind} after {time.monotonic() - t0:.1f}s: {exc}",
        flush=True,
    )
    time.sleep(1.0)  # let every rank print before the first exit makes a launcher end the rest
    sys.exit({"mismatch": 3, "gone": 4, "devices": 5}[kind])
print(f"VERIFY rank {rank} of {world} ok after {time.monotonic() - t0:.1f}s", flush=True)
