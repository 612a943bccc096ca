"""Run a command in a pseudo-terminal of a given size and read the screen a person would see,
through pyte (a VT100 emulator): what is left at the end, and what was shown on the way."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import time
from dataclasses import dataclass, field

import pyte


@dataclass
class Screen:
    """What the command left on the screen (``lines``, trailing blanks cut), each distinct
    screen shown while it ran (``frames``), its exit code and its raw output."""

    returncode: int
    lines: list[str]
    frames: list[list[str]] = field(default_factory=list)
    raw: bytes = b""

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def run_in_terminal(
    argv: list[str],
    columns: int = 80,
    rows: int = 200,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> Screen:
    """``argv`` on a pseudo-terminal of ``columns`` x ``rows`` (rows enough to keep all the
    output on the screen); killed, with its process group, after ``timeout`` seconds."""
    screen = pyte.Screen(columns, rows)
    stream = pyte.ByteStream(screen)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    base = {k: v for k, v in (env or os.environ).items() if k not in ("COLUMNS", "LINES")}
    base.update(TERM="xterm-256color", FORCE_COLOR="1")
    base.pop("NO_COLOR", None)
    base.pop("CI", None)
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, env=base, start_new_session=True
    )
    os.close(slave)
    raw = bytearray()
    frames: list[list[str]] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                raise TimeoutError(f"{argv} still ran after {timeout:.0f} s:\n{_shown(screen)}")
            ready, _, _ = select.select([master], [], [], min(left, 1.0))
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            raw += chunk
            stream.feed(chunk)
            frame = _lines(screen)
            if not frames or frames[-1] != frame:
                frames.append(frame)
    finally:
        os.close(master)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    return Screen(code, _lines(screen), frames, bytes(raw))


def _lines(screen: pyte.Screen) -> list[str]:
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _shown(screen: pyte.Screen) -> str:
    return "\n".join(_lines(screen))
