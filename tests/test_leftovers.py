"""The end-of-run check (tests/conftest.py, ``pytest_sessionfinish``; issue 70): a run fails for
what it leaves behind itself, a launch's process or folder, and never for what other programs
on the machine make meanwhile. Each case is a small pytest session in a child process, the
project's conftest and check included, with a temporary folder of its own (TMPDIR), running
one test of tests/support/leftover_cases.py."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from .support.launch import run_bounded
from .support.leftover_cases import CASE_DIR, gone

pytestmark = pytest.mark.quick  # framework-free and fast: in the quick tier

ROOT = Path(__file__).resolve().parents[1]
CASES = "tests/support/leftover_cases.py"
#: what another user's torchrun and mpirun jobs (and another run of this suite) leave in the
#: shared temporary folder while a run goes on
FOREIGN = ["ompi.host.0", "torchelastic_x", "torchelastic_y", "unimesh-launch-other"]
#: one made before the run starts (a temporary folder is seldom empty)
EARLIER = "torchelastic_earlier"


def session(tmp_path: Path, case: str) -> tuple[int, str, Path]:
    """Run the one test ``case`` in a pytest session of its own: (exit code, output, its
    temporary folder, which holds another program's folder ``EARLIER`` from the start)."""
    tmp = tmp_path / "tmp"
    (tmp / EARLIER).mkdir(parents=True)
    drop = ("UNIMESH_TEST_CHILD", "PYTEST_ADDOPTS")  # a session of its own, checked at its end
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(TMPDIR=str(tmp), **{CASE_DIR: str(tmp_path)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header",
           "-o", "addopts=", f"--basetemp={tmp_path / 'base'}", f"{CASES}::{case}"]  # fmt: skip
    rc, out = run_bounded(cmd, env, 120, ROOT)
    return rc, out, tmp


def test_a_launch_that_leaves_a_process_fails_the_run(tmp_path: Path) -> None:
    """The launch's worker outlives it in a session of its own (so no longer under the test
    process): the test passes, the run fails naming the process and its launch, and ends it."""
    rc, out, tmp = session(tmp_path, "test_launch_leaves_a_process")
    assert rc == 1 and "1 passed" in out, out
    assert "the run left these behind" in out, out
    found = re.search(
        r"still running: pid (\d+) \(launch `\S+/torchrun sleep` in "
        r"tests/support/leftover_cases\.py::test_launch_leaves_a_process\): \S+ \S+/worker\.py "
        r"sleep",
        out,
    )
    assert found, out
    assert "not removed" not in out, out
    pid = int(found[1])
    end = time.monotonic() + 10
    while not gone(pid):  # ended by the check (SIGKILL: at once)
        assert time.monotonic() < end, f"the worker (pid {pid}) still runs"
        time.sleep(0.05)
    assert [p.name for p in tmp.iterdir()] == [EARLIER]  # the launch's folder removed after it


def test_a_launch_that_leaves_its_folder_fails_the_run(tmp_path: Path) -> None:
    """A straggler writes into its launch's TMPDIR after the launch ended and its folder was
    removed, then exits: the run fails naming the folder, what it holds and the launch, and
    removes it."""
    rc, out, tmp = session(tmp_path, "test_launch_leaves_its_folder")
    assert rc == 1 and "1 passed" in out, out
    found = re.search(
        r"not removed: (\S+), the TMPDIR of launch `\S+/torchrun straggle` in "
        r"tests/support/leftover_cases\.py::test_launch_leaves_its_folder, holding "
        r"torchelastic_late\n",
        out,
    )
    assert found, out
    assert "still running" not in out, out
    folder = Path(found[1])
    assert folder.parent == tmp and folder.name.startswith("unimesh-launch-"), folder
    assert not folder.exists()  # removed by the check
    assert [p.name for p in tmp.iterdir()] == [EARLIER]


def test_folders_other_programs_make_do_not_fail_the_run(tmp_path: Path) -> None:
    """While the session runs (a clean launch, which leaves torchrun's ``torchelastic_*``
    folder in its own TMPDIR), this test, another program to it, makes the folders other jobs
    on the machine make in its temporary folder: the run passes and leaves them alone."""
    stop = threading.Event()

    def other_program() -> None:
        while not (tmp_path / "started").exists():
            if stop.wait(0.02):
                return
        for name in FOREIGN:
            (tmp_path / "tmp" / name).mkdir()
            (tmp_path / "tmp" / name / "log").write_text("another job's")
        (tmp_path / "made").touch()

    thread = threading.Thread(target=other_program, daemon=True)
    thread.start()
    try:
        rc, out, tmp = session(tmp_path, "test_other_programs_make_folders")
    finally:
        stop.set()
        thread.join()
    assert rc == 0 and "1 passed" in out, out
    assert "left these behind" not in out, out
    # the launch's own folder removed; the other program's folders untouched
    assert sorted(p.name for p in tmp.iterdir()) == sorted([EARLIER, *FOREIGN])
    assert all((tmp / name / "log").read_text() == "another job's" for name in FOREIGN)
