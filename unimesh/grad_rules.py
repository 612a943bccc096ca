"""JAX's two gradient rule sets for the per-process engine's collectives, a table and a class
each (over :class:`unimesh.process_env.ProcessAxisEnv`), chosen once per backend
(``ProcessBackend.check_vma``).

Gradients follow the global function the program computes:

- :class:`CheckVmaEnv` (JAX's ``check_vma=True``), where the backend can watch every operation
  the function runs (torch's ``TorchFunctionMode``): each value carries its ``vma``, the axes
  along which it varies; where an invariant value meets a varying one, the engine inserts
  ``pvary`` (identity forward, psum backward), so ``psum`` transposes to nothing, inputs need
  no boundary reduction and an output must be invariant along the axes its spec leaves out
  (checked, as JAX does);
- :class:`NoCheckVmaEnv` (JAX's ``check_vma=False``) elsewhere (MLX has no such hook): every
  collective transposes to its adjoint collective (``psum`` to ``psum``, ``all_gather`` to
  ``psum_scatter``, ``all_to_all`` to the reverse ``all_to_all``, ``ppermute`` to the inverse
  permutation, ``pbroadcast`` to a sum at the source); an input replicated over some axes gets
  its gradient summed over them; an output replicated over some axes counts once (its
  cotangent is divided by their size).

Both give the numbers of ``jax.grad``; the check_vma rules move no more bytes than JAX. Each
rule set is a table, collective -> (forward, transpose) (:class:`~unimesh.process_env.Rule`),
as JAX keys ``ad.primitive_transposes`` by primitive: :data:`NO_CHECK_VMA_RULES`, and
:data:`CHECK_VMA_RULES`, the same with its differences replaced. The classes keep only the
mechanics (how a value's vma is tagged, where the plan places a psum's transpose). The
communication itself is :class:`~unimesh.groups.GroupComm`'s; checked mode is
:func:`unimesh.checked.agree`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import LayoutError
from .groups import GroupComm
from .layout import Layout
from .process_env import (
    HOST_VALUES,
    SLICES_KEPT,
    Builder,
    Fn,
    ProcessAxisEnv,
    Rule,
    global_shape,
    same,
)
from .vmaplan import replicated_axes

if TYPE_CHECKING:
    from .primitives import Primitives
    from .vmaplan import VmaPlan

__all__ = [
    "CHECK_VMA_RULES",
    "INVARIANT",
    "NO_CHECK_VMA_RULES",
    "VMA",
    "CheckVmaEnv",
    "NoCheckVmaEnv",
    "tag",
    "vma_of",
]

#: the attribute of an array holding the axes it varies along (check_vma; the backend's
#: ``vma_mode`` sets it on every operation's results)
VMA = "_unimesh_vma"
#: no axis: a value the same on every device (an untagged array)
INVARIANT: frozenset[str] = frozenset()


def vma_of(x: Any) -> frozenset[str]:
    """The axes along which ``x`` varies (untagged: none)."""
    return getattr(x, VMA, INVARIANT)


def tag(x: Any, vma: frozenset[str]) -> Any:
    """``x``, tagged as varying along ``vma``."""
    setattr(x, VMA, vma)
    return x


Axes = tuple[str, ...]


# -- the builders: each ``(env, axes, params) -> Fn``, run once per key ----------------------------
def _identity(env: ProcessAxisEnv, axes: Axes, params: Any) -> Fn:
    return same


def _psum(env: ProcessAxisEnv, axes: Axes, params: Any) -> Fn:
    return env._reduction(axes, "sum")


def _pmax(env: ProcessAxisEnv, axes: Axes, params: Any) -> Fn:
    return env._reduction(axes, "max")


def _pmin(env: ProcessAxisEnv, axes: Axes, params: Any) -> Fn:
    return env._reduction(axes, "min")


def _sum_cotangent(env: ProcessAxisEnv, axes: Axes, params: Any) -> Fn:
    return env._summer(axes)


def _no_transpose(op: str) -> Builder:
    return lambda env, axes, params: env._no_derivative(op, axes)


def _all_gather(env: ProcessAxisEnv, axes: Axes, params: tuple[int, bool]) -> Fn:
    comm, (dim, tiled) = env.comm, params
    return lambda v: comm.all_gather_dim(v, axes, dim, tiled)


def _reduce_scatter(env: ProcessAxisEnv, axes: Axes, params: tuple[int, bool]) -> Fn:
    comm, (dim, tiled) = env.comm, params
    return lambda v: comm.reduce_scatter_dim(v, axes, dim, tiled)


def _own_block(env: ProcessAxisEnv, axes: Axes, params: tuple[int, bool]) -> Fn:
    comm, (dim, tiled) = env.comm, params
    return lambda ct: comm.own_block(ct, axes, dim, tiled)


def _all_to_all(env: ProcessAxisEnv, axes: Axes, params: tuple[int, int, bool]) -> Fn:
    comm, (split_axis, concat_axis, tiled) = env.comm, params
    return lambda v: comm.all_to_all_dim(v, axes, split_axis, concat_axis, tiled)


def _all_to_all_back(env: ProcessAxisEnv, axes: Axes, params: tuple[int, int, bool]) -> Fn:
    split_axis, concat_axis, tiled = params
    return _all_to_all(env, axes, (concat_axis, split_axis, tiled))


def _permute(env: ProcessAxisEnv, axes: Axes, perm: tuple[tuple[int, int], ...]) -> Fn:
    comm = env.comm
    g = comm.group(axes)
    sources: list[int | None] = [None] * g.size
    for src, dst in perm:
        sources[dst] = src
    there = tuple(sources)
    return lambda v: comm.permute(v, g, there)


def _permute_back(env: ProcessAxisEnv, axes: Axes, perm: tuple[tuple[int, int], ...]) -> Fn:
    return _permute(env, axes, tuple((dst, src) for src, dst in perm))


def _broadcast(env: ProcessAxisEnv, axes: Axes, source: int) -> Fn:
    comm = env.comm
    g = comm.group(axes)
    return lambda v: comm.broadcast(v, g, source)


def _sum_to_source(env: ProcessAxisEnv, axes: Axes, source: int) -> Fn:
    comm, xp = env.comm, env.xp
    g = comm.group(axes)

    def back(ct: Any) -> Any:
        total = comm.all_reduce(ct, g, "sum")
        return total if g.index == source else xp.after(xp.zeros_like(total), total)

    return back


def _source_keeps(env: ProcessAxisEnv, axes: Axes, source: int) -> Fn:
    zeros_like, mine = env.xp.zeros_like, env.comm.group(axes).index == source
    return lambda ct: ct if mine else zeros_like(ct)


#: JAX's ``check_vma=False`` rules: every collective transposes to its adjoint collective.
#: op -> (forward, transpose); an invariant all_gather is an all_gather here.
NO_CHECK_VMA_RULES: dict[str, Rule] = {
    "psum": Rule(_psum, _sum_cotangent),
    "pmax": Rule(_pmax, _no_transpose("pmax")),
    "pmin": Rule(_pmin, _no_transpose("pmin")),
    "all_gather": Rule(_all_gather, _reduce_scatter),
    "all_gather_invariant": Rule(_all_gather, _reduce_scatter),
    "psum_scatter": Rule(_reduce_scatter, _all_gather),
    "all_to_all": Rule(_all_to_all, _all_to_all_back),
    "ppermute": Rule(_permute, _permute_back),
    "pbroadcast": Rule(_broadcast, _sum_to_source),
}

#: JAX's ``check_vma=True`` rules: the check_vma=False table with its differences. The
#: cotangent of an invariant result is whole on every device: psum's passes through, an
#: invariant all_gather's gives this device its own block, pbroadcast's stays at the source;
#: ``pvary`` (identity) sums its cotangent.
CHECK_VMA_RULES: dict[str, Rule] = {
    **NO_CHECK_VMA_RULES,
    "psum": Rule(_psum, _identity),
    "all_gather_invariant": Rule(_all_gather, _own_block),
    "pbroadcast": Rule(_broadcast, _source_keeps),
    "pvary": Rule(_identity, _sum_cotangent),
}


class NoCheckVmaEnv(ProcessAxisEnv):
    """JAX's ``check_vma=False`` rules: every collective transposes to its adjoint; inputs
    replicated over some axes sum their gradient over them; a replicated output counts once."""

    check_vma = False
    rules = NO_CHECK_VMA_RULES

    def __init__(self, be: Primitives, comm: GroupComm) -> None:
        super().__init__(be, comm)
        self._out: dict[Layout, int] = {}
        #: per argument layouts (by identity, the tuple kept): each input's replicated axes
        self._edges: dict[int, tuple[tuple[Layout | None, ...], tuple[Any, ...]]] = {}

    def _bind(self, op: str, axes: tuple[str, ...], params: Any) -> Fn:
        """The table's pair as a custom vjp where the block may carry a gradient (the step's
        every reduction comes here: no engine call between it and the forward otherwise)."""
        fwd, back = self._pair(op, axes, params)
        key = (op, axes, params)
        needs_grad, as_array = self.xp.needs_grad, self.xp.asarray

        def run(x: Any) -> Any:
            if isinstance(x, HOST_VALUES):
                x = as_array(x)
            if not needs_grad(x):
                return fwd(x)
            return self._vjp(key, fwd, back)(x)

        return run

    def _placed(self, x: Any, axes: tuple[str, ...], op: str, plan: VmaPlan, site: int) -> Any:
        if op != "psum" or not plan.exact:
            return None
        back = plan.sum_axes(site, axes)
        rule = self.rules["psum"]
        fwd = rule.forward(self, axes, ())
        x = self._array(x)
        if not self.xp.needs_grad(x) or (not back and self.be.sum_derivative_is_identity):
            return fwd(x)  # no rule: the framework's own derivative is the transpose
        # the transpose sums only along the axes where the cotangent can differ (vmaplan)
        bwd = rule.transpose(self, back, ()) if back else same
        return self._vjp(("placed psum", axes, back), fwd, bwd)(x)

    def axis_index(self, axes: tuple[str, ...]) -> Any:
        if self.plan is not None:
            self._visit("axis_index", axes)
        return super().axis_index(axes)

    def _edge(self, arg: Any, layout: Layout) -> Any:
        replicated, _, _ = self.input_plan(layout)
        plan = self.plan
        if plan is not None and replicated:
            return self._planned_edge(arg, layout, replicated, plan, self._leaf)
        block, distributed = self._block(arg, layout, replicated)
        if not distributed or not replicated or not self.xp.needs_grad(block):
            return block
        return self._replicated_edge(replicated)(block)

    def _replicated_edge(self, replicated: tuple[str, ...]) -> Fn:
        """Identity, the gradient summed over the axes the input is replicated on."""
        key = ("replicated", replicated)
        fn = self._fns.get(key)
        return fn if fn is not None else self._vjp(key, same, self._summer(replicated))

    def enter_all(self, leaves: list[Any], layouts: tuple[Layout | None, ...]) -> list[Any]:
        """:meth:`enter` of each leaf, replayed: what the edges decide for ``layouts`` (the
        program's in_spec layouts for the arguments' tree: the axes each input is replicated
        on) is looked up once per that tuple and kept; per call only what can change is asked
        (the backend's block of the argument, which moves or cuts it where it must, and
        whether it may carry a gradient). A plan (:mod:`unimesh.vmaplan`) takes the full
        path."""
        if self.plan is not None:
            return super().enter_all(leaves, layouts)
        kept = self._edges.get(id(layouts))
        if kept is None or kept[0] is not layouts:
            if len(self._edges) >= SLICES_KEPT:
                self._edges.clear()
            replicated = tuple(None if lay is None else self.input_plan(lay)[0] for lay in layouts)
            kept = self._edges[id(layouts)] = (layouts, replicated)
        local_block, needs_grad, device = self.be.local_block, self.xp.needs_grad, self.device
        assert device is not None
        out = []
        for arg, layout, rep in zip(leaves, layouts, kept[1]):
            if rep is None or arg is None:  # a None in_spec, or None: the full path
                out.append(self.enter(arg, layout))
                continue
            assert layout is not None
            got = local_block(arg, layout, device)
            block = got[0]
            if got[1]:  # a global array: cut, its gradient rule made there
                block, _ = self._block(arg, layout, rep, got)
            elif rep and needs_grad(block):
                block = self._replicated_edge(rep)(block)
            out.append(block)
        return out

    def leave_all(
        self,
        blocks: list[Any],
        layouts: tuple[Layout, ...],
        last: Any,
        shapes: dict[tuple[Layout, tuple[int, ...]], tuple[int, ...]],
    ) -> list[Any]:
        """:meth:`leave` of each result, replayed: how many copies of each result count
        (its replicated axes' sizes) and its global shape are looked up once per ``layouts``
        and block shape; per call only whether a block may carry a gradient is asked."""
        if self.plan is not None:
            return super().leave_all(blocks, layouts, last, shapes)
        be = self.be
        as_array, after, needs_grad, wrap = (
            self.xp.asarray,
            self.xp.after,
            self.xp.needs_grad,
            be.wrap_result,
        )
        copies_of = self._out
        out = []
        for block, layout in zip(blocks, layouts):
            block = as_array(block)
            if last is not None:
                block = after(block, last)
            copies = copies_of.get(layout) or self._copies(layout)
            if copies != 1 and needs_grad(block):
                block = self._vjp(("leave", copies), same, _divide(copies))(block)
            out.append(wrap(block, layout, global_shape(shapes, layout, block)))
        return out

    def _copies(self, layout: Layout) -> int:
        """How many copies of a result laid out as ``layout`` there are (the sizes of the
        axes it is replicated on), kept per layout."""
        known = self._out.get(layout)
        if known is None:
            known = self._out[layout] = math.prod(
                self.mesh.axis_size(a) for a in replicated_axes(layout)
            )
        return known

    def _planned_edge(
        self, arg: Any, layout: Layout, replicated: tuple[str, ...], plan: VmaPlan, leaf: int
    ) -> Any:
        """An input's block, its gradient rule left to :meth:`finish_edges` (the plan is
        solved from the blocks the edges make)."""
        block, _ = self._block(arg, layout, ())
        plan.edges.append((leaf, replicated))
        return block

    def finish_edges(self, plan: VmaPlan, blocks: list[Any]) -> None:
        """Once ``plan`` is solved: each input block that sums its gradient along some axes
        gets that rule (the others none)."""
        for leaf, replicated in plan.edges:
            axes = plan.input_axes(leaf, replicated)
            if axes and self.xp.needs_grad(blocks[leaf]):
                blocks[leaf] = self._vjp(("replicated", axes), same, self._summer(axes))(
                    blocks[leaf]
                )

    def leave(self, block: Any, layout: Layout, index: int = 0) -> Any:
        """A result block; replicated over some axes, it counts once in the gradient."""
        block = self.xp.asarray(block)
        plan = self.plan
        if plan is not None and plan.exact:  # only the copies along unplaced axes count
            axes = plan.copies_axes(replicated_axes(layout))
            copies = self.size(axes) if axes else 1
        else:
            copies = self._copies(layout)
        if copies == 1 or not self.xp.needs_grad(block):
            return block
        # identity; the result counts once in the gradient
        return self._vjp(("leave", copies), same, _divide(copies))(block)


def _divide(copies: int) -> Fn:
    """A result's transpose: its cotangent counted once among ``copies`` copies."""
    return lambda ct: ct / copies


