"""Checkpoints in object storage: any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...)
as the place of a checkpoint. Object stores have no rename and no partial write, so a data
file is written whole (one PUT) and the manifest, written last, is the commit point: a reader
never sees a new checkpoint without its whole manifest, and an object PUT replaces the old
manifest at once. Reads are ranged requests for each block's byte runs; ``bytes_read``
counts every byte the filesystem returned (manifest and headers included).

fsspec and the store's own package (``s3fs``, ``gcsfs``) are optional (the ``s3`` extra);
they are imported when a URL is first used."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError

__all__ = ["Remote", "Url", "is_url"]


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


class Remote:
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
        self.url = Url(url.rstrip("/"))
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
        """Whether the URL itself names a file (one ``.safetensors`` file, not a place)."""
        try:
            return bool(self.fs.isfile(str(self.root)))
        except Exception as exc:  # noqa: BLE001
            raise self._fail("asking for the file", "", exc) from None

    def size(self, name: str) -> int:
        try:
            return int(self.fs.size(self._path(name)))
        except Exception as exc:  # noqa: BLE001
            raise self._fail("asking for the size", name, exc) from None

    def read(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start..end`` of ``name`` (one ranged request)."""
        try:
            data = bytes(self.fs.cat_file(self._path(name), start=start, end=end))
        except Exception as exc:  # noqa: BLE001
            raise self._fail(f"reading bytes {start}..{end}", name, exc) from None
        self.bytes_read += len(data)
        return data

    def read_runs(self, name: str, runs: list[tuple[int, int]]) -> list[bytes]:
        """The byte runs ``(offset, length)`` of ``name``, as ranged requests made together."""
        path = self._path(name)
        try:
            found = self.fs.cat_ranges(
                [path] * len(runs), [a for a, _ in runs], [a + n for a, n in runs]
            )
        except Exception as exc:  # noqa: BLE001
            raise self._fail(f"reading {len(runs)} byte runs", name, exc) from None
        out = []
        for (offset, length), data in zip(runs, found):
            if isinstance(data, BaseException) or len(data) != length:
                raise CheckpointError(
                    f"{self.url / name} is truncated or unreadable (bytes {offset}.."
                    f"{offset + length})"
                )
            out.append(bytes(data))
            self.bytes_read += length
        return out

    def mkdir(self) -> None:
        try:
            self.fs.makedirs(str(self.root), exist_ok=True)
        except Exception as exc:  # noqa: BLE001
            raise self._fail("creating the place", "", exc) from None

    def write(self, name: str, parts: list[Any]) -> None:
        """``name`` written whole: one object PUT, which replaces an older object at once."""
        self.fs.pipe_file(self._path(name), b"".join(bytes(p) for p in parts))

    def names(self) -> list[str]:
        """The names of the files under the checkpoint's place (none if it has none)."""
        self.fs.invalidate_cache()
        try:
            listed = self.fs.ls(str(self.root), detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed]

    def remove(self, name: str) -> None:
        self.fs.rm_file(self._path(name))
