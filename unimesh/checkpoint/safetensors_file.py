"""Safetensors, the data files' format: a file's header written (:func:`safetensors_header`)
and read strictly (:func:`read_header`), and the one writer of a whole file through a place's
:class:`~.storage.Storage` (:func:`write_safetensors_file`), which a save's data files and the
Hugging Face export both use. Framework-free: numpy and the standard library."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..messages import short
from .format import DTYPES, FORMAT, MAX_HEADER, check_fields, check_int, check_ints, load_json

if TYPE_CHECKING:
    from .storage import Storage

__all__ = ["read_header", "safetensors_header", "write_safetensors_file"]

_FROM_SAFETENSORS = {st: name for name, (st, _) in DTYPES.items()}


def write_safetensors_file(
    storage: Storage,
    name: str,
    entries: list[tuple[str, str, tuple[int, ...], int]],
    data: Iterable[Any],
    *,
    metadata: dict[str, str] | None = None,
    token: str | None = None,
) -> int:
    """File ``name`` of ``storage`` written as safetensors: the header of ``entries`` (as
    :func:`safetensors_header` takes them), then ``data``, the entries' bytes in that order
    (bytes-like parts, taken one at a time: a local file is streamed). With ``token`` the
    file replaces an older one at once (:meth:`~.storage.Storage.commit`: a temporary file
    renamed, or one object PUT), else it is written in place (a save's data file, under a
    name of its own). Returns the header's length: the data's offset in the file."""
    head = safetensors_header(entries, metadata)

    def parts() -> Iterable[Any]:
        yield head
        yield from data

    if token is None:
        storage.write(name, parts())
    else:
        storage.commit(name, parts(), token)
    return len(head)


def safetensors_header(
    entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``entries`` (name,
    dtype name, shape, byte length) laid out back to back in that order; padded with spaces
    to a multiple of 8 bytes, as the format allows. ``metadata``: the ``__metadata__``
    strings (default: this format's name, ``unimesh-checkpoint``)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": FORMAT}}
    at = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {
            "dtype": DTYPES[dtype][0],
            "shape": list(shape),
            "data_offsets": [at, at + nbytes],
        }
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(
    head: bytes, size: int, where: str, extra: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    """(data start, tensors) of a safetensors file from its first bytes; ``size`` is the file's
    length. Every entry is checked: known dtype, offsets inside the file, numel x itemsize.
    ``extra`` (a dict), if given, receives the header's ``__metadata__`` as it is (unchecked)."""
    if len(head) < 8:
        raise CheckpointError(f"{where} is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(
            f"{where}: safetensors header of {n} bytes is over the cap or longer than the file "
            f"({size} bytes)"
        )
    if len(head) < 8 + n:
        raise CheckpointError(f"{where}: header truncated")
    doc = load_json(head[8 : 8 + n], f"{where} header")
    if not isinstance(doc, Mapping):
        raise CheckpointError(f"{where}: the header is not a JSON object")
    start = 8 + n
    if extra is not None:
        extra["__metadata__"] = doc.get("__metadata__")
    out: dict[str, Any] = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        at = f"{where}: entry {short(name)}"
        check_fields(entry, at, {"dtype", "shape", "data_offsets"})
        if not isinstance(entry["dtype"], str) or entry["dtype"] not in _FROM_SAFETENSORS:
            raise CheckpointError(f"{at}: unknown dtype {short(entry['dtype'])}")
        shape = check_ints(entry["shape"], f"{at} shape")
        lo, hi = (check_int(v, f"{at} data_offsets") for v in _pair(entry["data_offsets"], at))
        itemsize = DTYPES[_FROM_SAFETENSORS[entry["dtype"]]][1]
        if hi - lo != math.prod(shape) * itemsize or start + hi > size:
            raise CheckpointError(f"{at}: data_offsets {lo}..{hi} do not fit its shape or file")
        out[name] = (_FROM_SAFETENSORS[entry["dtype"]], shape, start + lo, start + hi)
    # the entries tile the data exactly, as the safetensors library requires: no overlap (two
    # tensors sharing bytes, which MLX's loader does not check), no hole
    # (offsets in messages are data_offsets: from the end of the header)
    at = start
    for name, (_, _, lo, hi) in sorted(out.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if lo != at:
            what = (
                "overlaps the entry before it"
                if lo < at
                else f"leaves bytes {at - start}..{lo - start} unused"
            )
            raise CheckpointError(
                f"{where}: entry {short(name)} at {lo - start}..{hi - start} {what}"
            )
        at = hi
    if at != size:
        raise CheckpointError(
            f"{where}: bytes {at - start}..{size - start} after the last entry are unused"
        )
    return start, out


def _pair(value: Any, where: str) -> tuple[Any, Any]:
    if not isinstance(value, list) or len(value) != 2:
        raise CheckpointError(f"{where}: data_offsets must be [begin, end]")
    return value[0], value[1]
