"""``unimesh_keras.CheckpointCallback``: Keras's ``ModelCheckpoint`` habit, with unimesh
checkpoints. Imports keras (this module loads when the name is first used)."""

from __future__ import annotations

import os
from typing import Any

import keras

import unimesh
from unimesh import CheckpointError
from unimesh.messages import short

__all__ = ["CheckpointCallback"]


class CheckpointCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Save the model every ``every`` training batches (counted across epochs) to
    ``filepath.format(step=N)`` with :func:`unimesh.async_save`: each process copies its own
    blocks to host memory and training goes on while a background thread writes them (a
    save waits for the one before it; the last is waited for at the end of ``fit``). Variables
    are saved in their layouts, by their paths, with no gather; ``unimesh.load(path, model)``
    loads one back into any model of the same variables, on any mesh.

    ``filepath`` takes ``{step}`` (``"ckpt/step-{step}"``). ``saved`` lists the paths written."""

    def __init__(self, filepath: str | os.PathLike[str], *, every: int) -> None:
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CheckpointError(f"every must be a positive number of batches, got {short(every)}")
        text = os.fspath(filepath)
        if "{step" not in text:
            raise CheckpointError(
                f"filepath {text!r} has no {{step}}: each save would replace the last; write "
                "e.g. 'ckpt/step-{step}'"
            )
        self.filepath = text
        self.every = every
        self.saved: list[str] = []
        self._step = 0
        self._handle: Any = None

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step += 1
        if self._step % self.every == 0:
            path = self.filepath.format(step=self._step)
            self._handle = unimesh.async_save(path, self.model)
            self.saved.append(path)

    def on_train_end(self, logs: Any = None) -> None:
        self.wait()

    def wait(self) -> None:
        """Block until the last save is committed (re-raising its error)."""
        if self._handle is not None:
            self._handle.wait()
