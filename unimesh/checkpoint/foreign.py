"""Checkpoints people already have: Hugging Face safetensors, one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``. The index is read strictly (its file names
must be plain names of regular files inside the directory); the files' headers are read by
:class:`~unimesh.checkpoint.store.Checkpoint` like a unimesh checkpoint's data files, and each
tensor becomes one box, so loading reads only each block's byte runs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import CheckpointError
from ..messages import short
from .format import MAX_HEADER, check_file_name, load_json

__all__ = ["INDEX", "SINGLE", "index_files", "parse_index"]

#: Hugging Face's names: the one file of an unsharded model, the index of a sharded one
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def index_files(root: Path) -> tuple[list[str], dict[str, str]]:
    """The data files ``root/model.safetensors.index.json`` names, in order of first use,
    each a plain name of a regular file in ``root`` (no separators, no ``..``, no symlink),
    and its weight map (tensor -> file)."""
    path = root / INDEX
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symlink: an index must be a file of the directory")
    with open(path, "rb") as f:
        data = f.read(MAX_HEADER + 1)

    def present(file: str) -> bool:
        target = root / file
        return not target.is_symlink() and target.is_file()

    return parse_index(data, str(path), present)


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
