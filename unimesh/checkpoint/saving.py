"""Saving: every process writes the blocks it holds (each distinct block once) into one data
file of its own, then process 0 commits the manifest. The protocol between processes (four
agreements through the backend's ``exchange``) is written once, over the place's
:class:`~.storage.Storage`; a backend only hands over its blocks (``local_shards``)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
from typing import Any

import numpy as np

from ..errors import CheckpointError, UnimeshError
from ..layout import Layout
from ..messages import short
from ..spec import PartitionSpec
from .format import (
    MANIFEST,
    Box,
    Tensor,
    check_file_name,
    checksum,
    dtype_name,
    manifest_bytes,
)
from .safetensors_file import write_safetensors_file
from .storage import open_storage
from .tree import flatten, model_state

__all__ = ["SaveHandle", "SaveJob", "async_save", "save"]

_TIMEOUT = 300.0


def _blocks(
    name: str, leaf: Any, layout: Layout | None, be: Any, rank: int
) -> tuple[list[tuple[tuple[int, ...], np.ndarray]], tuple[int, ...], str]:
    """(the blocks this process writes, as (offset, array)), the global shape and dtype."""
    from ..convert import local_shards

    if layout is None:
        host = np.asarray(leaf)
        whole = [((0,) * host.ndim, host)] if rank == 0 else []
        return whole, tuple(host.shape), dtype_name(host.dtype)
    shape = tuple(int(n) for n in leaf.shape)
    held = local_shards(leaf, backend=be)
    slices = layout.device_slices(shape)
    # each block this process holds, once (two of its devices may hold the same one); which
    # process writes a block several processes hold is decided across them (:func:`writers`)
    out = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    dtype: str | None = None
    for device, block in sorted(held.items()):
        key = tuple((s.start, s.stop) for s in slices[device])
        if key in seen:
            continue
        seen.add(key)
        host = np.asarray(block)
        dtype = dtype_name(host.dtype)
        if host.size == 0:
            continue
        out.append((tuple(a for a, _ in key), host))
    if dtype is None:
        dtype = dtype_name(getattr(leaf, "dtype", "float32"))
    return out, shape, dtype


def _spec_json(spec: PartitionSpec) -> list[Any]:
    return [e if e is None or isinstance(e, str) else list(e) for e in spec]


def _error_text(exc: BaseException) -> str:
    """An error as a person reads it (an OSError with its errno's name:
    ``No space left on device (ENOSPC)``)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        import errno

        name = errno.errorcode.get(exc.errno or 0, "")
        return f"{exc.strerror or exc}{f' ({name})' if name else ''}"
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc)


def writers(held: list[list[tuple[str, int]]]) -> dict[str, int]:
    """Which process writes each block, from every process's ``(block key, bytes)`` list (the
    same lists on every process, so every process decides the same): a block one process
    holds is its own; a replicated block goes to the holder with the fewest bytes to write so
    far (the largest blocks first, ties to the lowest process), so that no process writes a
    replica's bytes while another idles (DCP's planner balances its replicas the same way)."""
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for r, blocks in enumerate(held):
        for key, nbytes in blocks:
            holders.setdefault(key, []).append(r)
            size[key] = nbytes
    load = [0] * len(held)
    writer: dict[str, int] = {}
    for key in sorted(holders, key=lambda k: (len(holders[k]) > 1, -size[k], k)):
        r = min(holders[key], key=lambda p: (load[p], p))
        writer[key] = r
        load[r] += size[key]
    return writer


