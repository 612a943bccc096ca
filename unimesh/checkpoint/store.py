"""Saving and loading checkpoints: every process writes the blocks it holds (each distinct
block once) and reads only the byte runs of the blocks it needs. The file I/O and the
agreement between processes (through the backend's ``exchange``) live here; a backend only
hands over its blocks (``local_shards``) and takes them back (``from_local``)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import secrets
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError, UnimeshError
from ..layout import Layout
from ..mesh import Mesh
from ..messages import close_match, short
from ..spec import PartitionSpec
from .format import (
    FORMAT,
    MANIFEST,
    MAX_HEADER,
    VERSION,
    Box,
    Tensor,
    check_file_name,
    dtype_name,
    dtype_text,
    numpy_dtype,
    parse_manifest,
    read_header,
    safetensors_header,
)
from .plan import pieces
from .storage import Remote, Url, is_url

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Checkpoint", "SaveHandle", "async_save", "load", "open_checkpoint", "save"]

_TIMEOUT = 300.0


# -- the tree --------------------------------------------------------------------------------------
def _is_leaf(x: object) -> bool:
    return isinstance(x, Layout) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Names (tree paths joined with ``.``, as torch's state_dict and Keras name them),
    leaves and the treedef of ``tree``."""
    import optree

    leaves, treedef = optree.tree_flatten(tree, is_leaf=_is_leaf)
    names = [".".join(str(p) for p in path) for path in optree.treespec_paths(treedef)]
    if not names:
        raise CheckpointError(f"the tree {short(tree)} has no arrays to save or load")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise CheckpointError(f"two leaves of the tree are both named {name!r}")
        seen.add(name)
    return names, leaves, treedef


def layout_of(leaf: Any) -> Layout | None:
    """The layout of a backend's distributed array (None for a host array): an ``MLXArray``'s
    ``layout``, a DTensor's placements, a ``jax.Array``'s (or Keras variable's) sharding."""
    from ..convert import from_native

    found = getattr(leaf, "layout", None)
    if isinstance(found, Layout):
        return found
    if isinstance(leaf, np.ndarray):
        return None
    for obj in (  # a sharding first: a refused array's message would print the array
        getattr(leaf, "sharding", None),
        getattr(getattr(leaf, "value", None), "sharding", None),
        leaf,
    ):
        if obj is None:
            continue
        try:
            got = from_native(obj)
        except UnimeshError:
            continue
        if isinstance(got, Layout):
            return got
    return None


def model_state(obj: Any, backend: Any) -> tuple[Any, dict[str, Any]] | None:
    """(backend, named arrays) when ``obj`` is a framework's model object (a torch
    ``nn.Module``, a Keras model, an ``mlx.nn.Module``), through the backend's
    ``model_state`` hook; None for anything else (a pytree)."""
    from ..registry import get_backend, owner_of

    # (an mlx.nn.Module is a dict: the exact builtin containers are what is passed over)
    if type(obj) in (dict, list, tuple) or isinstance(obj, (np.ndarray, Layout)) or _is_leaf(obj):
        return None
    try:
        be = get_backend(backend) if backend is not None else owner_of(obj)
    except UnimeshError:
        return None
    state = be.model_state(obj)
    return None if state is None else (be, state)


# -- file helpers ----------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, parts: list[bytes | memoryview]) -> None:
    with open(path, "wb") as f:
        f.writelines(parts)
        f.flush()
        os.fsync(f.fileno())


# -- save ----------------------------------------------------------------------------------------
def _backend_of(leaves: list[Any], backend: Any) -> Any:
    from ..registry import get_backend, owner_of

    if backend is not None:
        return get_backend(backend)
    for leaf in leaves:
        if not isinstance(leaf, np.ndarray) and layout_of(leaf) is not None:
            return owner_of(leaf)
    return None


