"""Raw file I/O of a local checkpoint: byte runs read by ``preadv`` straight into the region of
a C-order array (no staging buffer), whole files written durably, a directory's entries made
durable, and host buffers aligned for a runtime to adopt. Standard library and numpy only."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError

__all__ = ["aligned_empty", "fsync_dir", "read_full", "scatter_read", "stretches", "write_file"]

_IOV_MAX = 1024  # iovecs per preadv (Linux's UIO_MAXIOV)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a new file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, parts: list[Any]) -> None:
    """``path`` written whole from ``parts`` (bytes-like) and fsync'd."""
    with open(path, "wb") as f:
        f.writelines(parts)
        f.flush()
        os.fsync(f.fileno())


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """``np.empty`` whose data starts on a 64-byte boundary: a CPU runtime may then adopt a
    loaded block as its device buffer instead of copying it (XLA's CPU client does)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + 64, np.uint8)
    at = -raw.ctypes.data % 64
    return raw[at : at + nbytes].view(dtype).reshape(shape)


def scatter_read(
    fd: int,
    runs: list[tuple[int, int]],
    out: np.ndarray,
    where: tuple[slice, ...],
    what: str,
    tensor: str = "",
) -> None:
    """Read the file's byte ``runs`` (row-major order of the region) straight into the region
    ``where`` of the C-order array ``out``: its contiguous stretches become the iovecs of
    ``preadv`` calls, so nothing is staged in between. ``what`` names the file, ``tensor`` the
    tensor, in the error of a truncated file."""
    mem = out.reshape(-1).view(np.uint8).data
    found = iter(stretches(out, where))
    at, left = next(found)
    for offset, length in runs:
        if not left:
            at, left = next(found)
        if length <= left:  # the common case: the run lands in one stretch, one call
            view = mem[at : at + length]
            if os.preadv(fd, [view], offset) != length:
                read_full(fd, [view], offset, what, tensor)  # the rest, or truncated
            at, left = at + length, left - length
            continue
        iov: list[memoryview] = []
        size = 0
        while length:
            if not left:
                at, left = next(found)
            take = min(length, left)
            iov.append(mem[at : at + take])
            at, left, length, size = at + take, left - take, length - take, size + take
            if len(iov) == _IOV_MAX or not length:
                read_full(fd, iov, offset, what, tensor)
                offset, iov, size = offset + size, [], 0


def stretches(out: np.ndarray, where: tuple[slice, ...]) -> Iterator[tuple[int, int]]:
    """(byte offset, length) of each contiguous stretch of ``out[where]`` (``out`` C-order), in
    row-major order: the last partial dim and the whole dims after it make one stretch."""
    shape, strides = out.shape, out.strides
    if not shape:
        yield 0, out.itemsize
        return
    d = len(shape) - 1
    while d > 0 and where[d].start == 0 and where[d].stop == shape[d]:
        d -= 1
    length = (where[d].stop - where[d].start) * strides[d]
    base = sum(w.start * st for w, st in zip(where, strides))
    if d == 0:
        yield base, length
        return
    axes = np.ix_(*(np.arange(w.stop - w.start) * st for w, st in zip(where[:d], strides[:d])))
    for first in (base + sum(axes)).reshape(-1).tolist():
        yield first, length


def read_full(fd: int, iov: list[memoryview], offset: int, what: str, tensor: str = "") -> None:
    """``preadv`` until every buffer of ``iov`` is full (a call may return fewer bytes than
    asked, e.g. past 2 GiB); the file ending first is a truncated checkpoint."""
    want = sum(len(m) for m in iov)
    end = offset + want
    while iov:
        got = os.preadv(fd, iov, offset)
        if got <= 0:
            needs = f"tensor {tensor!r} needs" if tensor else "needs"
            raise CheckpointError(f"{what} is truncated ({needs} bytes {end - want}..{end})")
        offset += got
        while iov and got >= len(iov[0]):
            got -= len(iov[0])
            iov = iov[1:]
        if got:
            iov[0] = iov[0][got:]
