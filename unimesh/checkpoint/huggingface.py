"""Hugging Face safetensors, all of it: reading what people already have (one
``model.safetensors``, shards listed by ``model.safetensors.index.json``, or the files torch's
``HuggingFaceStorageWriter(save_distributed=True)`` writes, whose ``__metadata__`` gives each
chunk's ``saved_offsets``), and writing a checkpoint out as Hugging Face safetensors
(:func:`write_safetensors`), streamed in slabs, all through a place's :class:`~.storage.Storage`
(a local directory or an fsspec URL). An index is read strictly (its file names must be
plain names of regular files of the place); each tensor becomes one box (a chunk, for DCP's
files), so loading reads only each block's byte runs. Framework-free."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..messages import short
from .format import MAX_HEADER, Box, Tensor, check_file_name, check_ints, check_tiling, load_json
from .safetensors_file import write_safetensors_file
from .storage import Storage, Url, open_storage

if TYPE_CHECKING:
    from .reader import Checkpoint

__all__ = [
    "HF_SHARDING_KEY",
    "INDEX",
    "SINGLE",
    "check_sizes",
    "index_files",
    "parse_index",
    "read_files",
    "read_hf_sharded",
    "sharded_files",
    "write_safetensors",
]

#: the ``__metadata__`` key where HuggingFaceStorageWriter puts the chunks' offsets
HF_SHARDING_KEY = "DCP_SHARDING_INFO"

#: Hugging Face's names: the one file of an unsharded model, the index of a sharded one
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def index_files(storage: Storage) -> tuple[list[str], dict[str, str]]:
    """The data files the place's ``model.safetensors.index.json`` names, in order of first
    use, each a plain name of a regular file there (no separators, no ``..``, no symlink), and
    its weight map (tensor -> file)."""
    where = storage.where / INDEX
    if storage.is_link(INDEX):
        raise CheckpointError(f"{where} is a symlink: an index must be a file of the directory")

    def present(file: str) -> bool:
        return not storage.is_link(file) and storage.is_file(file)

    return parse_index(storage.read_file(INDEX, MAX_HEADER, ""), str(where), present)


def parse_index(
    data: bytes, where: str, present: Callable[[str], bool]
) -> tuple[list[str], dict[str, str]]:
    """An index file's bytes (read from ``where``) as :func:`index_files` gives them;
    ``present(name)`` says whether the data file ``name`` is a regular file beside it."""
    if len(data) > MAX_HEADER:
        raise CheckpointError(f"{where} is over the {MAX_HEADER}-byte cap")
    doc = load_json(data, where)
    if not isinstance(doc, Mapping) or not isinstance(doc.get("weight_map"), Mapping):
        raise CheckpointError(f"{where} must be a JSON object with a 'weight_map' object")
    files: list[str] = []
    for name, file in doc["weight_map"].items():
        check_file_name(file, f"{where} (tensor {short(name)})")
        if file in files:
            continue
        if not present(file):
            raise CheckpointError(
                f"{where} names {file!r} for tensor {short(name)}, which is missing, not a file "
                "or a symlink"
            )
        files.append(file)
    return files, dict(doc["weight_map"])


def read_files(ckpt: Checkpoint, files: list[str], weights: dict[str, str]) -> dict[str, Tensor]:
    """The tensors of safetensors ``files`` (one box each), checked against an index's
    ``weights`` map (tensor -> file)."""
    tensors: dict[str, Tensor] = {}
    for file in files:
        for name, (dtype, shape, start, end) in ckpt.header(file).items():
            if name in tensors:
                raise CheckpointError(
                    f"{ckpt.path}: tensor {name!r} is in {tensors[name].boxes[0].file} "
                    f"and in {file}"
                )
            box = Box((0,) * len(shape), tuple(shape), file, start, end)
            tensors[name] = Tensor(name, tuple(shape), dtype, None, [box])
    for name, file in weights.items():
        found = tensors.get(name)
        if found is None or found.boxes[0].file != file:
            raise CheckpointError(
                f"{ckpt.path / INDEX} puts tensor {short(name)} in {file}, whose header "
                "does not have it"
            )
    return tensors


def sharded_files(storage: Storage) -> list[str]:
    """The ``.safetensors`` files of the place, as HuggingFaceStorageWriter writes them with
    ``save_distributed=True`` (a local directory or a prefix in object storage alike)."""
    return sorted(
        name
        for name in storage.names()
        if name.endswith(".safetensors") and name != ".safetensors" and storage.is_file(name)
    )


# -- HuggingFaceStorageWriter(save_distributed=True) ---------------------------------------
def read_hf_sharded(ckpt: Checkpoint, files: list[str]) -> dict[str, Tensor]:
    """The tensors of safetensors ``files`` each of whose ``__metadata__`` carries DCP's
    ``saved_offsets``. A tensor's global shape is the end of its farthest chunk (DCP's own
    inference), then checked: the chunks must tile it exactly once."""
    root = ckpt.path
    chunks: dict[str, list[Box]] = {}
    dtypes: dict[str, str] = {}
    for file in files:
        where = str(root / file)
        text = ckpt.metadata(file).get(HF_SHARDING_KEY)
        if not isinstance(text, str) or len(text) > MAX_HEADER:
            raise CheckpointError(
                f"{where} has no {HF_SHARDING_KEY} in its __metadata__: a directory of "
                ".safetensors files without model.safetensors.index.json is read only as "
                "torch's HuggingFaceStorageWriter(save_distributed=True) writes it; open the "
                "file itself, or add the index"
            )
        try:
            info = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {HF_SHARDING_KEY} is not JSON: {exc}") from None
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: {HF_SHARDING_KEY} is not an object")
        for name, (dtype, shape, start, end) in ckpt.header(file).items():
            entry = info.get(name)
            offset = entry.get("saved_offsets") if isinstance(entry, dict) else None
            if not isinstance(offset, list):
                raise CheckpointError(f"{where}: {name!r} has no saved_offsets")
            offset = check_ints(list(offset), f"{where}: the saved_offsets of {name!r}")
            if len(offset) != len(shape):
                raise CheckpointError(f"{where}: {name!r}'s saved_offsets do not match its shape")
            if dtypes.setdefault(name, dtype) != dtype:
                raise CheckpointError(f"{where}: {name!r} is {dtype} here, {dtypes[name]} before")
            chunks.setdefault(name, []).append(Box(offset, tuple(shape), file, start, end))
    tensors = {}
    for name, boxes in chunks.items():
        ndim = {len(b.size) for b in boxes}
        if len(ndim) != 1:
            raise CheckpointError(f"{root}: the chunks of {name!r} differ in rank")
        shape = tuple(max(b.offset[d] + b.size[d] for b in boxes) for d in range(ndim.pop()))
        check_tiling(f"{root}: {name!r}", shape, boxes)
        tensors[name] = Tensor(name, shape, dtypes[name], None, boxes)
    return tensors


# -- writing ------------------------------------------------------------------------------------
Progress = Callable[[int, int], None]


def _slabs(shape: tuple[int, ...], itemsize: int, window: int) -> Iterator[tuple[slice, ...]]:
    """Boxes that cover an array of ``shape`` in C order, one after another, each contiguous
    in C order and of at most ``window`` bytes (at least one element)."""
    if not shape:
        yield ()
        return
    if math.prod(shape) == 0:
        return
    # the first dim k whose trailing block fits the window: iterate over dims before it one
    # index at a time and over dim k in chunks
    inner = itemsize
    k = len(shape)
    while k > 0 and inner * shape[k - 1] <= window:
        inner *= shape[k - 1]
        k -= 1
    if k == 0:
        yield tuple(slice(0, n) for n in shape)
        return
    chunk = max(1, window // inner)
    outer = shape[: k - 1]
    for index in itertools.product(*map(range, outer)):
        for a in range(0, shape[k - 1], chunk):
            yield (
                *(slice(i, i + 1) for i in index),
                slice(a, min(a + chunk, shape[k - 1])),
                *(slice(0, n) for n in shape[k:]),
            )


def _shards(tensors: list[Tensor], max_shard: int) -> list[list[Tensor]]:
    """Tensors in name order, a new shard when the next would take this one past
    ``max_shard`` bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def check_sizes(max_shard_bytes: Any, window: Any) -> None:
    """Refuse a shard size or slab window that is not a positive int of bytes."""
    for value, what in ((max_shard_bytes, "max_shard_bytes"), (window, "window")):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 62:
            raise CheckpointError(f"{what} must be a positive int of bytes, got {value!r}")