class SaveJob:
    """One save: this process's blocks copied to host memory at construction (so that the
    caller may change its arrays), written by :meth:`write`."""

    def __init__(
        self, path: Any, tree: Any, backend: Any, timeout: float, copy: bool = True
    ) -> None:
        from ..convert import layout_of
        from ..registry import get_backend

        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout < 1e7  # NaN fails too; timedelta cannot hold much more
        ):
            raise CheckpointError(
                f"timeout must be a number of seconds, > 0 and below 1e7; got {short(timeout)}"
            )
        self.timeout = float(timeout)
        names, leaves, _ = flatten(tree)
        found = [None if isinstance(leaf, np.ndarray) else layout_of(leaf) for leaf in leaves]
        be = (
            get_backend(backend)
            if backend is not None
            else next((f[0] for f in found if f is not None), None)
        )
        if be is not None:
            be.require("checkpoint", "unimesh.save takes its arrays' blocks with local_shards")
        self.storage = open_storage(path)
        self.root = self.storage.where
        self.be = be
        try:
            self.rank = 0 if be is None else int(be.initialize(self.timeout)[0])
        except UnimeshError as exc:  # a peer that never came: the runtime did not start
            raise CheckpointError(f"saving {path} failed, nothing was written: {exc}") from exc
        self.tensors: dict[str, Tensor] = {}
        self.blocks: list[tuple[str, tuple[int, ...], str, np.ndarray]] = []
        for name, leaf, got in zip(names, leaves, found):
            layout = None if got is None else got[1]
            if layout is not None and layout.spec.partial:
                raise CheckpointError(
                    f"tensor {name!r} is a pending reduction ({layout.spec!r}): reduce it first "
                    "(psum inside shard_map, or redistribute to Replicate); a checkpoint holds "
                    "values"
                )
            blocks, shape, dtype = _blocks(name, leaf, layout, be, self.rank)
            saved = None if layout is None else {
                "mesh": layout.mesh.to_dict(), "spec": _spec_json(layout.spec)
            }  # fmt: skip
            self.tensors[name] = Tensor(name, shape, dtype, saved, [])
            for offset, block in blocks:
                self.blocks.append((name, offset, dtype, block))
        # who writes what first (the processes' first exchange), then a C-order host array of
        # just this process's blocks; async: a copy, as the caller may change its arrays
        self.token = self._decide()
        self.blocks = [
            (name, offset, dtype, np.array(block, order="C", copy=True if copy else None))
            for name, offset, dtype, block in self.blocks
        ]  # (a 0-d block stays 0-d)

    def exchange(self, payload: bytes) -> list[bytes]:
        if self.be is None:
            return [payload]
        try:
            return list(self.be.exchange(payload, self.timeout))
        except UnimeshError as exc:
            raise CheckpointError(
                f"saving {self.root} failed on process {self.rank}, the checkpoint there is "
                f"unchanged: {exc}"
            ) from exc

    def _decide(self) -> str:
        """Process 0's token for this save's file names (returned), and which process writes
        each block (:func:`writers`): this process keeps only its own. An array on a sub-mesh
        (FSDP's dp mesh inside dp x tp) is held whole by several such meshes, which do not
        know of each other's copies."""
        mine = [[name, list(offset), list(block.shape)] for name, offset, _, block in self.blocks]
        hello = {
            "token": secrets.token_hex(6) if self.rank == 0 else "",
            "blocks": mine,
            "bytes": [block.nbytes for *_, block in self.blocks],
        }
        told = [json.loads(p) for p in self.exchange(json.dumps(hello).encode())]
        writer = writers([list(zip(map(json.dumps, t["blocks"]), t["bytes"])) for t in told])
        self.blocks = [
            b for b, key in zip(self.blocks, mine) if writer[json.dumps(key)] == self.rank
        ]
        token: str = told[0]["token"]
        return token

    def write(self) -> None:
        """Every process's file, then the manifest (process 0), then every process returns.
        A process that cannot write (a full disk, no permission) tells the others at the next
        agreement, so that every process raises the same CheckpointError at once and the
        checkpoint already at the path stays as it was."""
        store, rank = self.storage, self.rank
        token = self.token
        problem = ""
        if rank == 0:
            try:
                store.mkdir()
            except (OSError, CheckpointError) as exc:
                problem = f"process 0 could not create the directory: {_error_text(exc)}"
        self._agree(problem)  # the directory exists before anyone writes into it
        file = check_file_name(f"data-{token}-{rank:05d}.safetensors", "save")
        entries = [
            (f"{name}@{','.join(map(str, offset))}", dtype, block.shape, block.nbytes)
            for name, offset, dtype, block in self.blocks
        ]
        views = [b.reshape(-1).view(np.uint8).data for *_, b in self.blocks]
        sums: list[tuple[str, int]] = []
        at = 0  # the data's offset in the file: after its header
        failed: list[str] = []

        def sum_all() -> None:
            try:
                sums.extend(map(checksum, views))
            except Exception as exc:  # noqa: BLE001 - told to every process below
                failed.append(_error_text(exc))

        # the checksums in a thread while the file is written (the writes and xxhash release
        # the GIL): their time hides behind the writes' instead of following it
        summing = threading.Thread(target=sum_all)
        summing.start()
        try:
            if self.blocks:  # a process with no block to write writes no file
                at = write_safetensors_file(store, file, entries, views)
        except Exception as exc:  # noqa: BLE001 - told to every process, then raised
            problem = f"process {rank} could not write {file}: {_error_text(exc)}"
            self._unlink(file)
        finally:
            summing.join()
        if len(sums) != len(views) and not problem:
            problem = f"process {rank} could not checksum the blocks of {file}: {failed[0]}"
            self._unlink(file)
        listing: dict[str, list[list[Any]]] = {}
        for (name, offset, _, block), (kind, value) in zip(self.blocks, sums):
            listing.setdefault(name, []).append(
                [list(offset), list(block.shape), at, at + block.nbytes, [kind, value]]
            )
            at += block.nbytes
        payload = {"file": file, "boxes": listing, "error": problem}
        parts = [json.loads(p) for p in self.exchange(json.dumps(payload).encode())]
        errors = [p["error"] for p in parts if p["error"]]
        if errors:
            self._unlink(file)
            self._fail(errors)
        if rank == 0:
            try:
                self._commit(token, parts)
            except Exception as exc:  # noqa: BLE001 - told to every process, then raised
                problem = f"process 0 could not write the manifest: {_error_text(exc)}"
                for part in parts:  # this save's files: the previous checkpoint stays
                    self._unlink(part["file"])
        self._agree(problem)  # every process returns once the checkpoint is committed

    def _unlink(self, name: str) -> None:
        """Remove this save's file ``name`` if it is there (a failed save tidies up)."""
        with contextlib.suppress(Exception):
            self.storage.remove(name)

    def _agree(self, problem: str) -> None:
        """Exchange each process's problem (empty: none); raise if any process has one."""
        errors = [p.decode() for p in self.exchange(problem.encode()) if p]
        if errors:
            self._fail(errors)

    def _fail(self, errors: list[str]) -> None:
        raise CheckpointError(
            f"saving {self.root} failed, the checkpoint there is unchanged: {'; '.join(errors)}"
        )

    def _commit(self, token: str, parts: list[dict[str, Any]]) -> None:
        """The manifest of every process's boxes, committed at once; then the files of
        earlier saves (finished or killed) are removed."""
        for part in parts:
            for name, boxes in part["boxes"].items():
                self.tensors[name].boxes.extend(
                    Box(tuple(o), tuple(s), part["file"], a, b, (c[0], c[1]))
                    for o, s, a, b, c in boxes
                )
        text = manifest_bytes(self.tensors)
        keep = {p["file"] for p in parts} | {MANIFEST}
        self.storage.commit(MANIFEST, [text], token)
        # committed: what follows only tidies up, and a failure there changes nothing
        with contextlib.suppress(Exception):
            for name in self.storage.names():
                if name not in keep and name.startswith(("data-", f".{MANIFEST}.")):
                    self.storage.remove(name)


