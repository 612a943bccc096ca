"""A save that runs out of disk space (a 2 MiB tmpfs) fails with CheckpointError on every
process, saying so, and the checkpoint already there stays whole; the next save that fits
succeeds. Mounting a tmpfs needs root (CI runs as root); elsewhere these tests skip, saying
why."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import unimesh

from .support.launch import run_ranks_timed
from .support.verify import GONE_BOUND, WORKER, N, lines, torch_envs


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        yield disk
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", str(disk)], check=False)


def test_one_process_full_disk(small_disk: Path) -> None:
    first = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    unimesh.save(small_disk / "ck", first)
    before = sorted(p.name for p in (small_disk / "ck").iterdir())
    with pytest.raises(unimesh.CheckpointError, match=r"unchanged: .*No space left on device"):
        unimesh.save(small_disk / "ck", {"w": np.ones((1024, 1024), np.float32)})  # 4 MiB
    assert sorted(p.name for p in (small_disk / "ck").iterdir()) == before  # nothing left over
    assert unimesh.open_checkpoint(small_disk / "ck").read("w").tobytes() == first["w"].tobytes()
    unimesh.save(small_disk / "ck", {"w": np.ones((256, 256), np.float32)})  # fits: saved
    assert unimesh.open_checkpoint(small_disk / "ck").read("w").sum() == 256 * 256


def test_four_torch_processes_full_disk(small_disk: Path, tmp_path: Path) -> None:
    """4 gloo processes each write 1 MiB into 2 MiB: those that hit the end of the disk tell
    the others at the next agreement, and every process raises the same error at once."""
    pytest.importorskip("torch.distributed")
    envs = [dict(env, CHECKPOINT_DIR=str(small_disk / "ck")) for env in torch_envs()]
    codes, outs, ends = run_ranks_timed(
        [sys.executable, WORKER, "torch", "save-full"], envs, 90, tmp_path
    )
    said: dict[int, str] = {}
    for out in outs:
        said.update(lines(out))
    assert sorted(said) == list(range(N)), outs
    for r, text in said.items():
        assert " full after" in text and "checkpoint intact" in text, (r, text)
        assert re.search(r"process \d could not write data-\w+-\d+\.safetensors: No space", text)
        assert codes[r] == 4, (r, codes, text)
    assert max(ends) < GONE_BOUND, ends
    # the previous save's one file (process 0 held the numpy array) and its manifest
    assert len(list((small_disk / "ck").iterdir())) == 2
    assert unimesh.open_checkpoint(small_disk / "ck").read("w").tolist() == [[1.0] * 4] * 4
