"""Entry point of the JAX backend (group ``unimesh.backends``, name ``jax``)."""

from __future__ import annotations

from unimesh.plugin import hookimpl

from .backend import JaxBackend


@hookimpl
def unimesh_backend() -> JaxBackend:
    return JaxBackend()
