"""The tests of a small pytest session that tests/test_leftovers.py runs in a child process
(``python -m pytest tests/support/leftover_cases.py::CASE``, the project's conftest and its
end-of-run check included): a launch that leaves a process or its folder behind, and a clean
launch while another program makes folders in the temporary folder. Not collected by the
suite itself (the file name is not ``test_*.py``); skipped when run without the parent test."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .launch import LAUNCHES, run_bounded

#: the parent test's folder (for its signals and these tests' scripts)
CASE_DIR = "UNIMESH_LEFTOVER_CASE_DIR"

#: a stand-in for torchrun (its file is named ``torchrun``, so the suite launches it as one):
#: like torchrun it leaves a ``torchelastic_*`` folder in its TMPDIR, and it starts a worker
#: that it does not wait for (``clean``: none)
LAUNCHER = """\
import os, subprocess, sys, tempfile
os.mkdir(os.path.join(tempfile.mkdtemp(prefix="torchelastic_"), "attempt_0"))
if sys.argv[1] != "clean":
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
    subprocess.Popen([sys.executable, worker, sys.argv[1]], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
"""

#: the worker left behind, in a session of its own, orphaned when the launcher exits (so no
#: longer in the test process's tree): ``sleep`` runs on; ``straggle`` waits for its launch's
#: TMPDIR to be removed, then writes into it again and exits
WORKER = """\
import os, sys, time
folder = os.environ["TMPDIR"]  # its launch's (tempfile would fall back once it is gone)
end = time.monotonic() + 30
if sys.argv[1] == "straggle":
    while os.path.isdir(folder) and time.monotonic() < end:
        time.sleep(0.02)
    os.makedirs(os.path.join(folder, "torchelastic_late"))
    with open(os.path.join(folder, "torchelastic_late", "pid"), "w") as f:
        f.write(str(os.getpid()))
else:
    time.sleep(60)
"""


def _launcher() -> Path:
    if CASE_DIR not in os.environ:
        pytest.skip("run by tests/test_leftovers.py")
    scripts = Path(os.environ[CASE_DIR]) / "bin"
    scripts.mkdir(exist_ok=True)
    (scripts / "worker.py").write_text(WORKER)
    launcher = scripts / "torchrun"
    launcher.write_text(f"#!{sys.executable}\n" + LAUNCHER)
    launcher.chmod(0o755)
    return launcher


def _until(done: Callable[[], object], what: str, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < end, f"no {what} within {seconds} s"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_launch_leaves_a_process() -> None:
    rc, out = run_bounded([str(_launcher()), "sleep"], dict(os.environ), 30)
    assert rc == 0, out


def test_launch_leaves_its_folder() -> None:
    rc, out = run_bounded([str(_launcher()), "straggle"], dict(os.environ), 30)
    assert rc == 0, out
    scratch = LAUNCHES[-1].scratch
    assert scratch is not None
    written = scratch / "torchelastic_late" / "pid"
    _until(lambda: written.exists() and written.read_text(), "straggler's write")
    pid = int(written.read_text())
    _until(lambda: gone(pid), f"end of the straggler (pid {pid})")  # only its folder is left


def test_other_programs_make_folders() -> None:
    """The parent test makes ``torchelastic_*``, ``ompi.*`` and ``unimesh-launch-*`` folders
    in this run's temporary folder while it runs (another user's jobs would); a clean launch
    runs meanwhile."""
    launcher = _launcher()
    signals = Path(os.environ[CASE_DIR])
    (signals / "started").touch()
    _until((signals / "made").exists, "folders from the other program")
    rc, out = run_bounded([str(launcher), "clean"], dict(os.environ), 30)
    assert rc == 0, out