class _Staged:
    """A save with this process's blocks copied to host memory, ready to be written."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        tree: Any,
        backend: Any,
        timeout: float,
        copy: bool = True,
    ) -> None:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout < 1e7  # NaN fails too; timedelta cannot hold much more
        ):
            raise CheckpointError(
                f"timeout must be a number of seconds, > 0 and below 1e7; got {short(timeout)}"
            )
        self.timeout = float(timeout)
        names, leaves, _ = _flatten(tree)
        be = _backend_of(leaves, backend)
        if be is not None:
            be.require("checkpoint", "unimesh.save takes its arrays' blocks with local_shards")
        self.remote = Remote(os.fspath(path)) if is_url(path) else None
        self.root: Any = self.remote.url if self.remote is not None else Path(path)
        self.be = be
        try:
            self.rank = 0 if be is None else int(be.initialize(self.timeout)[0])
        except UnimeshError as exc:  # a peer that never came: the runtime did not start
            raise CheckpointError(f"saving {path} failed, nothing was written: {exc}") from exc
        self.tensors: dict[str, dict[str, Any]] = {}
        self.blocks: list[tuple[str, tuple[int, ...], str, np.ndarray]] = []
        for name, leaf in zip(names, leaves):
            layout = None if isinstance(leaf, np.ndarray) else layout_of(leaf)
            if layout is not None and layout.spec.partial:
                raise CheckpointError(
                    f"tensor {name!r} is a pending reduction ({layout.spec!r}): reduce it first "
                    "(psum inside shard_map, or redistribute to Replicate); a checkpoint holds "
                    "values"
                )
            blocks, shape, dtype = _blocks(name, leaf, layout, be, self.rank)
            self.tensors[name] = {
                "shape": list(shape),
                "dtype": dtype,
                "layout": None
                if layout is None
                else {"mesh": layout.mesh.to_dict(), "spec": _spec_json(layout.spec)},
            }
            for offset, block in blocks:  # async: a copy, as the caller may change its arrays
                kept = np.array(block, order="C", copy=True if copy else None)  # 0-d stays
                self.blocks.append((name, offset, dtype, kept))

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

    def write(self) -> None:
        """Every process's file, then the manifest (process 0), then every process returns.
        A process that cannot write (a full disk, no permission) tells the others at the next
        agreement, so that every process raises the same CheckpointError at once and the
        checkpoint already at the path stays as it was."""
        root, rank = self.root, self.rank
        # process 0's token for this save's file names, and which process writes each block:
        # the first that holds it. An array on a sub-mesh (FSDP's dp mesh inside dp x tp) is
        # held whole by several such meshes, which do not know of each other's copies.
        mine = [[name, list(offset), list(block.shape)] for name, offset, _, block in self.blocks]
        hello = {"token": secrets.token_hex(6) if rank == 0 else "", "blocks": mine}
        told = [json.loads(p) for p in self.exchange(json.dumps(hello).encode())]
        token = told[0]["token"]
        writer: dict[str, int] = {}
        for r, part in enumerate(told):
            for key in part["blocks"]:
                writer.setdefault(json.dumps(key), r)
        self.blocks = [b for b, key in zip(self.blocks, mine) if writer[json.dumps(key)] == rank]
        problem = ""
        if rank == 0:
            try:
                if self.remote is not None:
                    self.remote.mkdir()
                else:
                    root.mkdir(parents=True, exist_ok=True)
            except (OSError, CheckpointError) as exc:
                problem = f"process 0 could not create the directory: {_error_text(exc)}"
        self._agree(problem)  # the directory exists before anyone writes into it
        file = check_file_name(f"data-{token}-{rank:05d}.safetensors", "save")
        entries = [
            (f"{name}@{','.join(map(str, offset))}", dtype, block.shape, block.nbytes)
            for name, offset, dtype, block in self.blocks
        ]
        head = safetensors_header(entries)
        try:
            if self.blocks:  # a process with no block to write writes no file
                body: list[Any] = [head]
                body += [b.reshape(-1).view(np.uint8).data for *_, b in self.blocks]
                if self.remote is not None:
                    self.remote.write(file, body)
                else:
                    _write_file(root / file, body)
        except Exception as exc:  # noqa: BLE001 - told to every process, then raised
            problem = f"process {rank} could not write {file}: {_error_text(exc)}"
            self._unlink(file)
        at = len(head)
        listing: dict[str, list[list[Any]]] = {}
        for name, offset, _, block in self.blocks:
            crc = zlib.crc32(block.reshape(-1).view(np.uint8).data)
            listing.setdefault(name, []).append(
                [list(offset), list(block.shape), at, at + block.nbytes, crc]
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
            if self.remote is not None:
                self.remote.remove(name)
            else:
                (self.root / name).unlink(missing_ok=True)

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
        root = self.root
        tensors = self.tensors
        for t in tensors.values():
            t["boxes"] = []
        for part in parts:
            for name, boxes in part["boxes"].items():
                tensors[name]["boxes"].extend(
                    {"offset": o, "size": s, "file": part["file"], "start": a, "end": b,
                     "crc32": c} for o, s, a, b, c in boxes
                )  # fmt: skip
        doc = {"format": FORMAT, "version": VERSION, "tensors": tensors}
        text = json.dumps(doc, indent=1).encode()
        parse_manifest(text, "the manifest being written")  # what we write, we can read
        keep = {p["file"] for p in parts} | {MANIFEST}
        if self.remote is not None:  # no rename: the manifest's one PUT is the commit
            self.remote.write(MANIFEST, [text])
            with contextlib.suppress(Exception):
                for name in self.remote.names():  # files of earlier saves, finished or killed
                    if name not in keep and name.startswith("data-"):
                        self.remote.remove(name)
            return
        _fsync_dir(root)
        temp = root / f".{MANIFEST}.{token}"
        try:
            _write_file(temp, [text])
            os.replace(temp, root / MANIFEST)
        except OSError:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            raise
        # committed: what follows only tidies up, and a failure there changes nothing
        with contextlib.suppress(OSError):
            _fsync_dir(root)
            for stale in root.iterdir():  # files of earlier saves, finished or killed
                if stale.name not in keep and (
                    stale.name.startswith("data-") or stale.name.startswith(f".{MANIFEST}.")
                ):
                    stale.unlink(missing_ok=True)


def _error_text(exc: BaseException) -> str:
    """An error as a person reads it (an OSError with its errno's name)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return _os_text(exc)
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc)


