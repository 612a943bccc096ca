"""What every multi-process worker script prints: one line per check, then ``TAG OK n``.

The workers run as scripts (their folder is on sys.path), so they import this module directly.
"""

from __future__ import annotations

import sys


class Checks:
    """``check(ok, what)`` prints ``<who>: ok|FAIL <what>`` in one write and exits 1 on a
    failure; ``done(tag)`` prints ``<tag> OK <number of checks>``."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.count = 0

    def __call__(self, ok: bool, what: str) -> None:
        sys.stdout.write(f"{self.who}: {'ok  ' if ok else 'FAIL'} {what}\n")  # one write a line
        sys.stdout.flush()
        if not ok:
            sys.exit(1)
        self.count += 1

    def done(self, tag: str) -> None:
        sys.stdout.write(f"{tag} OK {self.count}\n")
        sys.stdout.flush()
