"""Checkpoints that move across frameworks and meshes (``docs/checkpoints.md``): the format
(:mod:`.format`), who reads which bytes (:mod:`.plan`), and saving and loading (:mod:`.store`).
Framework-free: a backend only hands over its blocks and takes them back."""

from __future__ import annotations

from .store import Checkpoint, SaveHandle, async_save, load, open_checkpoint, save

__all__ = ["Checkpoint", "SaveHandle", "async_save", "load", "open_checkpoint", "save"]