def _os_text(exc: OSError) -> str:
    """An OSError as a person reads it: ``No space left on device (ENOSPC)``."""
    import errno

    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{exc.strerror or exc}{f' ({name})' if name else ''}"


class SaveHandle:
    """An :func:`async_save` in flight: :meth:`wait` until it is committed (raising what it
    raised), :meth:`done` to ask."""

    def __init__(self, staged: _Staged) -> None:
        import threading

        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(staged,), name="unimesh-async-save", daemon=False
        )
        self._thread.start()

    def _run(self, staged: _Staged) -> None:
        try:
            staged.write()
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
    replicated block by the device of lowest id that holds it); nothing is gathered.
    The manifest, written last by process 0 once every process's file is complete, is the
    commit point: a save into an existing checkpoint replaces it only then, and the previous
    one stays loadable until that moment. Call it on every process; a process that is gone or
    does not come within ``timeout`` seconds makes it fail with :class:`CheckpointError` on
    every other one, naming it where the backend can."""
    _after_pending()
    found = model_state(tree, backend)
    if found is not None:
        backend, tree = found
    _Staged(path, tree, backend, timeout, copy=False).write()  # written before it returns


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
    handle = SaveHandle(_Staged(path, tree, backend, timeout))
    _PENDING.append(handle)
    return handle


def _spec_json(spec: PartitionSpec) -> list[Any]:
    return [e if e is None or isinstance(e, str) else list(e) for e in spec]


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
    writer: dict[tuple[tuple[int, int], ...], int] = {}
    for device in sorted(slices):
        key = tuple((s.start, s.stop) for s in slices[device])
        writer.setdefault(key, device)
    out = []
    dtype: str | None = None
    for device, block in sorted(held.items()):
        host = np.asarray(block)
        dtype = dtype_name(host.dtype)
        key = tuple((s.start, s.stop) for s in slices[device])
        if writer[key] != device or host.size == 0:
            continue
        out.append((tuple(a for a, _ in key), host))
    if dtype is None:
        dtype = dtype_name(getattr(leaf, "dtype", "float32"))
    return out, shape, dtype


# -- reading ---------------------------------------------------------------------------------------
#: data files a Checkpoint keeps open at once
_OPEN = 64


def _close_all(fds: dict[str, int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.popitem()[1])


class Checkpoint:
    """A checkpoint opened for reading, without any framework: its tensors' names, global
    shapes, dtypes and saved layouts; :meth:`read` gives any slice as numpy, reading only its
    bytes. ``bytes_read`` counts what was read from data files. ``kind``: ``unimesh`` (a
    manifest) or ``safetensors`` (Hugging Face: one file, or files with an index). With
    ``verify=True`` every box a read touches is first read whole and checked against the
    checksum the save wrote (``crc32``), once."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        from .dcp import METADATA, read_dcp, read_hf_sharded
        from .foreign import INDEX, SINGLE, index_files, parse_index
        from .orbax import OrbaxArrays, is_orbax

        self.verify = bool(verify)
        self._checked: set[tuple[str, int]] = set()
        self._fds: dict[str, int] = {}
        self.bytes_read = 0
        self._headers: dict[str, dict[str, Any]] = {}
        self._header_metadata: dict[str, dict[str, Any]] = {}
        self.mesh: dict[str, Any] | None = None
        #: names of entries that are not tensors (DCP's pickled objects), which are not read
        self.objects: list[str] = []
        #: the checkpoint's files at an fsspec URL (None: a local directory)
        self.remote = Remote(os.fspath(path)) if is_url(path) else None
        weights: dict[str, str] = {}
        #: the checkpoint's place: a Path, or a Url in object storage
        self.path: Any
        if self.remote is not None:
            remote = self.remote
            if remote.url.suffix == ".safetensors" and remote.is_object():
                self.remote = remote = Remote(remote.url.parent)  # one file of a directory
                files = [Url(os.fspath(path)).name]
            elif remote.is_file(MANIFEST):
                self.path = remote.url
                size = remote.size(MANIFEST)
                if size > MAX_HEADER:
                    raise CheckpointError(
                        f"{self.path / MANIFEST} is {size} bytes, over the {MAX_HEADER} cap on a "
                        "manifest"
                    )
                self.kind = "unimesh"
                data = remote.read(MANIFEST, 0, size)
                self.mesh, self.tensors = parse_manifest(data, str(self.path / MANIFEST))
                return
            elif remote.is_file(INDEX):
                size = remote.size(INDEX)
                if size > MAX_HEADER:
                    raise CheckpointError(
                        f"{remote.url / INDEX} is {size} bytes, over the {MAX_HEADER} cap"
                    )
                data = remote.read(INDEX, 0, size)
                files, weights = parse_index(data, str(remote.url / INDEX), remote.is_file)
            elif remote.is_file(SINGLE):
                files = [SINGLE]
            else:
                raise CheckpointError(
                    f"{remote.url} is not a checkpoint: it has no {MANIFEST} (a save that did not "
                    "finish leaves none; the previous checkpoint is kept until one does), no "
                    f"{INDEX} and no {SINGLE}. In object storage unimesh reads its own "
                    "checkpoints and Hugging Face safetensors; copy torch DCP and Orbax "
                    "checkpoints locally (or read Orbax's from its store with Orbax)"
                )
            self.path = remote.url
            self._safetensors(files, weights)
            return
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if self.path.suffix == ".safetensors" and self.path.is_file():
            self.path, files = self.path.parent, [self.path.name]
        elif manifest.is_file() and not manifest.is_symlink():
            with open(manifest, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_HEADER:  # refused by its size, before a byte is read
                    raise CheckpointError(
                        f"{manifest} is {size} bytes, over the {MAX_HEADER} cap on a manifest"
                    )
                data = f.read(MAX_HEADER + 1)
            self.kind = "unimesh"
            self.mesh, self.tensors = parse_manifest(data, str(manifest))
            return
        elif is_orbax(self.path):
            self.kind = "orbax"
            self._orbax = OrbaxArrays(self.path)
            self.objects = self._orbax.objects
            self.tensors = {name: self._orbax.tensor(name) for name in self._orbax.names}
            return
        elif (self.path / METADATA).is_file():
            self.kind = "dcp"
            self.tensors, self.objects = read_dcp(self.path)
            return
        elif (self.path / INDEX).is_file():
            files, weights = index_files(self.path)
        elif (self.path / SINGLE).is_file():
            files = [SINGLE]
        else:
            files = _dcp_safetensors(self.path)
            if not files:
                raise CheckpointError(
                    f"{self.path} is not a checkpoint: it has no {MANIFEST} (a unimesh save that "
                    "did not finish leaves none; the previous checkpoint is kept until one does), "
                    f"no {INDEX}, no {SINGLE} and no torch DCP {METADATA}"
                )
            self.kind = "safetensors"
            self.tensors = read_hf_sharded(self.path, files, self.header, self._metadata)
            return
        self._safetensors(files, weights)

    def _safetensors(self, files: list[str], weights: dict[str, str]) -> None:
        """The tensors of safetensors ``files`` (one box each), checked against an index's
        ``weights`` map (tensor -> file)."""
        from .foreign import INDEX

        self.kind = "safetensors"
        self.tensors = {}
        for file in files:
            for name, (dtype, shape, start, end) in self.header(file).items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"{self.path}: tensor {name!r} is in {self.tensors[name].boxes[0].file} "
                        f"and in {file}"
                    )
                box = Box((0,) * len(shape), tuple(shape), file, start, end)
                self.tensors[name] = Tensor(name, tuple(shape), dtype, None, [box])
        for name, file in weights.items():
            found = self.tensors.get(name)
            if found is None or found.boxes[0].file != file:
                raise CheckpointError(
                    f"{self.path / INDEX} puts tensor {short(name)} in {file}, whose header "
                    "does not have it"
                )

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self.tensors)} tensors)"

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            if name in self.objects:
                raise CheckpointError(
                    f"{self.path}: {name!r} is a pickled object in this DCP checkpoint, not a "
                    "tensor; unimesh does not unpickle objects (load it with torch, or leave it "
                    "out of the target)"
                ) from None
            hint = close_match(name, list(self.tensors))
            raise CheckpointError(
                f"{self.path} has no tensor {name!r}{hint}; it has {short(list(self.tensors))}"
            ) from None

    def layout(self, name: str) -> Layout | None:
        """The layout the tensor was saved with (None for a host array)."""
        saved = self.tensor(name).layout
        if saved is None:
            return None
        try:
            mesh = Mesh.from_dict(saved["mesh"])
            return Layout(
                mesh,
                PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in saved["spec"])),
            )
        except (UnimeshError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{self.path}: the saved layout of {name!r} is invalid: {exc}"
            ) from None

    def _file(self, name: str) -> Path:
        """The data file ``name``, its safetensors header checked on first use (DCP's files
        were checked chunk by chunk when opened)."""
        if self.kind not in ("dcp", "orbax"):
            self.header(name)
        return Path(self.path / name)

    def _metadata(self, name: str) -> dict[str, str]:
        """The ``__metadata__`` of data file ``name``'s safetensors header."""
        self.header(name)
        found = self._header_metadata[name].get("__metadata__")
        if found is None:
            return {}
        if not isinstance(found, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in found.items()
        ):
            raise CheckpointError(f"{self.path / name}: __metadata__ must map strings to strings")
        return found

    @contextlib.contextmanager
    def _reading(self, name: str) -> Iterator[tuple[int, Callable[[int, int], bytes]]]:
        """(size, read(offset, length) -> bytes) of data file ``name``, local or remote."""
        if self.remote is not None:
            remote = self.remote
            yield remote.size(name), lambda at, n: remote.read(name, at, at + n)
            return
        path = self.path / name
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(f"{self.path}: data file {name!r} is missing or not a file")
        with open(path, "rb") as f:
            yield os.fstat(f.fileno()).st_size, lambda at, n: os.pread(f.fileno(), n, at)

    def _fd(self, name: str) -> int:
        """A descriptor of data file ``name``, kept open for this checkpoint's later reads
        (one open per file, not per block: the kernel's read-ahead state carries over from
        one block to the next). At most :data:`_OPEN` are kept; :meth:`close` (or the end of
        a load) closes them."""
        fd = self._fds.get(name)
        if fd is None:
            path = self._file(name)
            if len(self._fds) >= _OPEN:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[name] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        """Close the data files this checkpoint keeps open (reading again reopens them)."""
        _close_all(self._fds)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # not weakref.finalize: its first use imports atexit
        _close_all(getattr(self, "_fds", {}))

    def header(self, name: str) -> dict[str, Any]:
        """The entries of data file ``name``'s safetensors header, ``{entry: (dtype, shape,
        start, end)}`` (absolute byte offsets), read once (8 bytes, then the JSON) and checked
        against the file's length."""
        found = self._headers.get(name)
        if found is not None:
            return found
        with self._reading(name) as (size, read):
            head = read(0, min(size, 8))
            if len(head) == 8:
                length = int.from_bytes(head, "little")
                if length <= MAX_HEADER and 8 + length <= size:
                    head += read(8, length)
        extra: dict[str, Any] = {}
        found = read_header(head, size, str(self.path / name), extra)[1]
        self._headers[name], self._header_metadata[name] = found, extra
        return found

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The tensor, or its slice ``index`` (a tuple of slices with step 1, or None for the
        whole), as numpy; only the bytes of that slice are read."""
        t = self.tensor(name)
        start, stop = _region(t.shape, index, name)
        return self._region(t, start, stop)

    def _region(self, t: Tensor, start: tuple[int, ...], stop: tuple[int, ...]) -> np.ndarray:
        dtype = numpy_dtype(t.dtype)
        out = _empty(tuple(b - a for a, b in zip(start, stop)), dtype)  # C order
        if out.size == 0:
            return out
        if self.kind == "orbax":  # TensorStore reads the (compressed) chunks it touches whole
            for box in t.boxes:
                if all(max(a, o) < min(b, o + n)
                       for a, b, o, n in zip(start, stop, box.offset, box.size)):  # fmt: skip
                    self.bytes_read += math.prod(box.size) * t.itemsize
            whole = self._orbax.read(t, start, stop)
            if whole.shape != out.shape or whole.dtype != dtype:
                raise CheckpointError(
                    f"{self.path}: {t.name!r} read as {whole.dtype} {whole.shape}, its metadata "
                    f"says {dtype} {out.shape}"
                )
            return whole
        for piece in pieces(t.boxes, start, stop, t.itemsize):
            if self.verify:
                self.check_box(t.name, piece.box)
            if self.remote is not None:  # ranged requests, made together
                self.header(piece.box.file)
                fetched = b"".join(self.remote.read_runs(piece.box.file, piece.runs))
                self.bytes_read += piece.nbytes
                where = tuple(
                    slice(a - s, b - s) for a, b, s in zip(piece.start, piece.stop, start)
                )
                out[where] = np.frombuffer(fetched, dtype=dtype).reshape(piece.shape)
                continue
            where = tuple(slice(a - s, b - s) for a, b, s in zip(piece.start, piece.stop, start))
            box = piece.box
            fd = self._fd(box.file)
            if not box.strides:  # straight into ``out``: no buffer, no copy
                _scatter_read(fd, piece.runs, out, where, self.path, box.file, t.name)
                self.bytes_read += piece.nbytes
                continue
            buf = bytearray(piece.nbytes)  # a strided box, read whole, then viewed
            _read_into(fd, [memoryview(buf)], piece.runs[0][0], self.path, box.file, t.name)
            self.bytes_read += piece.nbytes
            view = np.lib.stride_tricks.as_strided(
                np.frombuffer(buf, dtype=dtype),
                box.size,
                tuple(s * dtype.itemsize for s in box.strides),
                writeable=False,
            )[tuple(slice(a - o, b - o) for a, b, o in zip(piece.start, piece.stop, box.offset))]
            out[where] = view
        return out

    def check_box(self, name: str, box: Box) -> None:
        """Read ``box`` of tensor ``name`` whole and compare its crc32 with the manifest's
        (once per box; nothing to check where the writer gave no checksum)."""
        key = (box.file, box.start)
        if box.crc32 is None or key in self._checked:
            return
        crc, at = 0, box.start
        self._file(box.file)  # its header checked first
        with self._reading(box.file) as (_, read):
            while at < box.end:
                chunk = read(at, min(16 << 20, box.end - at))
                if not chunk:
                    raise CheckpointError(
                        f"{self.path}: data file {box.file!r} is truncated (tensor {name!r} "
                        f"needs bytes {at}..{box.end})"
                    )
                crc = zlib.crc32(chunk, crc)
                at += len(chunk)
        self.bytes_read += box.end - box.start
        if crc != box.crc32:
            raise CheckpointError(
                f"{self.path}: tensor {name!r}, the box at {list(box.offset)} in {box.file} "
                f"(bytes {box.start}..{box.end}) fails its checksum: crc32 {crc:#010x}, the "
                f"manifest says {box.crc32:#010x}; the file changed after the save"
            )
        self._checked.add((box.file, box.start))


_IOV_MAX = 1024  # iovecs per preadv (Linux's UIO_MAXIOV)


def _scatter_read(
    fd: int,
    runs: list[tuple[int, int]],
    out: np.ndarray,
    where: tuple[slice, ...],
    root: Path,
    file: str,
    name: str,
) -> None:
    """Read the file's byte ``runs`` (row-major order of the region) straight into the region
    ``where`` of the C-order array ``out``: its contiguous stretches become the iovecs of
    ``preadv`` calls, so nothing is staged in between."""
    mem = out.reshape(-1).view(np.uint8).data
    stretches = iter(_stretches(out, where))
    at, left = next(stretches)
    for offset, length in runs:
        if not left:
            at, left = next(stretches)
        if length <= left:  # the common case: the run lands in one stretch, one call
            view = mem[at : at + length]
            if os.preadv(fd, [view], offset) != length:
                _read_into(fd, [view], offset, root, file, name)  # the rest, or truncated
            at, left = at + length, left - length
            continue
        iov: list[memoryview] = []
        size = 0
        while length:
            if not left:
                at, left = next(stretches)
            take = min(length, left)
            iov.append(mem[at : at + take])
            at, left, length, size = at + take, left - take, length - take, size + take
            if len(iov) == _IOV_MAX or not length:
                _read_into(fd, iov, offset, root, file, name)
                offset, iov, size = offset + size, [], 0


def _stretches(out: np.ndarray, where: tuple[slice, ...]) -> Iterator[tuple[int, int]]:
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


def _read_into(
    fd: int, iov: list[memoryview], offset: int, root: Path, file: str, name: str
) -> None:
    """``preadv`` until every buffer of ``iov`` is full (a call may return fewer bytes than
    asked, e.g. past 2 GiB); the file ending first is a truncated checkpoint."""
    want = sum(len(m) for m in iov)
    end = offset + want
    while iov:
        got = os.preadv(fd, iov, offset)
        if got <= 0:
            raise CheckpointError(
                f"{root}: data file {file!r} is truncated (tensor {name!r} needs bytes "
                f"{end - want}..{end})"
            )
        offset += got
        while iov and got >= len(iov[0]):
            got -= len(iov[0])
            iov = iov[1:]
        if got:
            iov[0] = iov[0][got:]


def _dcp_safetensors(root: Path) -> list[str]:
    """The ``.safetensors`` files of a directory that torch's HuggingFaceStorageWriter wrote
    with ``save_distributed=True`` (the chunks' offsets in each file's ``__metadata__``)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.suffix == ".safetensors" and p.is_file())


