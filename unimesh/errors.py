"""The unimesh error hierarchy.

Every error unimesh raises for bad input is a :class:`UnimeshError`. Each subclass also derives from
the builtin exception a Python user would expect (``ValueError``, ``LookupError``, ...), so existing
``except ValueError`` code keeps working.
"""

from __future__ import annotations

__all__ = [
    "AxisContextError",
    "BackendNotFoundError",
    "BackendRegistrationError",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "ConversionError",
    "LaunchError",
    "LayoutError",
    "LinkError",
    "MeshMismatchError",
    "MeshSpecError",
    "UnimeshError",
    "UnsupportedError",
]


class UnimeshError(Exception):
    """Base class of every error unimesh raises on purpose."""


class MeshSpecError(UnimeshError, ValueError):
    """A mesh description (shape, axis names, device ids, serial form) is invalid."""


class LayoutError(UnimeshError, ValueError):
    """A partition spec, layout, layout map or axis rule is invalid for its mesh."""


class BackendNotFoundError(UnimeshError, LookupError):
    """No backend of that name is installed or registered."""


class BackendUnavailableError(UnimeshError, ImportError):
    """A backend plugin is installed but the framework it needs is not."""


class UnsupportedError(UnimeshError, NotImplementedError):
    """A backend was asked for a capability it does not declare."""

    def __init__(self, message: str, *, backend: str | None = None, capability: str | None = None):
        super().__init__(message)
        self.backend = backend
        self.capability = capability


class MeshMismatchError(UnimeshError, RuntimeError):
    """Processes disagree about a mesh, or the runtime does not match what the mesh needs."""


class ConversionError(UnimeshError, TypeError):
    """An object handed to a conversion call is neither a unimesh object nor a known native one."""


class BackendRegistrationError(UnimeshError, ValueError):
    """A backend object or plugin is malformed (bad name, unknown capability, duplicate name)."""


class AxisContextError(UnimeshError, RuntimeError):
    """An axis collective (``unimesh.psum``, ...) was called outside ``unimesh.shard_map``, or
    over an axis the function is not manual over (``axis_names``)."""


class ConfigError(UnimeshError, ValueError):
    """A config file (TOML/JSON) is unreadable or its structure is wrong."""


class LaunchError(MeshMismatchError):
    """The launcher's environment is incomplete, or the distributed runtime could not start
    (a variable is missing, a peer never joined)."""


class LinkError(UnimeshError):
    """A transfer between two jobs (:func:`unimesh.link`) cannot go on: the two jobs disagree
    on a tensor (shape, dtype, version, a name nothing sent), or a process of either job died
    or stopped answering. Raised on every process of both jobs."""


class CheckpointError(UnimeshError):
    """A checkpoint that cannot be written or read as asked: a missing or malformed file, a
    tensor missing or of another shape or dtype; the message names the tensor and the file."""
