"""Checkpoints that move across frameworks and meshes (``docs/checkpoints.md``): the format
(:mod:`.format`), who reads which bytes (:mod:`.plan`), saving and loading (:mod:`.store`),
and writing a checkpoint out as Hugging Face safetensors (:mod:`.export`).
Framework-free: a backend only hands over its blocks and takes them back."""

from __future__ import annotations

from .export import to_safetensors
from .store import Checkpoint, SaveHandle, async_save, load, open_checkpoint, save

__all__ = [
    "Checkpoint",
    "SaveHandle",
    "async_save",
    "load",
    "open_checkpoint",
    "save",
    "to_safetensors",
]