def _by_rule(ckpt: Checkpoint, rules: Any, logical_axes: Any, mesh: Mesh | None) -> dict[str, Any]:
    """``{name: Layout}`` for every tensor of ``ckpt`` by a LayoutMap or AxisRules."""
    from ..rules import LayoutMap

    out: dict[str, Any] = {}
    for name in ckpt.tensors:
        if isinstance(rules, LayoutMap):
            layout = rules.get(name)
            out[name] = layout if layout is not None else Layout(rules.mesh, PartitionSpec())
            continue
        if not isinstance(mesh, Mesh):
            raise CheckpointError("load() with AxisRules needs mesh=unimesh.Mesh(...)")
        names = logical_axes(name) if callable(logical_axes) else (logical_axes or {}).get(name)
        spec = PartitionSpec() if names is None else rules.spec(names, mesh)
        out[name] = Layout(mesh, spec)
    return out


def _region(
    shape: tuple[int, ...], index: Any, name: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if index is None:
        return (0,) * len(shape), shape
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape):
        raise CheckpointError(f"index {short(index)} has more entries than {name!r} has dims")
    index = index + (slice(None),) * (len(shape) - len(index))
    start, stop = [], []
    for d, (s, n) in enumerate(zip(index, shape)):
        if not isinstance(s, slice):
            raise CheckpointError(f"index entry {d} of {name!r} must be a slice, got {short(s)}")
        a, b, step = s.indices(n)
        if step != 1:
            raise CheckpointError(f"index entry {d} of {name!r} must have step 1")
        start.append(a)
        stop.append(max(a, b))
    return tuple(start), tuple(stop)