class SaveHandle:
    """An :func:`async_save` in flight: :meth:`wait` until it is committed (raising what it
    raised), :meth:`done` to ask."""

    def __init__(self, job: SaveJob) -> None:
        import threading

        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(job,), name="unimesh-async-save", daemon=False
        )
        self._thread.start()

    def _run(self, job: SaveJob) -> None:
        try:
            job.write()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed; re-raise its error. ``timeout`` in seconds."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CheckpointError(f"the save is still writing after {timeout} s")
        if self._error is not None:
            raise self._error


_PENDING: list[SaveHandle] = []


def _after_pending() -> None:
    """A save starts once the previous asynchronous one has finished (in call order); a
    failure stays with its handle, for its ``wait()`` to raise."""
    while _PENDING:
        _PENDING.pop(0)._thread.join()


def save(
    path: str | os.PathLike[str], tree: Any, *, backend: Any = None, timeout: float = _TIMEOUT
) -> None:
    """Save ``tree`` (a pytree of the backend's distributed arrays or numpy arrays, or a
    framework's model: a torch ``nn.Module`` by its state_dict names, a Keras model by its
    variables' paths, an ``mlx.nn.Module`` by its parameter paths) to the directory
    ``path``. Every process writes only the blocks it holds, each distinct block once (a
    replicated block by one of the processes holding it, spread so that each writes about as
    many bytes as the others); nothing is gathered.
    The manifest, written last by process 0 once every process's file is complete, is the
    commit point: a save into an existing checkpoint replaces it only then, and the previous
    one stays loadable until that moment. Call it on every process; a process that is gone or
    does not come within ``timeout`` seconds makes it fail with :class:`CheckpointError` on
    every other one, naming it where the backend can."""
    _after_pending()
    found = model_state(tree, backend)
    if found is not None:
        backend, tree = found
    SaveJob(path, tree, backend, timeout, copy=False).write()  # written before it returns


def async_save(
    path: str | os.PathLike[str], tree: Any, *, backend: Any = None, timeout: float = _TIMEOUT
) -> SaveHandle:
    """:func:`save`, returning once this process's blocks are copied to host memory; the
    writing goes on in a background thread. A later save (async or not) waits for this one.
    Returns a handle: ``.wait()`` (re-raises a failure), ``.done()``."""
    _after_pending()
    found = model_state(tree, backend)
    if found is not None:
        backend, tree = found
    handle = SaveHandle(SaveJob(path, tree, backend, timeout))
    _PENDING.append(handle)
    return handle
