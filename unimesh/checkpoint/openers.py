"""The formats a checkpoint place may hold, as one table (:data:`OPENERS`), asked in order by
:class:`~.reader.Checkpoint`: a unimesh manifest, one safetensors file, a Hugging Face index,
torch DCP, Orbax, the shards of torch's HuggingFaceStorageWriter. Each opener turns the
format's metadata into the same :class:`~.format.Tensor` s and :class:`~.format.Box` es, read
through the place's :class:`~.storage.Storage` (a local directory or an fsspec URL alike);
only Orbax's compressed chunks are read by another library (TensorStore, from the same
place). A new format is one entry of the table."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import huggingface as hf
from .format import MANIFEST, MAX_HEADER, Tensor, parse_manifest

if TYPE_CHECKING:
    from .reader import Checkpoint

__all__ = ["OPENERS", "Opened", "Opener", "Region", "not_found"]

Region = Callable[[Tensor, tuple[int, ...], tuple[int, ...]], np.ndarray]


class Opened(NamedTuple):
    """What an opener found: the tensors, the names of entries that are not tensors (DCP's
    pickled objects, never read), and a region reader for a format whose bytes are not plain
    runs (Orbax's compressed chunks, read by TensorStore)."""

    tensors: dict[str, Tensor]
    objects: tuple[str, ...] | list[str] = ()
    region: Region | None = None


class Opener(NamedTuple):
    """One format: ``kind`` (``Checkpoint.kind``), whether a place holds it, how to open it;
    ``local``: read by another library from a local directory (not from object storage)."""

    kind: str
    found: Callable[[Checkpoint], bool]
    open: Callable[[Checkpoint], Opened]
    local: bool = False


def _manifest(ckpt: Checkpoint) -> Opened:
    data = ckpt.storage.read_file(MANIFEST, MAX_HEADER, " on a manifest")
    return Opened(parse_manifest(data, str(ckpt.path / MANIFEST)))


def _orbax(ckpt: Checkpoint) -> Opened:
    from .orbax import OrbaxArrays

    arrays = OrbaxArrays(ckpt.storage)
    tensors = {name: arrays.tensor(name) for name in arrays.names}
    return Opened(tensors, arrays.objects, arrays.read)


def _dcp(ckpt: Checkpoint) -> Opened:
    from .dcp import read_dcp

    return Opened(*read_dcp(ckpt.storage))


def _is_orbax(ckpt: Checkpoint) -> bool:
    from .orbax import is_orbax

    return is_orbax(ckpt.storage)


def _is_dcp(ckpt: Checkpoint) -> bool:
    from .dcp import METADATA

    return ckpt.storage.is_file(METADATA)


#: the formats a place is asked for, in order; the first found opens it
OPENERS: list[Opener] = [
    Opener(
        "safetensors",
        lambda ck: ck.file is not None,
        lambda ck: Opened(hf.read_files(ck, [str(ck.file)], {})),
    ),
    Opener(
        "unimesh",
        lambda ck: ck.storage.is_file(MANIFEST) and not ck.storage.is_link(MANIFEST),
        _manifest,
    ),
    Opener("orbax", _is_orbax, _orbax),
    Opener("dcp", _is_dcp, _dcp),
    Opener(
        "safetensors",
        lambda ck: ck.storage.is_file(hf.INDEX),
        lambda ck: Opened(hf.read_files(ck, *hf.index_files(ck.storage))),
    ),
    Opener(
        "safetensors",
        lambda ck: ck.storage.is_file(hf.SINGLE),
        lambda ck: Opened(hf.read_files(ck, [hf.SINGLE], {})),
    ),
    Opener(
        "safetensors",
        lambda ck: bool(hf.sharded_files(ck.storage)),
        lambda ck: Opened(hf.read_hf_sharded(ck, hf.sharded_files(ck.storage))),
    ),
]


def not_found(ckpt: Checkpoint) -> str:
    """Why no opener took the place, and what would."""
    from .dcp import METADATA

    text = (
        f"{ckpt.path} is not a checkpoint: it has no {MANIFEST} (a unimesh save that did "
        "not finish leaves none; the previous checkpoint is kept until one does), no "
        f"{hf.INDEX}, no {hf.SINGLE}, no .safetensors files and no torch DCP {METADATA}"
    )
    return text