class _LazyBlocks(Mapping[int, np.ndarray]):
    """This process's blocks of one tensor, ``{device: block}``, each read when the backend
    first asks for it and let go once every device holding it has been given it: a load
    stages one block at a time in host memory, not the whole tensor."""

    def __init__(
        self,
        keys: dict[int, tuple[tuple[int, int], ...]],
        read: Callable[[tuple[tuple[int, int], ...]], np.ndarray],
    ) -> None:
        self._keys, self._read = keys, read
        self._left: dict[tuple[tuple[int, int], ...], int] = {}
        for key in keys.values():
            self._left[key] = self._left.get(key, 0) + 1
        self._held: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def __getitem__(self, device: int) -> np.ndarray:
        key = self._keys[device]
        block = self._held.get(key)
        if block is None:
            block = self._held[key] = self._read(key)
        self._left[key] -= 1
        if self._left[key] <= 0:  # every device of this block has it: let go
            del self._held[key]
        return block

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _read_block(
    ckpt: Checkpoint, t: Tensor, key: tuple[tuple[int, int], ...], cast: np.dtype[Any] | None
) -> np.ndarray:
    block = ckpt._region(t, tuple(a for a, _ in key), tuple(b for _, b in key))
    if cast is None:
        return block
    out = _empty(block.shape, cast)
    np.copyto(out, block, casting="unsafe")
    return out


