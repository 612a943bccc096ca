"""torch Distributed Checkpoint (DCP) directories, read with neither torch nor a pickle that
runs: ``.metadata`` and each chunk's ``data.pkl`` go through the restricted unpicklers of
:mod:`.pickles`. Each tensor chunk in a ``__R_I.distcp`` file is a ``torch.save`` zip
archive; its storage is a stored (uncompressed) zip record, located here from the archive's
directory and the record's local header, so that a block is read as byte runs like any other
saved box. Every byte comes through the place's :class:`~.storage.Storage`: a DCP directory
in object storage opens as a local one does.

The files ``HuggingFaceStorageWriter`` writes are read in :mod:`.huggingface`."""

from __future__ import annotations

import io
import math
import struct
import zipfile
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..messages import short
from .format import DTYPES, MAX_HEADER, Box, Tensor, check_file_name, check_ints, check_tiling
from .pickles import MAX_PICKLE, DType, Record, load_chunk, load_metadata, torch_dtype_name

if TYPE_CHECKING:
    from .storage import Storage

__all__ = ["METADATA", "read_dcp"]

#: the metadata file torch's FileSystemWriter writes last
METADATA = ".metadata"


# -- .distcp chunks ---------------------------------------------------------------------------
#: bytes a chunk's archive is read in, in object storage, while its zip directory and pickle
#: are parsed (a few ranged requests per chunk, not one per field zipfile asks for)
_BLOCK = 64 << 10


class _Window(io.RawIOBase):
    """Bytes ``start .. start + length`` of file ``name`` of a place, as a seekable file of its
    own. On a local disk each read is a ``pread`` of what is asked; in object storage small
    reads come from blocks of :data:`_BLOCK` bytes, each requested once."""

    def __init__(self, storage: Storage, name: str, start: int, length: int) -> None:
        self.storage, self.name = storage, name
        self.start, self.length, self.pos = start, length, 0
        self.blocks: dict[int, bytes] = {}
        self.block = 0 if storage.local is not None else _BLOCK

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.length)[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def bytes(self, a: int, b: int) -> bytes:
        """Bytes ``a..b`` of the window (fewer where it or the file ends first)."""
        b, size = min(b, self.length), self.block
        if b <= a:
            return b""
        if b - a > size:  # on disk, or a large read (a big pickle): at once
            return self.storage.read(self.name, self.start + a, self.start + b, keep=True)
        parts = []
        for k in range(a // size, (b - 1) // size + 1):
            block = self.blocks.get(k)
            if block is None:
                lo, hi = self.start + k * size, self.start + min((k + 1) * size, self.length)
                block = self.blocks[k] = self.storage.read(self.name, lo, hi, keep=True)
            parts.append(block[max(0, a - k * size) : b - k * size])
        return b"".join(parts)

    def readinto(self, buf: Any) -> int:
        data = self.bytes(self.pos, self.pos + len(buf))
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _chunk_box(
    storage: Storage, size: int, name: str, offset: tuple[int, ...], sizes: tuple[int, ...],
    dtype: str, info: Record,
) -> Box:  # fmt: skip
    """Where the storage of one saved chunk lies: its ``torch.save`` archive at
    ``info.offset .. + info.length`` of the file, the stored record its pickle names."""
    file = info.get("relative_path", 0)
    start, length = info.get("offset", 1), info.get("length", 2)
    where = f"{storage.where / str(file)}: chunk of {name!r} at {list(offset)}"
    if (
        not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, length))
        or start < 0
        or length < 0
        or start + length > size
    ):
        raise CheckpointError(
            f"{where}: bytes {short(start)}..+{short(length)} fall outside the file ({size} bytes)"
        )
    try:
        window = _Window(storage, str(file), start, length)
        with zipfile.ZipFile(window) as archive:
            pkl = [i for i in archive.infolist() if i.filename.endswith("data.pkl")]
            if len(pkl) != 1 or pkl[0].file_size > MAX_PICKLE:
                raise CheckpointError(f"{where}: not a torch.save archive of one tensor")
            prefix = pkl[0].filename[: -len("data.pkl")]
            order = prefix + "byteorder"
            if order in archive.namelist() and archive.read(order) != b"little":
                raise CheckpointError(f"{where}: big-endian storage is not read")
            rebuilt = load_chunk(archive.read(pkl[0]), f"{where} (data.pkl)")
            if not isinstance(rebuilt, Record) or rebuilt.kind != "TensorRebuild":
                raise CheckpointError(f"{where}: data.pkl is not one tensor")
            kept, first = rebuilt.get("storage"), rebuilt.get("offset")
            shape, strides = rebuilt.get("size"), rebuilt.get("stride")
            record = archive.getinfo(f"{prefix}data/{kept[2]}")
            head = window.bytes(record.header_offset, record.header_offset + 30)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, EOFError, OSError,
            OverflowError, struct.error, IndexError, zipfile.LargeZipFile) as exc:  # fmt: skip
        raise CheckpointError(f"{where}: not a readable torch.save archive ({exc})") from None
    held = kept[1].dtype
    if held != dtype:
        raise CheckpointError(f"{where}: stored as {held}, the metadata says {dtype}")
    if not isinstance(shape, tuple) or tuple(shape) != sizes or not isinstance(first, int):
        raise CheckpointError(f"{where}: holds shape {short(shape)}, the metadata {list(sizes)}")
    contiguous = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    if (
        not isinstance(strides, tuple)
        or len(strides) != len(sizes)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in strides)
    ):
        raise CheckpointError(f"{where}: strides {short(strides)} do not fit shape {list(sizes)}")
    row_major = all(s == c for s, c, n in zip(strides, contiguous, sizes) if n > 1)
    if record.compress_type != zipfile.ZIP_STORED or record.flag_bits & 1:
        raise CheckpointError(f"{where}: its storage record is compressed or encrypted")
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{where}: the storage record's header is damaged")
    names, extra = struct.unpack("<HH", head[26:30])
    itemsize = DTYPES[dtype][1]
    data = start + record.header_offset + 30 + names + extra
    begin = data + first * itemsize
    if row_major or not math.prod(sizes):
        span = math.prod(sizes)
    else:  # a strided view (a transposed tensor): the elements up to its farthest one
        span = 1 + sum((n - 1) * s for n, s in zip(sizes, strides))
    end = begin + span * itemsize
    if first < 0 or end > data + record.file_size or end > start + length:
        raise CheckpointError(f"{where}: the tensor reaches past its storage record")
    return Box(offset, sizes, str(file), begin, end, strides=None if row_major else strides)


