"""Orbax checkpoints (``orbax.checkpoint``'s PyTree / StandardCheckpointer saves), read onto
any backend through TensorStore, the library Orbax itself writes them with. ``_METADATA``
(JSON: the tree's keys and value types) is read through the place's
:class:`~.storage.Storage`, and each array's zarr metadata (``.zarray`` or ``zarr.json``:
shape, dtype, chunk shape) through TensorStore; both are checked here before TensorStore opens
the array; a block is then read by TensorStore, which reads only the chunks it touches (Orbax
writes one chunk per saved shard, compressed, so whole chunks are the unit of reading).

The chunks do not go through :class:`~.storage.Storage`: Orbax keeps them in an OCDBT
database (a B-tree of TensorStore's own binary format, over content-addressed files) as
compressed zarr chunks, which only TensorStore reads. TensorStore is pointed at the same
place instead, with its own drivers: a local directory, ``s3://`` (with fsspec's endpoint, for
an S3-compatible store) or ``gs://``; another URL (``memory://``: fsspec's, in this process)
is refused, naming the fix.

TensorStore is optional (the ``orbax`` extra); it is imported when an Orbax checkpoint is
first opened."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError
from ..messages import short
from .format import DTYPES, MAX_HEADER, Box, Tensor, load_json

if TYPE_CHECKING:
    from .storage import Storage

__all__ = ["ORBAX_METADATA", "OrbaxArrays", "is_orbax"]

#: the tree metadata file Orbax writes (its presence marks an Orbax PyTree checkpoint)
ORBAX_METADATA = "_METADATA"
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
#: zarr v2 dtype strings (little-endian or byte-sized) -> checkpoint dtype names
_ZARR2 = {
    "<f8": "float64", "<f4": "float32", "<f2": "float16", "bfloat16": "bfloat16",
    "<i8": "int64", "<i4": "int32", "<i2": "int16", "|i1": "int8", "|u1": "uint8",
    "|b1": "bool", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}  # fmt: skip


def is_orbax(storage: Storage) -> bool:
    return storage.is_file(ORBAX_METADATA)


def _kvstore(storage: Storage) -> dict[str, Any]:
    """TensorStore's spec of the place's own files (without OCDBT): a local directory, or the
    bucket and prefix of an ``s3://`` or ``gs://`` URL."""
    if storage.local is not None:
        return {"driver": "file", "path": str(storage.local.resolve()) + "/"}
    url = str(storage.where)
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    path = prefix.strip("/") + "/" if prefix.strip("/") else ""
    if scheme in ("s3", "s3a"):
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path}
        options = getattr(getattr(storage, "fs", None), "storage_options", {}) or {}
        endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
            "endpoint_url"
        )
        region = (options.get("client_kwargs") or {}).get("region_name") or os.environ.get(
            "AWS_REGION", os.environ.get("AWS_DEFAULT_REGION")
        )
        if endpoint:
            spec["endpoint"] = str(endpoint)
        if region:
            spec["aws_region"] = str(region)
        return spec
    if scheme in ("gs", "gcs"):
        return {"driver": "gcs", "bucket": bucket, "path": path}
    raise CheckpointError(
        f"{url} is an Orbax checkpoint, whose chunks only TensorStore reads, and TensorStore "
        "reaches local paths, s3:// and gs://, not this URL: copy the checkpoint to a local "
        "directory (or a bucket) and open it there"
    )


def _tensorstore() -> Any:
    try:
        import tensorstore
    except ImportError:
        raise CheckpointError(
            'reading an Orbax checkpoint needs TensorStore: pip install "unimesh[orbax]" '
            "(or tensorstore)"
        ) from None
    return tensorstore