def _empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """``np.empty`` whose data starts on a 64-byte boundary: a CPU runtime may then adopt a
    loaded block as its device buffer instead of copying it (XLA's CPU client does)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + 64, np.uint8)
    at = -raw.ctypes.data % 64
    return raw[at : at + nbytes].view(dtype).reshape(shape)


def open_checkpoint(path: str | os.PathLike[str], *, verify: bool = False) -> Checkpoint:
    """A checkpoint opened for inspection and reading, with no framework imported: a unimesh
    checkpoint, or Hugging Face safetensors. ``verify=True`` checks each box's checksum before
    it is first read (which reads the whole box)."""
    return Checkpoint(path, verify=verify)


# -- load ----------------------------------------------------------------------------------------
class _Plan:
    """One leaf of a load's target, checked: where its tensor is, how it is laid out and cast,
    and this process's block of it per device (``keys``, as (start, stop) per dim)."""

    __slots__ = ("be", "cast", "keys", "layout", "leaf", "name", "tensor")

    def __init__(self, name: str, leaf: Any) -> None:
        self.name, self.leaf = name, leaf
        self.tensor: Tensor | None = None
        self.be: Any = None
        self.layout: Any = None
        self.cast: np.dtype[Any] | None = None
        self.keys: dict[int, tuple[tuple[int, int], ...]] = {}


