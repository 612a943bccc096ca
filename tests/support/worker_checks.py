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


def leave_gloo() -> None:
    """End a gloo process group the way unimesh's torch runtime does at exit: two barriers,
    then ``destroy_process_group``. gloo's worker thread frees the last collective's work (and
    its tensors, which takes the GIL) just after the next barrier completes; if the interpreter
    is finalizing by then the process aborts ("terminate called without an active exception",
    rank 0 of one CI run in about twenty). The second barrier starts with nothing in progress,
    so what is freed after it holds no tensors."""
    import time

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.001)
        dist.barrier()
        dist.destroy_process_group()