def _ints(value: Any, where: str) -> tuple[int, ...]:
    """A pickled ``torch.Size`` (a tuple), checked as the manifest's int lists are."""
    if not isinstance(value, tuple):
        raise CheckpointError(f"{where} must be a list of at most 64 ints, got {short(value)}")
    return check_ints(list(value), where)


def read_dcp(storage: Storage) -> tuple[dict[str, Tensor], list[str]]:
    """The tensors of the DCP checkpoint at ``storage``'s place (each saved chunk one box),
    and the names of its non-tensor entries (pickled objects, which are not read)."""
    where = str(storage.where / METADATA)
    if storage.is_link(METADATA):
        raise CheckpointError(f"{where} is a symlink or over the {MAX_HEADER}-byte cap")
    meta = load_metadata(storage.read_file(METADATA, MAX_HEADER, ""), where)
    if not isinstance(meta, Record) or meta.kind != "Metadata":
        raise CheckpointError(f"{where} is not DCP metadata (it holds {short(meta)})")
    entries, stored = meta.get("state_dict_metadata", 0), meta.get("storage_data", 2)
    if not isinstance(entries, dict) or not isinstance(stored, dict):
        raise CheckpointError(f"{where}: state_dict_metadata and storage_data must be dicts")
    places: dict[tuple[str, tuple[int, ...]], Record] = {}
    for index, info in stored.items():
        if not isinstance(index, Record) or not isinstance(info, Record):
            raise CheckpointError(f"{where}: storage_data holds {short(index)}: {short(info)}")
        fqn, at = index.get("fqn", 0), index.get("offset", 1)
        if info.get("transform_descriptors", 3):
            raise CheckpointError(
                f"{where}: {short(fqn)} was written through storage transforms "
                f"{short(info.get('transform_descriptors', 3))} (compression or another "
                "extension), which unimesh does not read"
            )
        if isinstance(fqn, str) and isinstance(at, tuple):
            places[(fqn, at)] = info
    tensors: dict[str, Tensor] = {}
    others: list[str] = []
    sizes_of: dict[str, int] = {}
    for name, entry in entries.items():
        if not isinstance(name, str) or not isinstance(entry, Record):
            raise CheckpointError(f"{where}: entry {short(name)} is {short(entry)}")
        if entry.kind == "BytesStorageMetadata":
            others.append(name)
            continue
        if entry.kind != "TensorStorageMetadata":
            raise CheckpointError(f"{where}: entry {name!r} is a {entry.kind}")
        props, chunks = entry.get("properties", 0), entry.get("chunks", 2)
        shape = _ints(entry.get("size", 1), f"{where}: the size of {name!r}")
        raw = props.get("dtype", 0) if isinstance(props, Record) else None
        if not isinstance(raw, DType):
            raise CheckpointError(f"{where}: {name!r} has no torch dtype ({short(raw)})")
        dtype = torch_dtype_name(str(raw))
        if not isinstance(chunks, list):
            raise CheckpointError(f"{where}: the chunks of {name!r} are {short(chunks)}")
        boxes = []
        for chunk in chunks:
            if not isinstance(chunk, Record):
                raise CheckpointError(f"{where}: a chunk of {name!r} is {short(chunk)}")
            offset = _ints(chunk.get("offsets", 0), f"{where}: a chunk offset of {name!r}")
            sizes = _ints(chunk.get("sizes", 1), f"{where}: a chunk size of {name!r}")
            if (
                len(offset) != len(shape)
                or len(sizes) != len(shape)
                or any(o + n > s for o, n, s in zip(offset, sizes, shape))
            ):
                raise CheckpointError(
                    f"{where}: the chunk of {name!r} at {list(offset)} (size {list(sizes)}) "
                    f"reaches past its shape {list(shape)}"
                )
            info = places.get((name, offset))
            if info is None:
                raise CheckpointError(
                    f"{where}: the chunk of {name!r} at {list(offset)} has no storage entry"
                )
            file = check_file_name(info.get("relative_path", 0), f"{where} ({name!r})")
            if file not in sizes_of:
                if storage.is_link(file) or not storage.is_file(file):
                    raise CheckpointError(
                        f"{where} names {file!r}, which is missing, not a file or a symlink"
                    )
                sizes_of[file] = storage.size(file)
            boxes.append(_chunk_box(storage, sizes_of[file], name, offset, sizes, dtype, info))
        check_tiling(f"{where}: {name!r}", shape, boxes)
        tensors[name] = Tensor(name, shape, dtype, None, boxes)
    return tensors, others
