"""Ending a launcher the command line started (``demo``, ``check``) before it finished."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

#: Seconds a launcher has to end its processes after SIGTERM, where its tree cannot be read.
GRACE = 10.0


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants, from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, sig)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant /proc lists: the tree is
    stopped first (SIGSTOP, again until no new process appears, so none can start another),
    including processes a launcher put in sessions of their own (torchrun's workers,
    OpenMPI's daemon). Where there is no /proc: the process group only."""
    tree: list[int] = []
    while os.path.isdir("/proc"):
        _signal([pid, *tree], signal.SIGSTOP)
        found = descendants(pid)
        if set(found) <= set(tree):
            break
        tree = sorted(set(tree) | set(found))
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    _signal([pid, *tree], signal.SIGKILL)


def end_launch(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """End ``proc`` (started with ``start_new_session=True``) and every process it started.
    Where /proc lists them: :func:`kill_tree` (torchrun's workers sit outside its process
    group, and a launcher ended while starting them leaves them waiting for a peer).
    Elsewhere: SIGTERM to the process group (torchrun, mpirun and mlx.launch pass it on),
    then SIGKILL after :data:`GRACE` seconds."""
    if proc.poll() is not None:
        return
    if os.path.isdir("/proc"):
        kill_tree(proc.pid)
        proc.wait()
        return
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
