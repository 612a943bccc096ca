"""A unimesh checkpoint written out as Hugging Face safetensors (one ``model.safetensors``, or
shards with a ``model.safetensors.index.json``), streamed: at most a window of bytes of any
tensor is in memory at once, whatever the model's size. Framework-free."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import CheckpointError
from .foreign import INDEX, SINGLE
from .format import Tensor, safetensors_header
from .store import Checkpoint, open_checkpoint

__all__ = ["to_safetensors"]

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


def to_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 << 30,
    window: int = 256 << 20,
    progress: Progress | None = None,
) -> list[str]:
    """Write the checkpoint at ``src`` into the directory ``dst`` as Hugging Face safetensors:
    ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` files of at most
    ``max_shard_bytes`` each (a larger tensor alone in its file) with
    ``model.safetensors.index.json``. Tensors keep their names, global shapes and dtypes. Each
    tensor is read and written in C-order slabs of at most ``window`` bytes. Files are written
    under temporary names and renamed, the index last. ``progress(bytes done, total)`` is
    called as it goes. Returns the files written."""
    for value, what in ((max_shard_bytes, "max_shard_bytes"), (window, "window")):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 62:
            raise CheckpointError(f"{what} must be a positive int of bytes, got {value!r}")
    ckpt = open_checkpoint(src)
    out = Path(dst)
    if out.resolve() == ckpt.path.resolve():
        raise CheckpointError(f"convert would write into its source {src}: give another DST")
    out.mkdir(parents=True, exist_ok=True)
    tensors = [ckpt.tensor(name) for name in sorted(ckpt.names)]
    shards = _shards(tensors, max_shard_bytes)
    total = sum(t.nbytes for t in tensors)
    done = 0
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    if progress is not None:
        progress(0, total)
    for file, shard in zip(names, shards):
        done = _write_shard(ckpt, out / file, shard, window, done, total, progress)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {t.name: file for file, shard in zip(names, shards) for t in shard},
        }
        temp = out / f".{INDEX}.partial"
        temp.write_text(json.dumps(index, indent=2))
        os.replace(temp, out / INDEX)
        names.append(INDEX)
    return names


def _write_shard(
    ckpt: Checkpoint,
    path: Path,
    shard: list[Tensor],
    window: int,
    done: int,
    total: int,
    progress: Progress | None,
) -> int:
    head = safetensors_header(
        [(t.name, t.dtype, t.shape, t.nbytes) for t in shard], metadata={"format": "pt"}
    )
    temp = path.with_name(f".{path.name}.partial")
    with open(temp, "wb") as f:
        f.write(head)
        for t in shard:
            for box in _slabs(t.shape, t.itemsize, window):
                block = ckpt.read(t.name, box)
                f.write(block.reshape(-1).view("uint8").data)
                done += block.nbytes
                if progress is not None:
                    progress(done, total)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    return done
