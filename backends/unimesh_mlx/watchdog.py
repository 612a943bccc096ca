"""The MLX backend's watchdog process: it ends a process whose collective did not finish in time
(MLX collectives cannot be interrupted). One per process that uses it, started by
:meth:`unimesh_mlx.process.MLXProcess.watch` as ``python -I -S <this file> PID`` (isolated, no
site: a Python start, about 20 ms; the standard library only, so the path, not ``-m``, which
would import the package and everything it imports). ``python -m unimesh_mlx.watchdog PID``
runs the same program.

The protocol, on its stdin: a line that arms it (JSON: seconds, message, sign-in directory,
stage, world size, whether all processes run on this machine), then the next line, which
disarms it (``disarm`` alone disarms a call interrupted before it armed); an end of file (the
watched process closed it, or the kernel did when that process died) ends it. When an armed
call's time is up, it says so on stderr (naming, from the job's sign-in directory, the ranks
that never came) and ends the watched process (SIGTERM, then SIGKILL 5 s later).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time


class Lines:
    """Lines read from a file descriptor, each within a deadline."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = b""

    def next(self, deadline: float | None) -> bytes | None:
        """The next line (without its newline); ``b""`` at the end of the input; None when
        ``deadline`` (``time.monotonic()``) passed first (a line already written when the
        time is up still counts)."""
        while b"\n" not in self.pending:
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                if not select.select([self.fd], [], [], left)[0]:
                    return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return b""
            self.pending += chunk
        got, _, self.pending = self.pending.partition(b"\n")
        return got


def overdue(message: str, where: str, stage: str, world: int, single: bool) -> str:
    """``message``, with who came to ``stage`` from the sign-in directory ``where`` (none:
    ``message`` as it is): the ranks that never did when every process runs on this machine,
    else the ranks of this machine that did."""
    if not where:
        return message
    try:
        came = {n[len(stage) + 1 :] for n in os.listdir(where) if n.startswith(stage + ".")}
    except OSError:
        return message
    if single:
        absent = [r for r in range(world) if str(r) not in came]
        if absent:
            who = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {absent}"
            message += f": {who} never reached it (of {world} processes, all on this machine)"
        return message
    ranks = sorted(int(r) for r in came if r.isdigit())
    return message + f": of the processes on this machine, ranks {ranks} reached it"


def main(argv: list[str]) -> int:
    """Watch process ``argv[0]`` as the module's docstring says."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is the watched process's; EOF ends us
    pid = int(argv[0])
    lines = Lines(0)
    while True:
        armed = lines.next(None)
        if not armed:
            return 0
        if armed == b"disarm":  # a call interrupted before it armed us
            continue
        seconds, message, where, stage, world, single = json.loads(armed)
        done = lines.next(time.monotonic() + seconds)
        if done is not None:
            if done:
                continue
            return 0
        message = overdue(message, where, stage, world, single)
        sys.stderr.write(
            message + "; MLX cannot interrupt it, so this process is ended (SIGTERM)\n"
        )
        sys.stderr.flush()
        os.kill(pid, signal.SIGTERM)
        if lines.next(time.monotonic() + 5.0) is None:
            os.kill(pid, signal.SIGKILL)
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
