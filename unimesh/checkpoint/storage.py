"""Where a checkpoint's files live: one small interface, :class:`Storage`, and its two
implementations, as torch DCP's ``FileSystemBase`` has them. The save's commit protocol
(:mod:`.saving`), the reader (:mod:`.reader`), every format's opener (:mod:`.openers`: torch
DCP's archives, Hugging Face's shards) and the safetensors writer (:mod:`.safetensors_file`)
are written once over it.

- :class:`LocalDir`: a directory. Reads are ``pread``/``preadv`` on descriptors kept open per
  file; a file is written and fsync'd whole; the manifest is committed by an atomic rename.
- :class:`Remote`: any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...). Object stores have
  no rename and no partial write, so a file is one PUT and the manifest's PUT is the commit
  point (it replaces the old manifest at once). Reads are ranged requests. fsspec and the
  store's package (``s3fs``, ``gcsfs``) are optional (the ``s3`` extra), imported on first use.

``bytes_read`` counts every byte a storage returned (manifest and headers included)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError
from .raw import fsync_dir, scatter_read, write_file

if TYPE_CHECKING:
    from .runs import Runs

__all__ = ["LocalDir", "Remote", "Storage", "Url", "is_url", "open_storage"]

#: data files a LocalDir keeps open at once
_OPEN = 64


def is_url(path: Any) -> bool:
    """True for an fsspec URL other than a plain local path (``file://`` is local)."""
    text = path if isinstance(path, str) else os.fspath(path) if isinstance(path, os.PathLike) \
        else ""  # fmt: skip
    return "://" in text and not text.startswith("file://")


class Url(str):
    """A URL used where a local checkpoint has a Path: ``url / name``, ``.name``,
    ``.suffix``, ``.parent`` (without collapsing ``s3://`` as a Path would)."""

    def __truediv__(self, name: str) -> Url:
        return Url(f"{self.rstrip('/')}/{name}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        return name[name.rfind(".") :] if "." in name else ""

    @property
    def parent(self) -> Url:
        return Url(self.rstrip("/").rsplit("/", 1)[0])


class Storage:
    """The files of one checkpoint place. ``where`` is the place (a Path or a :class:`Url`,
    ``where / name`` naming a file in messages); ``local`` its directory on a local file
    system, None in object storage (only Orbax's TensorStore opens the place itself)."""

    where: Any
    local: Path | None = None
    bytes_read: int = 0

    def is_object(self) -> bool:
        """Whether the place itself is one file (a ``.safetensors`` file, not a directory)."""
        raise NotImplementedError

    def is_file(self, name: str) -> bool:
        """Whether ``name`` is a file of the place (a symlink to one counts)."""
        raise NotImplementedError

    def is_link(self, name: str) -> bool:
        """Whether ``name`` is a symlink (refused where a file must be the place's own)."""
        return False

    def size(self, name: str) -> int:
        """The length of file ``name`` in bytes."""
        raise NotImplementedError

    def read(self, name: str, start: int, end: int, keep: bool = False) -> bytes:
        """Bytes ``start..end`` of ``name`` (fewer where the file ends first). ``keep``: more
        reads of the file follow (an opener's reads of a data file's metadata), so a local
        file stays open for them, as data reads keep it."""
        raise NotImplementedError

    def read_file(self, name: str, cap: int, what: str) -> bytes:
        """The whole of a small file ``name`` (a manifest, an index), refused by its size
        before a byte is read when over ``cap`` bytes (``what`` names the cap)."""
        size = self.size(name)
        if size > cap:
            raise CheckpointError(f"{self.where / name} is {size} bytes, over the {cap} cap{what}")
        return self.read(name, 0, size)

    def read_into(
        self,
        name: str,
        runs: Runs,
        out: np.ndarray,
        where: tuple[slice, ...],
        tensor: str = "",
    ) -> None:
        """The byte ``runs`` ``(offset, length)`` of ``name``, in the row-major order of the
        region ``where`` of the C-order array ``out``, written into that region (``tensor``
        names what is read, in errors)."""
        raise NotImplementedError

    def mkdir(self) -> None:
        """Create the place (and its parents) if it is not there."""
        raise NotImplementedError

    def write(self, name: str, parts: Iterable[Any]) -> None:
        """File ``name`` written whole from ``parts`` (bytes-like, taken one at a time: a
        local file is streamed, never held whole), durably."""
        raise NotImplementedError

    def commit(self, name: str, parts: Iterable[Any], token: str) -> None:
        """File ``name`` replaced by ``parts`` (as :meth:`write` takes them) at once: a reader
        sees the old file or the new, whole. ``token`` names a temporary file where one is
        needed."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """The names of the place's files (none if the place is not there)."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """Remove file ``name`` if it is there."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what reads keep open (reading again reopens it)."""


class LocalDir(Storage):
    """A checkpoint's directory on a local file system."""

    def __init__(self, root: Path) -> None:
        self.root: Path = root
        self.where = self.local = root
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

    def is_object(self) -> bool:
        return self.root.is_file()

    def is_file(self, name: str) -> bool:
        return (self.root / name).is_file()

    def is_link(self, name: str) -> bool:
        return (self.root / name).is_symlink()

    def _checked(self, name: str) -> Path:
        path = self.root / name
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(f"{self.root}: data file {name!r} is missing or not a file")
        return path

    def size(self, name: str) -> int:
        fd = self._fds.get(name)
        return os.fstat(fd).st_size if fd is not None else self._checked(name).stat().st_size

    def read_file(self, name: str, cap: int, what: str) -> bytes:
        with open(self.root / name, "rb") as f:  # not kept open: read once
            size = os.fstat(f.fileno()).st_size
            if size > cap:
                raise CheckpointError(
                    f"{self.root / name} is {size} bytes, over the {cap} cap{what}"
                )
            data = f.read(cap + 1)
        self.bytes_read += len(data)
        return data

    def fd(self, name: str) -> int:
        """A descriptor of file ``name``, kept open for later reads (one open per file, not
        per block: the kernel's read-ahead state carries over from one block to the next).
        At most 64 are kept; :meth:`close` closes them."""
        fd = self._fds.get(name)
        if fd is None:
            path = self._checked(name)
            if len(self._fds) >= _OPEN:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[name] = os.open(path, os.O_RDONLY)
        return fd

    def read(self, name: str, start: int, end: int, keep: bool = False) -> bytes:
        """Through the descriptor data reads keep open (opened here with ``keep``), else a
        descriptor of its own (a header read or a checksum does not keep the file open)."""
        kept = self.fd(name) if keep else self._fds.get(name)
        fd = kept if kept is not None else os.open(self._checked(name), os.O_RDONLY)
        parts, at = [], start
        try:
            while at < end:
                got = os.pread(fd, end - at, at)
                if not got:
                    break
                parts.append(got)
                at += len(got)
        finally:
            if kept is None:
                os.close(fd)
        self.bytes_read += at - start
        return b"".join(parts)

    def read_into(
        self,
        name: str,
        runs: Runs,
        out: np.ndarray,
        where: tuple[slice, ...],
        tensor: str = "",
    ) -> None:
        scatter_read(
            self.fd(name), runs.table, out, where, f"{self.root}: data file {name!r}", tensor
        )
        self.bytes_read += runs.nbytes

    def mkdir(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, parts: Iterable[Any]) -> None:
        write_file(self.root / name, parts)

    def commit(self, name: str, parts: Iterable[Any], token: str) -> None:
        fsync_dir(self.root)  # the data files' entries are durable before the manifest's
        temp = self.root / f".{name}.{token}"
        try:
            write_file(temp, parts)
            os.replace(temp, self.root / name)
        except OSError:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            raise
        with contextlib.suppress(OSError):  # committed: a failure here changes nothing
            fsync_dir(self.root)

    def names(self) -> list[str]:
        try:
            return [p.name for p in self.root.iterdir()]
        except FileNotFoundError:
            return []

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def close(self) -> None:
        while self._fds:
            with contextlib.suppress(OSError):
                os.close(self._fds.popitem()[1])

    def __del__(self) -> None:  # not weakref.finalize: its first use imports atexit
        if hasattr(self, "_fds"):
            self.close()


class Remote(Storage):
    """The files of a checkpoint at an fsspec URL."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError:
            raise CheckpointError(
                f"{url} is a URL: checkpoints in object storage need fsspec and the store's "
                'package (pip install "unimesh[s3]" for s3://, or gcsfs for gs://)'
            ) from None
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise CheckpointError(
                f'{url}: {exc} (for s3:// URLs: pip install "unimesh[s3]")'
            ) from None
        self.where = self.url = Url(url.rstrip("/"))
        self.bytes_read = 0

    def _path(self, name: str) -> str:
        return f"{str(self.root).rstrip('/')}/{name}"

    def _fail(self, what: str, name: str, exc: BaseException) -> CheckpointError:
        return CheckpointError(f"{self.url / name}: {what} failed: {type(exc).__name__}: {exc}")

    def is_file(self, name: str) -> bool:
        try:
            return bool(self.fs.isfile(self._path(name)))
        except Exception as exc:  # noqa: BLE001 - a store's own errors (credentials, network)
            raise self._fail("asking for the file", name, exc) from None

    def is_object(self) -> bool:
        try:
            return bool(self.fs.isfile(str(self.root)))
        except Exception as exc:  # noqa: BLE001
            raise self._fail("asking for the file", "", exc) from None

    def size(self, name: str) -> int:
        try:
            return int(self.fs.size(self._path(name)))
        except Exception as exc:  # noqa: BLE001
            raise self._fail("asking for the size", name, exc) from None

    def read(self, name: str, start: int, end: int, keep: bool = False) -> bytes:
        """Bytes ``start..end`` of ``name`` (one ranged request)."""
        try:
            data = bytes(self.fs.cat_file(self._path(name), start=start, end=end))
        except Exception as exc:  # noqa: BLE001
            raise self._fail(f"reading bytes {start}..{end}", name, exc) from None
        self.bytes_read += len(data)
        return data

    def read_into(
        self,
        name: str,
        runs: Runs,
        out: np.ndarray,
        where: tuple[slice, ...],
        tensor: str = "",
    ) -> None:
        """The runs as ranged requests made together, then copied into the region."""
        path = self._path(name)
        try:
            found = self.fs.cat_ranges(
                [path] * len(runs), [a for a, _ in runs], [a + n for a, n in runs]
            )
        except Exception as exc:  # noqa: BLE001
            raise self._fail(f"reading {len(runs)} byte runs", name, exc) from None
        for (offset, length), data in zip(runs, found):
            if isinstance(data, BaseException) or len(data) != length:
                raise CheckpointError(
                    f"{self.url / name} is truncated or unreadable (bytes {offset}.."
                    f"{offset + length})"
                )
            self.bytes_read += length
        shape = tuple(w.stop - w.start for w in where)
        out[where] = np.frombuffer(b"".join(found), dtype=out.dtype).reshape(shape)

    def mkdir(self) -> None:
        try:
            self.fs.makedirs(str(self.root), exist_ok=True)
        except Exception as exc:  # noqa: BLE001
            raise self._fail("creating the place", "", exc) from None

    def write(self, name: str, parts: Iterable[Any]) -> None:
        """``name`` written whole: one object PUT, which replaces an older object at once
        (the parts are joined first: a PUT is sent whole)."""
        data = b"".join(bytes(p) for p in parts)  # a part's own errors (a read) pass through
        try:
            self.fs.pipe_file(self._path(name), data)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(f"writing {len(data)} bytes", name, exc) from None

    def commit(self, name: str, parts: Iterable[Any], token: str) -> None:
        self.write(name, parts)  # no rename in object storage: the one PUT is the commit

    def names(self) -> list[str]:
        self.fs.invalidate_cache()
        try:
            listed = self.fs.ls(str(self.root), detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed]

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))


def open_storage(path: str | os.PathLike[str]) -> Storage:
    """The storage of a checkpoint place: :class:`Remote` for an fsspec URL, else
    :class:`LocalDir`."""
    return Remote(os.fspath(path)) if is_url(path) else LocalDir(Path(path))
