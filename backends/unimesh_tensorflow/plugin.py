"""Entry point of the TensorFlow DTensor backend (group ``unimesh.backends``, name
``tensorflow``)."""

from __future__ import annotations

from unimesh.plugin import hookimpl

from .backend import TensorFlowBackend


@hookimpl
def unimesh_backend() -> TensorFlowBackend:
    return TensorFlowBackend()
