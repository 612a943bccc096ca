"""What the per-process engine's rooms ask of a backend, as one protocol.

:class:`unimesh.spmd.ProcessBackend` (the contract a backend derives from, at the top of the
engine) implements it; the rooms below it (:mod:`unimesh.groups`, :mod:`unimesh.process_env`,
:mod:`unimesh.grad_rules`, :mod:`unimesh.vmaplan`, :mod:`unimesh.checked`) name this protocol, never
``ProcessBackend``, so that no lower room names a higher one. Plain typing: nothing runs here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np

    from .arrays import Arrays
    from .layout import Layout
    from .mesh import Mesh

__all__ = ["Primitives"]


class Primitives(Protocol):
    """A per-process backend as the engine's rooms see it (see :class:`ProcessBackend` for
    what each member promises)."""

    name: ClassVar[str]
    lazy: ClassVar[bool]
    sum_derivative_is_identity: ClassVar[bool]
    native_primitives: ClassVar[frozenset[str]]

    # the process world and its groups
    def world_group(self) -> Any: ...
    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any: ...
    def group_all_reduce(self, x: Any, group: Any, op: str) -> Any: ...
    def group_all_gather(self, x: Any, group: Any) -> Any: ...
    def group_reduce_scatter(self, x: Any, group: Any) -> Any: ...
    def group_all_to_all(self, x: Any, group: Any) -> Any: ...
    def group_permute(self, x: Any, group: Any, sources: tuple[int | None, ...]) -> Any: ...
    def group_broadcast(self, x: Any, group: Any, root: int) -> Any: ...

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