class CheckVmaEnv(ProcessAxisEnv):
    """JAX's ``check_vma=True`` rules: values carry their ``vma`` (the backend tags them,
    ``vma_mode``), ``pvary`` goes where an invariant value meets a varying one, ``psum``
    transposes to nothing, and a result must be invariant along the axes its spec omits."""

    check_vma = True
    rules = CHECK_VMA_RULES
    #: the collectives whose result is invariant along their axes (JAX's vma rule for each;
    #: the others' results vary along them)
    invariant_results: ClassVar[frozenset[str]] = frozenset(
        {"psum", "pmax", "pmin", "all_gather_invariant", "pbroadcast"}
    )

    def __init__(self, be: Primitives, comm: GroupComm) -> None:
        super().__init__(be, comm)
        #: the mesh axes of size > 1: the only ones a tag names. Along an axis of size 1
        #: every value is invariant (nothing differs, a pvary sums nothing, and the out_spec
        #: check looks at axes of size > 1 only), so a tag that named it would make the
        #: backend's watcher compare and lift operands for nothing.
        self._big = frozenset(a for a in comm.mesh.axis_names if comm.mesh.axis_size(a) > 1)

    def pvary(self, x: Any, axes: frozenset[str] | set[str]) -> Any:
        """``x`` as an operand varying along ``axes`` too (identity forward; the backward sums
        the cotangent over them). Its callers tag the results they make from it, so over axes
        of size 1 (nothing to sum) it is ``x`` itself, no graph node."""
        ordered = self._mesh_order(axes & self._big)
        if not ordered:
            return x
        x = self._array(x)
        vma = vma_of(x) | frozenset(ordered)
        fn: Fn = same
        if self.xp.needs_grad(x):
            key = ("pvary", ordered, ())
            fn = self._fns.get(key) or self._vjp(key, *self._pair(*key))
        return tag(self.be.unwatched(fn, x), vma)

    def _typed(
        self, key: Any, x: Any, axes: tuple[str, ...], fwd: Fn, bwd: Fn, invariant: bool
    ) -> Any:
        """``fwd(x)`` with ``bwd`` as its transpose: the input made varying along ``axes``
        (pvary where it is not); the result invariant along them (``invariant``) or varying.
        Three crossings into the backend for a psum: needs_grad, unwatched, and the
        primitive."""
        be = self.be
        x = self._array(x)
        have = vma_of(x)
        grad = self.xp.needs_grad(x)
        missing = self._big.intersection(axes) - have
        if missing:
            if grad:
                x = self.pvary(x, missing)
            have = have | missing
        vma = have.difference(axes) if invariant else have
        return tag(be.unwatched(self._vjp(key, fwd, bwd) if grad else fwd, x), vma)

    def _bind(self, op: str, axes: tuple[str, ...], params: Any) -> Fn:
        """The table's pair, typed (:meth:`_typed`): the result invariant along ``axes`` for
        the collectives in :attr:`invariant_results`, varying along them for the others."""
        fwd, back = self._pair(op, axes, params)
        key, invariant = (op, axes, params), op in self.invariant_results
        return lambda x: self._typed(key, x, axes, fwd, back, invariant)

    def axis_index(self, axes: tuple[str, ...]) -> Any:
        """An array tagged as varying along ``axes``."""
        return tag(self.xp.asarray(super().axis_index(axes)), self._big.intersection(axes))

    def _tag(self, layout: Layout) -> frozenset[str]:
        """The tag of a block laid out as ``layout``: the axes of size > 1 it varies along."""
        return self.input_plan(layout)[2] & self._big

    def _edge(self, arg: Any, layout: Layout) -> Any:
        block, _ = self._block(arg, layout, ())
        return tag(block, self._tag(layout))

    def _plain(self, fn: Fn, x: Any) -> Any:
        return self.be.unwatched(fn, x)

    def leave(self, block: Any, layout: Layout, index: int = 0) -> Any:
        """A result block; it must not vary along the axes its out_spec omits (JAX's check)."""
        block = self.xp.asarray(block)
        varies = vma_of(block).intersection(self.input_plan(layout)[0])
        if varies:
            axes = self._mesh_order(varies)
            raise LayoutError(
                f"result {index} of the program varies along {axes} (it differs between "
                f"devices there), but its out_spec {layout.spec!r} says it is the same "
                f"along them: reduce it over {axes} (psum, pmean, all_gather with "
                "to='invarying') or name the axes in the out_spec"
            )
        # an axis the out_spec names but the value is invariant along: the result holds one
        # copy per device there, each counted in the gradient (JAX's implicit pvary at the
        # boundary: its backward sums the copies' cotangents)
        fans = self._tag(layout) - vma_of(block)
        if fans and self.xp.needs_grad(block):
            block = self.pvary(block, fans)
        return block
