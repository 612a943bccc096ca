"""Checkpoints that move across frameworks and meshes (``docs/checkpoints.md``), one job per
module: the format on disk (:mod:`.format`), where the files live (:mod:`.storage`: a local
directory or an fsspec URL, one interface) and raw local reads (:mod:`.raw`), byte runs
(:mod:`.runs`), saving (:mod:`.saving`), reading any format through one table of openers
(:mod:`.reader`), loading (:mod:`.loading`), and Hugging Face safetensors in and out
(:mod:`.huggingface`); torch DCP (:mod:`.dcp`) and Orbax (:mod:`.orbax`) are read without
their frameworks. Framework-free: a backend only hands over its blocks and takes them back."""

from __future__ import annotations

from .loading import load
from .reader import Checkpoint, open_checkpoint, to_safetensors
from .saving import SaveHandle, async_save, save

__all__ = [
    "Checkpoint",
    "SaveHandle",
    "async_save",
    "load",
    "open_checkpoint",
    "save",
    "to_safetensors",
]