def write_safetensors(
    ckpt: Checkpoint,
    dst: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 << 30,
    window: int = 256 << 20,
    progress: Progress | None = None,
) -> list[str]:
    """Write the open checkpoint ``ckpt`` into the place ``dst`` (a directory or an fsspec
    URL) as Hugging Face safetensors: ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_bytes`` each (a larger
    tensor alone in its file) with ``model.safetensors.index.json``. Tensors keep their
    names, global shapes and dtypes. Each tensor is read and written in C-order slabs of at
    most ``window`` bytes (object storage sends each file as one PUT, so holds a file whole).
    Each file replaces an older one at once (:meth:`~.storage.Storage.commit`), the index
    last. ``progress(bytes done, total)`` is called as it goes. Returns the files written."""
    check_sizes(max_shard_bytes, window)
    out = open_storage(dst)
    if _same_place(out, ckpt.path):
        raise CheckpointError(f"convert would write into its source {ckpt.path}: give another DST")
    out.mkdir()
    tensors = [ckpt.tensor(name) for name in sorted(ckpt.names)]
    shards = _shards(tensors, max_shard_bytes)
    total = sum(t.nbytes for t in tensors)
    done = [0]
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    if progress is not None:
        progress(0, total)

    def slabs(shard: list[Tensor]) -> Iterator[Any]:
        for t in shard:
            for box in _slabs(t.shape, t.itemsize, window):
                block = ckpt.read(t.name, box)
                yield block.reshape(-1).view("uint8").data
                done[0] += block.nbytes
                if progress is not None:
                    progress(done[0], total)

    for file, shard in zip(names, shards):
        entries = [(t.name, t.dtype, t.shape, t.nbytes) for t in shard]
        write_safetensors_file(
            out, file, entries, slabs(shard), metadata={"format": "pt"}, token="partial"
        )
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {t.name: file for file, shard in zip(names, shards) for t in shard},
        }
        out.commit(INDEX, [json.dumps(index, indent=2).encode()], "partial")
        names.append(INDEX)
    return names


def _same_place(out: Storage, src: Any) -> bool:
    """Whether the export's place is the source checkpoint's own."""
    if out.local is not None and not isinstance(src, Url):
        return out.local.resolve() == Path(src).resolve()
    return str(out.where).rstrip("/") == str(src).rstrip("/")