def _plan(ckpt: Checkpoint, name: str, leaf: Any, backend: Any, dtype: Any, strict: bool) -> _Plan:
    """``leaf``'s plan, every mismatch with the checkpoint refused by name."""
    from ..registry import get_backend, owner_of

    plan = _Plan(name, leaf)
    if name not in ckpt.tensors:
        if strict:
            ckpt.tensor(name)  # raises, naming the closest names
        return plan
    t = plan.tensor = ckpt.tensor(name)
    if dtype is not None:
        plan.cast = np.dtype(dtype)
    if isinstance(leaf, np.ndarray):  # a host array: read whole, as numpy
        if tuple(leaf.shape) != t.shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {t.shape} in {ckpt.path}, the target "
                f"{tuple(leaf.shape)}"
            )
        if dtype is None and dtype_text(leaf.dtype) != t.dtype:
            raise CheckpointError(
                f"tensor {name!r} is {t.dtype} in {ckpt.path}, the target "
                f"{dtype_text(leaf.dtype)}: pass dtype= to cast on purpose"
            )
        return plan
    if isinstance(leaf, Layout):
        layout, be = leaf, get_backend(backend)
        want_dtype = None
    else:
        found = layout_of(leaf)
        if found is None:
            raise CheckpointError(
                f"target {name!r} is {short(leaf)}: give a unimesh.Layout or a backend's "
                "distributed array"
            )
        layout = found
        be = get_backend(backend) if backend is not None else owner_of(leaf)
        shape = tuple(int(n) for n in leaf.shape)
        if shape != t.shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {t.shape} in {ckpt.path}, the target {shape}"
            )
        want_dtype = dtype_text(getattr(leaf, "dtype", ""))
    if len(layout.spec) > len(t.shape):
        raise CheckpointError(
            f"tensor {name!r} has {len(t.shape)} dims, its target layout {layout.spec!r} "
            f"names {len(layout.spec)}"
        )
    be.require("checkpoint", "unimesh.load builds its arrays with from_local")
    if dtype is None and want_dtype and want_dtype != t.dtype:
        raise CheckpointError(
            f"tensor {name!r} is {t.dtype} in {ckpt.path}, the target {want_dtype}: pass "
            "dtype= to cast on purpose"
        )
    plan.be, plan.layout = be, layout
    for device in be.process_devices(layout.mesh):
        plan.keys[device] = tuple((s.start, s.stop) for s in layout.shard_slices(t.shape, device))
    return plan


