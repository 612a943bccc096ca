"""Checkpoints that move across frameworks and meshes (``docs/checkpoints.md``), one job per
module: the format on disk (:mod:`.format`) and its safetensors data files
(:mod:`.safetensors_file`), where the files live (:mod:`.storage`: a local directory or an
fsspec URL, one interface every format reads and writes through) and raw local reads
(:mod:`.raw`), byte runs (:mod:`.runs`), saving (:mod:`.saving`), the table of formats'
openers (:mod:`.openers`), reading (:mod:`.reader`), loading (:mod:`.loading`), and Hugging
Face safetensors in and out (:mod:`.huggingface`); torch DCP (:mod:`.dcp`) and Orbax
(:mod:`.orbax`) are read without their frameworks. Framework-free: a backend only hands over
its blocks and takes them back."""

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
