"""Entry point of the torch backend (group ``unimesh.backends``, name ``torch``)."""

from __future__ import annotations

from unimesh.plugin import hookimpl

from .backend import TorchBackend


@hookimpl
def unimesh_backend() -> TorchBackend:
    return TorchBackend()
