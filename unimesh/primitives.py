"""What the per-process engine's rooms ask of a backend: one protocol, and the base class of
the group objects its ``world_group`` and ``split_group`` return (:class:`ProcessGroup`, the
collectives run on them).

:class:`unimesh.spmd.ProcessBackend` (the contract a backend derives from, at the top of the
engine) implements the protocol; the rooms below it (:mod:`unimesh.groups`,
:mod:`unimesh.process_env`, :mod:`unimesh.grad_rules`, :mod:`unimesh.vmaplan`,
:mod:`unimesh.checked`) name this protocol, never ``ProcessBackend``, so that no lower room
names a higher one. Plain typing and a base class whose methods raise: nothing runs here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np

    from .arrays import Arrays
    from .layout import Layout
    from .mesh import Mesh

__all__ = ["Primitives", "ProcessGroup"]


class ProcessGroup:
    """A group of processes as the framework holds it (as torch's c10d ``ProcessGroup`` or
    ``mx.distributed.Group``: what :meth:`~unimesh.spmd.ProcessBackend.world_group` and
    ``split_group`` return), and the collectives on it. Members come in the order
    ``split_group`` was given them (the world's: in rank order). Subclass it:
    :meth:`all_reduce` and :meth:`all_gather` are required, the others are run where the backend
    lists them in ``native_primitives`` (the engine builds them from those two otherwise)."""

    __slots__ = ()

    @classmethod
    def has(cls, op: str) -> bool:
        """Whether this class implements the collective ``op`` (overrides this class's)."""
        return getattr(cls, op) is not getattr(ProcessGroup, op)

    def all_reduce(self, x: Any, op: str) -> Any:
        """``op`` (sum/max/min) over the members."""
        raise NotImplementedError

    def all_gather(self, x: Any) -> Any:
        """The members' ``x`` stacked on a new dim 0, in member order."""
        raise NotImplementedError

    def reduce_scatter(self, x: Any) -> Any:
        """``x`` of shape (n, ...): the sum over members of their ``x[my index]``."""
        raise NotImplementedError

    def all_to_all(self, x: Any) -> Any:
        """``x`` of shape (n, ...): ``y[j]`` is member j's ``x[my index]``."""
        raise NotImplementedError

    def permute(self, x: Any, sources: tuple[int | None, ...]) -> Any:
        """Member ``sources[i]``'s ``x`` on member i, zeros where ``sources[i]`` is None."""
        raise NotImplementedError

    def broadcast(self, x: Any, root: int) -> Any:
        """Member ``root``'s ``x`` on every member."""
        raise NotImplementedError


class Primitives(Protocol):
    """A per-process backend as the engine's rooms see it (see :class:`ProcessBackend` for
    what each member promises)."""

    name: ClassVar[str]
    lazy: ClassVar[bool]
    sum_derivative_is_identity: ClassVar[bool]
    native_primitives: ClassVar[frozenset[str]]

    # the process world and its groups (the collectives are the groups' own)
    def world_group(self) -> ProcessGroup: ...
    def split_group(
        self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int
    ) -> ProcessGroup | None: ...

    # arrays (with autodiff's question and a lazy framework's order), autodiff
    def arrays(self) -> Arrays: ...
    def custom_vjp(
        self, fwd: Callable[[Any], Any], bwd: Callable[[Any], Any]
    ) -> Callable[[Any], Any]: ...
    def unwatched(self, fn: Callable[[Any], Any], x: Any) -> Any: ...

    # a program's arguments and results
    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]: ...
    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any: ...

    # a program's graph (a backend that plans its sums from it): a unimesh.vmaplan.BodyGraph
    # (vmaplan stands above this room)
    def graph(self) -> Any: ...
