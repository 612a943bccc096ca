"""Entry point of the MLX backend (group ``unimesh.backends``, name ``mlx``)."""

from __future__ import annotations

from unimesh.plugin import hookimpl

from .backend import MLXBackend


@hookimpl
def unimesh_backend() -> MLXBackend:
    return MLXBackend()
