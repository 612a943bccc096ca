"""Raw file I/O of a local checkpoint: byte runs read by ``preadv`` straight into the region of
a C-order array (no staging buffer), whole files written durably, a directory's entries made
durable, and host buffers aligned for a runtime to adopt. Standard library and numpy only."""

from __future__ import annotations

import functools
import math
import mmap
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError

__all__ = [
    "READ_THREADS",
    "aligned_empty",
    "fsync_dir",
    "read_full",
    "scatter_read",
    "stretches",
    "write_file",
]

_IOV_MAX = 1024  # iovecs per preadv (Linux's UIO_MAXIOV)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a new file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, parts: Iterable[Any]) -> None:
    """``path`` written whole from ``parts`` (bytes-like, written one at a time as they come)
    and fsync'd."""
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
    runs: np.ndarray,
    out: np.ndarray,
    where: tuple[slice, ...],
    what: str,
    tensor: str = "",
) -> None:
    """Read the file's byte ``runs`` (a ``(k, 2)`` int64 table of file offset and length, in
    the row-major order of the region) straight into the region
    ``where`` of the C-order array ``out``: its contiguous stretches become the iovecs of
    ``preadv`` calls, so nothing is staged in between. Several reads are in flight where
    there is enough to read (:data:`READ_THREADS` threads, each taking its share of the calls
    in file order; ``preadv`` releases the GIL). ``what`` names the file, ``tensor`` the
    tensor, in the error of a truncated file."""
    if len(runs) >= _MIN_STRIDED and _strided_copy(fd, runs, out, where):
        return
    calls = list(_calls(runs, out, where))
    total = sum(n for _, _, n in calls)
    threads = min(READ_THREADS, len(calls), total // _MIN_SHARE)

    def read_share(share: list[tuple[int, list[memoryview], int]]) -> None:
        for offset, iov, size in share:
            read_full(fd, iov, offset, what, tensor, size)

    if threads <= 1:
        read_share(calls)
        return
    # contiguous shares of about equal bytes: each thread reads along the file
    shares: list[list[tuple[int, list[memoryview], int]]] = [[] for _ in range(threads)]
    done, per = 0, total / threads
    for call in calls:
        shares[min(threads - 1, int(done // per))].append(call)
        done += call[2]

    pool = _pool(os.getpid())
    futures = [pool.submit(read_share, share) for share in shares if share]
    wait(futures)  # every read has ended (none writes into ``out`` once this returns) ...
    for future in futures:
        future.result()  # ... then the first error (a truncated file) is raised


#: threads a load keeps reading at once (``UNIMESH_READ_THREADS``; 1: one read at a time)
READ_THREADS = (
    min(64, max(1, int(_given)))
    if (_given := os.environ.get("UNIMESH_READ_THREADS", "")).isdigit()
    else 4
)
_MIN_SHARE = 4 << 20  # bytes a thread is given at least: below it, one thread reads
_MAX_CALL = 16 << 20  # bytes one preadv asks for at most (a long run is split)


_MIN_STRIDED = 16  # runs at least: a column block's rows are copied out of a mapping
_MAX_STRIDED_RUN = 256 << 10  # bytes per run at most (longer runs: preadv is as fast)
_MAP_SPAN = 16 << 20  # bytes of the file mapped at once


def _strided_copy(fd: int, table: np.ndarray, out: np.ndarray, where: tuple[slice, ...]) -> bool:
    """Many short runs at one stride in the file (a column block of a row-major box) going to
    stretches at one stride in ``out`` (its rows): copied by numpy out of a read-only mapping
    of the file, 16 MiB of it at a time, instead of one ``preadv`` per run. False where the
    runs are not so, reach past the file's end (``preadv`` then says where it is truncated),
    or the file cannot be mapped: the caller then reads every run with ``preadv``."""
    length = int(table[0, 1])
    if length > _MAX_STRIDED_RUN:
        return False
    if (table[:, 1] != length).any():
        return False
    steps = np.diff(table[:, 0])
    stride = int(steps[0])
    if stride < length or (steps != stride).any():
        return False
    found = stretch_table(out, where)
    if (found[:, 1] % length).any():
        return False
    # each run's offset in ``out``: the stretches cut into runs' lengths
    counts = found[:, 1] // length
    starts = np.repeat(found[:, 0], counts) + length * (
        np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    if starts.size != len(table):
        return False
    dsteps = np.diff(starts)
    dstride = int(dsteps[0])
    if (dsteps != dstride).any() or table[-1, 0] + length > os.fstat(fd).st_size:
        return False
    mem = out.reshape(-1).view(np.uint8)
    rows = max(1, _MAP_SPAN // stride)
    for first in range(0, len(table), rows):
        n = min(rows, len(table) - first)
        start = int(table[first, 0])
        base = start - start % mmap.ALLOCATIONGRANULARITY
        span = start - base + (n - 1) * stride + length
        try:
            mapped = mmap.mmap(fd, span, offset=base, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # a file system that maps no files: preadv reads all
            return False
        with mapped:
            src = np.frombuffer(mapped, np.uint8, span - (start - base), start - base)
            try:
                np.copyto(
                    np.lib.stride_tricks.as_strided(
                        mem[int(starts[first]) :], (n, length), (dstride, 1), writeable=True
                    ),
                    np.lib.stride_tricks.as_strided(src, (n, length), (stride, 1), writeable=False),
                )
            finally:
                del src  # the mapping closes only once no array points into it
    return True


@functools.cache
def _pool(pid: int) -> ThreadPoolExecutor:
    """The read threads of this process (by pid: a forked child starts its own)."""
    return ThreadPoolExecutor(READ_THREADS, thread_name_prefix="unimesh-read")


def _calls(
    runs: np.ndarray, out: np.ndarray, where: tuple[slice, ...]
) -> Iterator[tuple[int, list[memoryview], int]]:
    """The ``preadv`` calls that read ``runs`` into ``out[where]``: (file offset, iovecs,
    bytes), each a contiguous stretch of the file of at most :data:`_MAX_CALL` bytes and
    ``_IOV_MAX`` iovecs, in file-run order."""
    mem = out.reshape(-1).view(np.uint8).data
    found = iter(stretches(out, where))
    at, left = next(found)
    for offset, length in runs.tolist():
        iov: list[memoryview] = []
        size = 0
        while length:
            if not left:
                at, left = next(found)
            take = min(length, left, _MAX_CALL - size)
            iov.append(mem[at : at + take])
            at, left, length, size = at + take, left - take, length - take, size + take
            if len(iov) == _IOV_MAX or size == _MAX_CALL or not length:
                yield offset, iov, size
                offset, iov, size = offset + size, [], 0


def stretches(out: np.ndarray, where: tuple[slice, ...]) -> Iterator[tuple[int, int]]:
    """(byte offset, length) of each contiguous stretch of ``out[where]`` (``out`` C-order), in
    row-major order: the last partial dim and the whole dims after it make one stretch."""
    return iter([(a, n) for a, n in stretch_table(out, where).tolist()])


def stretch_table(out: np.ndarray, where: tuple[slice, ...]) -> np.ndarray:
    """:func:`stretches` as a ``(k, 2)`` int64 table."""
    shape, strides = out.shape, out.strides
    if not shape:
        return np.array([[0, out.itemsize]], dtype=np.int64)
    d = len(shape) - 1
    while d > 0 and where[d].start == 0 and where[d].stop == shape[d]:
        d -= 1
    length = (where[d].stop - where[d].start) * strides[d]
    base = sum(w.start * st for w, st in zip(where, strides))
    if d == 0:
        return np.array([[base, length]], dtype=np.int64)
    axes = np.ix_(*(np.arange(w.stop - w.start) * st for w, st in zip(where[:d], strides[:d])))
    firsts = np.asarray(base + sum(axes), dtype=np.int64).reshape(-1)
    return np.stack([firsts, np.full_like(firsts, length)], axis=1)


def read_full(
    fd: int,
    iov: list[memoryview],
    offset: int,
    what: str,
    tensor: str = "",
    want: int | None = None,
) -> None:
    """``preadv`` until every buffer of ``iov`` is full (a call may return fewer bytes than
    asked, e.g. past 2 GiB); the file ending first is a truncated checkpoint. ``want``: the
    buffers' total, where the caller knows it."""
    if want is None:
        want = sum(len(m) for m in iov)
    end = offset + want
    got = os.preadv(fd, iov, offset)
    if got == want:  # the common case: one call fills them all
        return
    while True:
        if got <= 0:
            needs = f"tensor {tensor!r} needs" if tensor else "needs"
            raise CheckpointError(f"{what} is truncated ({needs} bytes {end - want}..{end})")
        offset += got
        while iov and got >= len(iov[0]):
            got -= len(iov[0])
            iov = iov[1:]
        if got:
            iov[0] = iov[0][got:]
        if not iov:
            return
        got = os.preadv(fd, iov, offset)
