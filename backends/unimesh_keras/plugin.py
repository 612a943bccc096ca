"""Entry point of the Keras backend (group ``unimesh.backends``, name ``keras``)."""

from __future__ import annotations

from unimesh.plugin import hookimpl

from .backend import KerasBackend


@hookimpl
def unimesh_backend() -> KerasBackend:
    return KerasBackend()
