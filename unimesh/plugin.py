"""What a backend plugin imports: the pluggy markers and the hook specifications.

A plugin package registers a module (or object) under the entry-point group
``unimesh.backends``, named like its backend, that implements :func:`unimesh_backend`::

    # pyproject.toml
    [project.entry-points."unimesh.backends"]
    mybackend = "unimesh_mybackend.plugin"

    # unimesh_mybackend/plugin.py
    from unimesh.plugin import hookimpl
    from .backend import MyBackend      # must not import the framework at module level

    @hookimpl
    def unimesh_backend():
        return MyBackend()
"""

from __future__ import annotations

import pluggy

from .backend import Backend

__all__ = ["ENTRY_POINT_GROUP", "PROJECT", "HookSpecs", "InProcessPlugin", "hookimpl", "hookspec"]

PROJECT = "unimesh"
#: The entry-point group a backend plugin registers under, named like its backend.
ENTRY_POINT_GROUP = "unimesh.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    """Hook specifications of unimesh backends."""

    @hookspec(firstresult=True)
    def unimesh_backend(self) -> Backend:  # type: ignore[empty-body]
        """Return this plugin's :class:`~unimesh.backend.Backend` instance.

        Called once when the backend is first asked for, on the plugins under its name only
        (the one registered in this process first): one backend answers. It must not import
        the framework.
        """


class InProcessPlugin:
    """A Backend registered with :func:`unimesh.register_backend`, as a pluggy plugin."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @hookimpl
    def unimesh_backend(self) -> Backend:
        return self.backend
