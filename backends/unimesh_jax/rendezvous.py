"""The JAX backend's process rendezvous and its exit after a lost peer.

``jax.distributed.initialize`` cannot report a process that never starts: its coordination
client aborts every other process from C++ (SIGABRT, "RegisterTask" deadline exceeded), where no
Python exception can be raised and no process is named. So before it, the processes meet once
on the coordinator's port in a small line protocol of their own: process 0 listens, every other
process says who it is, and process 0 answers each with a verdict: all here, or which processes
did not come (or claim the same id, or count the processes differently). Every process then
raises the same ``LaunchError``, or goes on to ``jax.distributed.initialize`` on that port.

After a peer is found gone, :func:`leave_without_peers` makes this process's exit skip JAX's
shutdown barrier, which would otherwise hold it for the shutdown timeout and then abort it.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from typing import Any

from unimesh import LaunchError
from unimesh.messages import short

__all__ = ["leave_without_peers", "processes", "rendezvous", "split_address"]

_HELLO = re.compile(r"unimesh-jax (\d{1,9}) (\d{1,9})")
_LINE = 4096  # longest line either side reads
_SETTLE = 5.0  # seconds a process waits for the verdict after process 0's deadline


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) of ``JAX_COORDINATOR_ADDRESS``, checked."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise LaunchError(
            f"JAX_COORDINATOR_ADDRESS must be host:port (for example 10.0.0.1:1234), got "
            f"{address[:200]!r}"
        )
    return host, int(port)


def _read_line(conn: socket.socket, deadline: float) -> str | None:
    """One line (at most ``_LINE`` bytes) before ``deadline``; None if the peer closed, sent
    something too long or not ASCII, or was silent."""
    data = b""
    while b"\n" not in data and len(data) <= _LINE:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(_LINE)
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    line, _, _ = data.partition(b"\n")
    try:
        return line.decode("ascii") if len(line) <= _LINE else None
    except UnicodeDecodeError:
        return None


def processes(ranks: list[int]) -> str:
    """``process 1`` or ``processes [1, 3]`` (a long list cut short, as the core's messages)."""
    return f"process {ranks[0]}" if len(ranks) == 1 else f"processes {short(ranks, 60)}"


def _serve(port: int, procs: int, timeout: float, address: str) -> str:
    """Process 0: wait up to ``timeout`` for the other processes; tell each the verdict (empty
    when all came and agree) and return it."""
    try:
        if socket.has_dualstack_ipv6():
            server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            server = socket.create_server(("", port))
    except OSError as exc:
        raise LaunchError(
            f"process 0 cannot listen on the coordinator port {port} ({address}): {exc}; "
            "choose a free port for JAX_COORDINATOR_ADDRESS"
        ) from None
    deadline = time.monotonic() + timeout
    came: dict[int, socket.socket] = {}
    extra: list[socket.socket] = []
    problems: list[str] = []
    try:
        while len(came) < procs - 1 and time.monotonic() < deadline:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except OSError:  # the deadline passed
                break
            line = _read_line(conn, min(deadline, time.monotonic() + 5.0)) or ""
            hello = _HELLO.fullmatch(line)
            if hello is None:  # not one of ours: a stranger or a port scanner
                conn.close()
                continue
            pid, count = int(hello[1]), int(hello[2])
            if count != procs:
                problems.append(
                    f"process {pid} has JAX_NUM_PROCESSES={count} where process 0 has {procs}"
                )
            if pid in came or not 0 < pid < procs:
                problems.append(
                    f"two processes have JAX_PROCESS_ID={pid}"
                    if pid in came or pid == 0
                    else f"a process has JAX_PROCESS_ID={pid}, outside 0..{procs - 1}"
                )
                extra.append(conn)
                continue
            came[pid] = conn
        missing = [p for p in range(1, procs) if p not in came]
        if missing:
            problems.insert(
                0,
                f"{processes(missing)} of {procs} did not start within {timeout:.0f} s (the "
                f"coordinator {address} heard from {processes([0, *sorted(came)])})",
            )
        verdict = "; ".join(problems)
        for conn in [*came.values(), *extra]:
            try:
                conn.sendall(f"{verdict or 'ok'}\n".encode("ascii", "replace"))
                # the peer closes first, so that no socket of this port lingers here (the
                # coordination service binds the port next)
                _read_line(conn, time.monotonic() + 2.0)
            except OSError:
                pass
            conn.close()
    finally:
        server.close()
    return verdict


def _join(host: str, port: int, pid: int, procs: int, timeout: float, address: str) -> str:
    """A process other than 0: reach process 0 within ``timeout``, say who this is, and return
    its verdict (empty when all came)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection(
                (host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))
            )
            break
        except OSError:
            if time.monotonic() >= deadline:
                return (
                    f"process 0 of {procs} (the coordinator, {address}) did not start within "
                    f"{timeout:.0f} s, or the others met without this process (is "
                    f"JAX_PROCESS_ID={pid} given twice?)"
                )
            time.sleep(0.05)
    with conn:
        with contextlib.suppress(OSError):  # a closed peer shows as no answer below
            conn.sendall(f"unimesh-jax {pid} {procs}\n".encode("ascii"))
        line = _read_line(conn, deadline + _SETTLE)
    if line is None:
        return (
            f"process 0 of {procs} ({address}) gave no answer within {timeout:.0f} s (is "
            "another program on that port, did process 0 stop, or did the others meet without "
            f"this process: is JAX_PROCESS_ID={pid} given twice?)"
        )
    return "" if line == "ok" else line


def rendezvous(address: str, procs: int, pid: int, timeout: float) -> None:
    """Meet every other process on the coordinator's port within ``timeout`` seconds, before
    ``jax.distributed.initialize``; raise the same ``LaunchError`` on every process that came
    when one did not (naming it), two share an id, or they count the processes differently."""
    host, port = split_address(address)
    if procs == 1:
        return
    if pid == 0:
        verdict = _serve(port, procs, timeout, address)
    else:
        verdict = _join(host, port, pid, procs, timeout, address)
    if verdict:
        raise LaunchError(
            f"jax.distributed (this is process {pid} of {procs}): {verdict}; start every "
            "process with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES and its own "
            "JAX_PROCESS_ID, or raise initialize's timeout"
        )


def leave_without_peers() -> None:
    """A peer is gone or stuck, so JAX's exit barrier (every process meets at
    ``jax.distributed.shutdown``) cannot complete: it would hold this process for the shutdown
    timeout and then abort it. Detach the coordination client (and, on process 0, the service)
    from JAX's state so that exit skips the barrier. Both are kept, never destroyed: their
    destructors would run the barrier too; the process's end takes them."""
    import ctypes

    from jax._src import distributed

    state: Any = distributed.global_state
    if state.preemption_sync_manager is not None:
        state.preemption_sync_manager.shutdown()
        state.preemption_sync_manager = None
    for name in ("client", "service"):
        held = getattr(state, name)
        if held is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(held))
            setattr(state, name, None)