class OrbaxArrays:
    """The arrays of the Orbax checkpoint at ``storage``'s place: their tensors (one box per
    zarr chunk, for the planner's counting) and reads of any region through TensorStore."""

    def __init__(self, storage: Storage) -> None:
        self.root = root = storage.where
        where = str(root / ORBAX_METADATA)
        if storage.is_link(ORBAX_METADATA):
            raise CheckpointError(f"{where} is a symlink or over the {MAX_HEADER}-byte cap")
        doc = load_json(storage.read_file(ORBAX_METADATA, MAX_HEADER, ""), where)
        tree = doc.get("tree_metadata") if isinstance(doc, Mapping) else None
        if not isinstance(tree, Mapping):
            raise CheckpointError(f"{where} has no 'tree_metadata' object")
        self.zarr3 = bool(doc.get("use_zarr3", False))
        ocdbt = bool(doc.get("use_ocdbt", True))
        files = _kvstore(storage)
        self.kvstore: dict[str, Any] = {"driver": "ocdbt", "base": files} if ocdbt else files
        self.names: list[str] = []
        self.objects: list[str] = []
        for key, entry in tree.items():
            keys = entry.get("key_metadata") if isinstance(entry, Mapping) else None
            value = entry.get("value_metadata") if isinstance(entry, Mapping) else None
            if not isinstance(keys, list) or not isinstance(value, Mapping):
                raise CheckpointError(f"{where}: entry {short(key)} lacks key or value metadata")
            parts = [k.get("key") if isinstance(k, Mapping) else None for k in keys]
            if not parts or not all(isinstance(p, str) and p for p in parts):
                raise CheckpointError(f"{where}: entry {short(key)} has bad keys {short(keys)}")
            name = ".".join(str(p) for p in parts)
            if value.get("skip_deserialize"):
                continue
            if value.get("value_type") in _ARRAY_TYPES:
                self.names.append(name)
            else:
                self.objects.append(name)
        self._ts = _tensorstore()
        self._kv: Any = None
        self._open: dict[str, Any] = {}

    def _store(self) -> Any:
        if self._kv is None:
            try:
                self._kv = self._ts.KvStore.open(self.kvstore).result()
            except Exception as exc:  # noqa: BLE001 - TensorStore raises ValueError and others
                raise CheckpointError(
                    f"{self.root}: the Orbax store does not open: {exc}"
                ) from None
        return self._kv

    def tensor(self, name: str) -> Tensor:
        """Shape, dtype and chunk grid of ``name`` from its zarr metadata, checked."""
        key = f"{name}/{'zarr.json' if self.zarr3 else '.zarray'}"
        where = f"{self.root}: {key}"
        try:
            found = self._store().read(key).result()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{where} cannot be read: {exc}") from None
        raw = bytes(found.value)
        if not raw:
            raise CheckpointError(f"{where} is missing")
        if len(raw) > 1 << 20:
            raise CheckpointError(f"{where} is over 1 MiB")
        meta = load_json(raw, where)
        if not isinstance(meta, Mapping):
            raise CheckpointError(f"{where} is not a JSON object")
        if self.zarr3:
            dtype = meta.get("data_type")
            grid = meta.get("chunk_grid")
            chunks = (grid.get("configuration") or {}).get("chunk_shape") if isinstance(
                grid, Mapping) else None  # fmt: skip
            # Orbax's zarr3 arrays may shard: the outer chunk is the unit of a saved shard
            dtype = dtype if dtype in DTYPES else None
        else:
            dtype = _ZARR2.get(str(meta.get("dtype")))
            chunks = meta.get("chunks")
        shape = meta.get("shape")
        if dtype is None:
            raise CheckpointError(
                f"{where}: dtype {short(meta.get('data_type', meta.get('dtype')))} is not one "
                f"unimesh reads ({', '.join(DTYPES)})"
            )
        for what, value, lo in (("shape", shape, 0), ("chunks", chunks, 1)):
            if (
                not isinstance(value, list)
                or len(value) > 64
                or not all(
                    isinstance(v, int) and not isinstance(v, bool) and lo <= v < 2**62
                    for v in value
                )
            ):
                raise CheckpointError(f"{where}: {what} {short(value)} is not a list of ints")
        assert isinstance(shape, list) and isinstance(chunks, list)
        if len(chunks) != len(shape) or math.prod(shape) * DTYPES[dtype][1] >= 2**62:
            raise CheckpointError(f"{where}: chunks {chunks} do not fit shape {shape}")
        boxes = [
            Box(index, tuple(min(c, n - o) for o, c, n in zip(index, chunks, shape)), key, 0, 0)
            for index in _grid(shape, chunks)
        ]  # fmt: skip
        return Tensor(name, tuple(shape), dtype, None, boxes)

    def read(self, t: Tensor, start: tuple[int, ...], stop: tuple[int, ...]) -> np.ndarray:
        """The region ``start:stop`` of ``t`` through TensorStore (only the chunks it touches)."""
        array = self._open.get(t.name)
        if array is None:
            spec = {
                "driver": "zarr3" if self.zarr3 else "zarr",
                "kvstore": self.kvstore,
                "path": t.name,
            }
            try:
                array = self._ts.open(spec, open=True, read=True).result()
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{self.root}: {t.name!r} does not open: {exc}") from None
            self._open[t.name] = array
        index = tuple(slice(a, b) for a, b in zip(start, stop))
        try:
            got = np.asarray(array[index].read().result()) if index else np.asarray(
                array.read().result())  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{self.root}: reading {t.name!r} failed: {exc}") from None
        return got


def _grid(shape: list[int], chunks: list[int]) -> list[tuple[int, ...]]:
    """The offsets of the chunks of a zarr array (row-major), at most 2**20 of them."""
    import itertools

    counts = [max(1, -(-n // c)) if n else 0 for n, c in zip(shape, chunks)]
    if math.prod(counts) > 1 << 20:
        raise CheckpointError(f"an array of shape {shape} in chunks {chunks}: too many chunks")
    return [
        tuple(i * c for i, c in zip(index, chunks))
        for index in itertools.product(*(range(n) for n in counts))
    ]
