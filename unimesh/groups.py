"""Group communication for the per-process engine: this process's group along some mesh axes,
and the collectives on it, native where the backend has the primitive and built from an
all-gather or an all-reduce where not. No gradient knowledge: :mod:`unimesh.process_env` and
:mod:`unimesh.grad_rules` add the rules on top.

Names: a collective here has its group primitive's name (``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all``, ``permute``, ``broadcast``), the name of the method of the
backend's group it calls (:class:`unimesh.primitives.ProcessGroup`) and of the key in
``native_primitives``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .mesh import Mesh

if TYPE_CHECKING:
    from .primitives import Primitives, ProcessGroup

__all__ = ["Chain", "Group", "GroupComm"]


class Chain(threading.local):
    """A lazy backend's collectives in program order, per thread and through every mesh (an
    MLX mesh spans the whole world). ``last`` is the latest collective's result (the next one
    runs after it); ``depth`` counts the programs running, so that a program called inside
    another's body continues the caller's chain instead of starting its own."""

    def __init__(self) -> None:
        self.last: Any = None
        self.depth = 0


class Group:
    """This process's communication group along some axes: ``members`` (logical device ids)
    in the order of their index along the axes, this process's ``index`` among them, and the
    backend's group object, ``handle`` (None: emulated over the world group)."""

    __slots__ = ("handle", "index", "members", "size")

    def __init__(self, members: tuple[int, ...], index: int, handle: ProcessGroup | None) -> None:
        self.members = members
        self.index = index
        self.size = len(members)
        self.handle = handle

    def __repr__(self) -> str:
        how = "emulated over the world" if self.handle is None else "native group"
        return f"Group(members={self.members}, index={self.index}, {how})"