def load(
    path: str | os.PathLike[str],
    target: Any,
    *,
    strict: bool = True,
    dtype: Any = None,
    backend: Any = None,
    mesh: Mesh | None = None,
    logical_axes: Any = None,
    stats: dict[str, int] | None = None,
    verify: bool = False,
) -> Any:
    """The checkpoint's tensors laid out as ``target`` says, as the backend's distributed
    arrays in ``target``'s tree. ``target`` is a pytree whose leaves are :class:`Layout` s
    (shape and dtype from the checkpoint) or native distributed arrays (loaded into their
    layout; shape and dtype must match); or a :class:`LayoutMap` (or :class:`AxisRules` with
    ``mesh`` and ``logical_axes``, as :func:`unimesh.shard_params` takes them): every tensor
    of the checkpoint laid out by its name (unmatched: replicated), returned as a dict by
    name. Each process reads only the byte runs of the blocks its devices hold. ``strict``:
    every tensor of ``target`` must be in the checkpoint (False: missing ones are left as
    given). ``dtype`` casts on purpose; otherwise a dtype differing from a native target's
    is an error, never a silent cast. ``stats`` (a dict) receives ``bytes_read`` (from data
    files) and ``bytes_held`` (of the distinct blocks this process's devices hold).
    ``verify=True`` checks the checksum of every saved box a block comes from (reading those
    boxes whole, so more than the blocks' bytes). A numpy leaf is read whole, as numpy.

    ``target`` may also be a framework's model (a torch ``nn.Module``, a Keras model, an
    ``mlx.nn.Module``): each of its arrays is loaded in its own layout (no gather) and
    written into the model in place, which is returned."""
    from ..convert import from_blocks
    from ..rules import AxisRules, LayoutMap

    as_model = model_state(target, backend)
    if as_model is not None:  # a model: its arrays loaded in their layouts, then written into it
        be, state = as_model
        values = load(path, state, strict=strict, dtype=dtype, backend=be, stats=stats,
                      verify=verify)  # fmt: skip
        be.model_assign(target, {k: v for k, v in values.items() if v is not state[k]})
        return target
    with open_checkpoint(path, verify=verify) as ckpt:  # its data files closed at the end
        if isinstance(target, (LayoutMap, AxisRules)):
            target = _by_rule(ckpt, target, logical_axes, mesh)
        names, leaves, treedef = _flatten(target)
        # every leaf checked and planned before any byte is read
        plans = [
            _plan(ckpt, name, leaf, backend, dtype, strict) for name, leaf in zip(names, leaves)
        ]
        out = []
        held = 0
        for plan in plans:
            t, cast = plan.tensor, plan.cast
            if t is None:  # not in the checkpoint (strict=False): left as given
                out.append(plan.leaf)
            elif plan.be is None:  # a host array: read whole, as numpy
                whole = ckpt.read(plan.name)
                out.append(whole if cast is None else whole.astype(cast))
                held += whole.nbytes
            else:
                be, layout = plan.be, plan.layout
                blocks = _LazyBlocks(plan.keys, functools.partial(_read_block, ckpt, t, cast=cast))
                made = from_blocks(blocks, layout, t.shape, be)
                wanted = t.dtype if cast is None else dtype_name(cast)
                got = dtype_text(getattr(made, "dtype", wanted))
                if got != wanted:  # the framework changed it (JAX without x64 keeps no int64)
                    raise CheckpointError(
                        f"tensor {plan.name!r} is {wanted}, but the {be.name} backend made it "
                        f"{got}: the framework cannot hold {wanted} as configured (for JAX: "
                        "jax.config.update('jax_enable_x64', True)); pass dtype= to cast on "
                        "purpose"
                    )
                out.append(made)
                itemsize = t.itemsize if cast is None else cast.itemsize
                held += sum(
                    math.prod(b - a for a, b in r) * itemsize for r in set(plan.keys.values())
                )
        if stats is not None:
            stats["bytes_read"] = ckpt.bytes_read
            stats["bytes_held"] = held
        import optree

        return optree.tree_unflatten(treedef, out)
