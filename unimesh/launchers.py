"""Launchers, as the backends declare them: the environment variables by which a launcher
(torchrun, mpirun, ...) marks the processes it starts (:class:`LauncherSign`, a backend's
``launcher_signs``), and the launcher found in an environment (:class:`Launcher`,
:func:`find_launcher`). The core names no launcher itself; each backend says which ones start
its runtime."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from .errors import LaunchError
from .messages import short

if TYPE_CHECKING:
    from .backend import Backend

__all__ = ["Launcher", "LauncherSign", "find_launcher"]


class LauncherSign(NamedTuple):
    """How a launcher marks the processes it starts. A variable counts as set when it is
    present with a non-empty value."""

    #: the launcher's name, as users call it (``"torchrun"``)
    name: str
    #: it marks a process when any of these variables is set ...
    any_set: tuple[str, ...] = ()
    #: ... or when all of these are
    all_set: tuple[str, ...] = ()
    #: the variables that hold this process's index and the number of processes
    rank_var: str | None = None
    size_var: str | None = None
    #: the variables shown as evidence when it is found (default: every one named above)
    evidence: tuple[str, ...] = ()
    #: True for a launcher of one framework; it wins over a generic one (an MPI environment
    #: around it), and two such at once are an error
    names_framework: bool = True

    def marks(self, env: Mapping[str, str]) -> bool:
        """Whether ``env`` carries this sign."""
        if any(env.get(v) for v in self.any_set):
            return True
        return bool(self.all_set) and all(env.get(v) for v in self.all_set)

    def shown(self) -> tuple[str, ...]:
        """The variables named as evidence."""
        if self.evidence:
            return self.evidence
        named = (*self.any_set, *self.all_set, self.rank_var, self.size_var)
        return tuple(dict.fromkeys(v for v in named if v))


class Launcher(NamedTuple):
    """A launcher found in this process's environment (:func:`unimesh.detect_launcher`)."""

    #: ``"torchrun"``, ``"jax.distributed"``, ``"mlx.launch"``, ``"mpirun"`` ...
    name: str
    #: the unimesh backend whose runtime it starts
    backend: str
    #: this process's index and the number of processes, where the environment says them
    rank: int | None
    processes: int | None
    #: the variables that gave it away, as ``NAME=value`` text
    evidence: str

    def __str__(self) -> str:
        return f"{self.name} ({self.evidence})"


def _int(env: Mapping[str, str], var: str | None) -> int | None:
    value = env.get(var, "") if var else ""
    return int(value) if value.isascii() and value.isdigit() and len(value) < 10 else None


def find_launcher(backends: Iterable[Backend], env: Mapping[str, str]) -> Launcher | None:
    """The launcher of ``env`` among the signs ``backends`` declare: a framework's own
    launcher over a generic one, else the first generic one found (in the order of the
    backends, then of each backend's signs); None if no sign is there. Two frameworks'
    launchers at once are a :class:`~unimesh.LaunchError`."""
    named: list[Launcher] = []
    generic: list[Launcher] = []
    for be in backends:
        for sign in be.launcher_signs:
            if not sign.marks(env):
                continue
            evidence = ", ".join(f"{v}={short(env[v], 40)}" for v in sign.shown() if v in env)
            found = Launcher(
                sign.name, be.name, _int(env, sign.rank_var), _int(env, sign.size_var), evidence
            )
            (named if sign.names_framework else generic).append(found)
    if len(named) > 1:
        raise LaunchError(
            f"this process looks started by both {named[0]} and {named[1]}; pass backend=... "
            "to say which runtime to start"
        )
    if named:
        return named[0]
    return generic[0] if generic else None