class GroupComm:
    """The groups of one process (logical device ``device``) on one mesh, and the collectives
    on them through the backend's group objects."""

    def __init__(self, be: Primitives, mesh: Mesh, device: int, chain: Chain) -> None:
        self.be = be
        #: the framework's array operations
        self.xp = be.arrays()
        self.mesh = mesh
        self.device = device
        self.native = be.native_primitives
        self._groups: dict[tuple[str, ...], Group] = {}
        self._world: ProcessGroup | None = None
        self._can_split: bool | None = None if "split" in self.native else False
        #: this process's chain of collectives, on a lazy backend (shared by every mesh)
        self.chain = chain

    # -- groups -----------------------------------------------------------------------------------
    def group(self, axes: tuple[str, ...]) -> Group:
        """This process's group along ``axes`` (made on first use, by every process)."""
        try:
            return self._groups[axes]
        except KeyError:
            pass
        rows = self.mesh.groups_array(axes)
        row = int(np.flatnonzero((rows == self.device).any(axis=1))[0])
        members = tuple(int(d) for d in rows[row])
        handle: ProcessGroup | None = None
        if len(members) > 1 and self._can_split is not False:
            handle = self.be.split_group(self.mesh, axes, rows, row)
            self._can_split = handle is not None
        made = self._groups[axes] = Group(members, members.index(self.device), handle)
        return made

    @property
    def can_split(self) -> bool | None:
        """Whether this process's groups are the framework's own (split) groups: True or False
        once a group of several members has been made, None before."""
        return self._can_split

    def world(self) -> ProcessGroup:
        """The backend's group of every process."""
        if self._world is None:
            self._world = self.be.world_group()
        return self._world

    # -- the primitives, native or built ---------------------------------------------------------
    def run(self, primitive: Callable[..., Any], x: Any, *args: Any) -> Any:
        """One collective primitive; on a lazy backend, after the previous one. Processes may
        build different graphs around the same collectives (a member that receives nothing in
        a permutation holds zeros), and a lazy framework walks each graph in its own order:
        without the chain, two processes could pair one's all-gather with another's."""
        if not self.be.lazy:
            return primitive(x, *args)
        chain = self.chain
        if chain.last is not None:
            x = self.xp.after(x, chain.last)
        chain.last = out = primitive(x, *args)
        return out

    def bound(self, primitive: Callable[..., Any], *args: Any) -> Callable[[Any], Any]:
        """``lambda x: self.run(primitive, x, *args)``, with the chain's test made once (a
        step's reductions call this function, not :meth:`run`)."""
        if not self.be.lazy:
            return lambda x: primitive(x, *args)
        after = self.xp.after
        chain = self.chain

        def chained(x: Any) -> Any:
            last = chain.last
            if last is not None:
                x = after(x, last)
            chain.last = out = primitive(x, *args)
            return out

        return chained

    def gather_members(self, x: Any, g: Group) -> Any:
        """The members' ``x`` stacked on dim 0, in member order."""
        if g.handle is not None:
            return self.run(g.handle.all_gather, x)
        every = self.run(self.world().all_gather, x)
        return self.xp.take(every, list(g.members))

    def row(self, x: Any, i: int) -> Any:
        """``x[i]`` along dim 0 (the dim dropped)."""
        return self.xp.take(x, [i]).reshape(tuple(x.shape[1:]))

    def all_reduce(self, x: Any, g: Group, op: str) -> Any:
        """``op`` (sum/max/min) of the members' ``x``."""
        if g.size == 1:
            return x
        if g.handle is not None:
            return self.run(g.handle.all_reduce, x, op)
        return self.xp.reduce(self.gather_members(x, g), op)

    def reduce_scatter(self, x: Any, g: Group) -> Any:
        """``x`` of shape (n, ...): the sum over members of their ``x[my index]``."""
        if g.size == 1:
            return self.row(x, 0)
        if g.handle is not None and "reduce_scatter" in self.native:
            return self.run(g.handle.reduce_scatter, x)
        total = self.all_reduce(x, g, "sum")
        return self.row(total, g.index)

    def all_to_all(self, x: Any, g: Group) -> Any:
        """``x`` of shape (n, ...): ``y[j]`` = member j's ``x[my index]``."""
        if g.size == 1:
            return x
        if g.handle is not None and "all_to_all" in self.native:
            return self.run(g.handle.all_to_all, x)
        every = self.gather_members(x, g)  # (n, n, ...): every[j] = member j's x
        return self.row(self.xp.moveaxis(every, 1, 0), g.index)

    def permute(self, x: Any, g: Group, sources: tuple[int | None, ...]) -> Any:
        """Member ``sources[i]``'s ``x`` on member i (zeros where None)."""
        if g.handle is not None and "permute" in self.native:
            return self.run(g.handle.permute, x, sources)
        src = sources[g.index]
        every = self.gather_members(x, g)
        if src is None:
            return self.xp.after(self.xp.zeros_like(x), every)
        return self.row(every, src)

    def broadcast(self, x: Any, g: Group, root: int) -> Any:
        """Member ``root``'s ``x`` on every member."""
        if g.size == 1:
            return x
        if g.handle is not None and "broadcast" in self.native:
            return self.run(g.handle.broadcast, x, root)
        return self.all_reduce(x if g.index == root else self.xp.zeros_like(x), g, "sum")

    # -- the same along a dim of the block --------------------------------------------------------
    def _stacked_to(self, stacked: Any, dim: int, tiled: bool) -> Any:
        """(n, *s) -> the pieces stacked at ``dim``, or concatenated along it when tiled."""
        moved = self.xp.moveaxis(stacked, 0, dim)
        if not tiled:
            return moved
        shape = tuple(moved.shape)
        return moved.reshape(shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2 :])

    def _split_to_front(self, x: Any, dim: int, n: int, tiled: bool) -> Any:
        """Dim ``dim`` split into n blocks (tiled) or taken as n entries, moved to the front."""
        shape = tuple(x.shape)
        if tiled:
            x = x.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1 :])
        return self.xp.moveaxis(x, dim, 0)

    def all_gather_dim(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        """The members' ``x`` along ``dim`` (stacked there, or concatenated when tiled)."""
        g = self.group(axes)
        return self._stacked_to(self.gather_members(x, g), dim, tiled)

    def reduce_scatter_dim(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        """The sum over members of their block of ``x`` along ``dim`` that is this one's."""
        g = self.group(axes)
        return self.reduce_scatter(self._split_to_front(x, dim, g.size, tiled), g)

    def all_to_all_dim(
        self, x: Any, axes: tuple[str, ...], split: int, concat: int, tiled: bool
    ) -> Any:
        """``x`` split along ``split``, block j to member j; what arrives along ``concat``."""
        g = self.group(axes)
        y = self.all_to_all(self._split_to_front(x, split, g.size, tiled), g)
        return self._stacked_to(y, concat, tiled)

    def own_block(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        """This device's block of dim ``dim`` of ``x`` (no communication)."""
        g = self.group(axes)
        return self.row(self._split_to_front(x, dim, g.size, tiled), g.index)
