"""The per-process engine's axis collectives, each with its gradient: :class:`ProcessAxisEnv`,
the base of JAX's two rule sets (:mod:`unimesh.grad_rules`: ``check_vma=False`` and
``check_vma=True``), of which a backend is given one (``ProcessBackend.check_vma``).

The base holds what both share: the groups, the public collectives (checked mode is
:func:`unimesh.checked.agree`), each bound once per (op, axes, params) from the rule set's
table (:attr:`ProcessAxisEnv.rules`: op -> :class:`Rule`, a forward and a transpose, as JAX
keys ``ad.primitive_transposes`` by primitive; the communication itself is
:class:`~unimesh.groups.GroupComm`'s), the custom-vjp cache, how an input enters a program and
a result leaves it. A rule set gives its table and how a pair becomes one function of the
block (:meth:`ProcessAxisEnv._bind`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from .checked import agree
from .errors import LayoutError, UnsupportedError
from .groups import Group, GroupComm
from .layout import Layout
from .program import AxisEnv
from .spec import PartitionSpec
from .vmaplan import replicated_axes, varying_axes

if TYPE_CHECKING:
    from .primitives import Primitives
    from .vmaplan import VmaPlan

__all__ = [
    "HOST_VALUES",
    "SLICES_KEPT",
    "Builder",
    "Fn",
    "ProcessAxisEnv",
    "Rule",
    "global_shape",
    "same",
]

Fn = Callable[[Any], Any]
#: how many (layout, shape) blocks of global arguments an env keeps (and argument layouts)
SLICES_KEPT = 1024
#: values that are not a framework's array: numbers, sequences and numpy
HOST_VALUES = (int, float, complex, list, tuple, np.ndarray, np.generic)


def same(v: Any) -> Any:
    return v


#: one half of a collective's rule, made once per (axes, params): ``(env, axes, params) -> Fn``
Builder = Callable[["ProcessAxisEnv", tuple[str, ...], Any], Fn]


class Rule(NamedTuple):
    """A collective's entry in a rule set's table: its forward and its transpose, each built
    once per (axes, params) for an env."""

    forward: Builder
    transpose: Builder


def global_shape(
    shapes: dict[tuple[Layout, tuple[int, ...]], tuple[int, ...]], layout: Layout, block: Any
) -> tuple[int, ...]:
    """The global shape of a result ``block`` laid out as ``layout``, kept in ``shapes``."""
    key = (layout, tuple(block.shape))
    shape = shapes.get(key)
    if shape is None:
        shape = shapes[key] = layout.global_shape(key[1])
    return shape


class ProcessAxisEnv(AxisEnv):
    """The collectives of one process on one mesh, with gradient rules: what the two rule
    sets share (checked mode, the caches, the program's edges). Each collective is checked
    (in checked mode), counted against a plan where there is one, and run by the function
    its rule set's table gives for (op, axes, params), bound once (:meth:`_bound`)."""

    #: which of JAX's rule sets this class implements
    check_vma: ClassVar[bool] = False
    #: the rule set's table: collective (``psum``, ``all_gather``, ``all_gather_invariant``,
    #: ...) -> its forward and transpose (:mod:`unimesh.grad_rules`)
    rules: ClassVar[dict[str, Rule]] = {}

    def __init__(self, be: Primitives, comm: GroupComm) -> None:
        super().__init__(comm.mesh, comm.device)
        self.be = be
        #: the framework's array operations (the groups' own)
        self.xp = comm.xp
        #: this process's groups on the mesh, shared by both rule sets' envs of that mesh
        self.comm = comm
        self.checked = False  # set per run by the program (shard_map(checked=...))
        self.calls = 0
        #: a custom vjp per key (made once: a collective of a step runs with no set-up)
        self._fns: dict[Any, Fn] = {}
        #: a collective's function with its rule, per (op, axes, params)
        self._collectives: dict[tuple[str, tuple[str, ...], Any], Fn] = {}
        self._in: dict[Layout, Any] = {}
        #: this process's block of a global argument, per (layout, global shape)
        self._slices: dict[tuple[Layout, tuple[int, ...]], tuple[slice, ...]] = {}
        self._whole = Layout(comm.mesh, PartitionSpec())  # an array under a None in_spec
        #: where this call sums its cotangents, from the body's graph (set per run by the
        #: program where the backend can give the graph; :mod:`unimesh.vmaplan`)
        self.plan: VmaPlan | None = None
        self._leaf = 0  # the argument leaf entering, while a plan is set

    # -- for backends ---------------------------------------------------------------------------
    def group(self, axes: tuple[str, ...]) -> Group:
        """This process's group along ``axes`` (the one programs use)."""
        return self.comm.group(axes)

    @property
    def can_split(self) -> bool | None:
        """See :attr:`GroupComm.can_split`."""
        return self.comm.can_split

    # -- shared by the rule sets ------------------------------------------------------------------
    def _array(self, x: Any) -> Any:
        """``x`` as the framework's array: only Python and numpy values ask the backend (an
        array's own attributes are not read: under torch's vma mode each read is an
        operation)."""
        if isinstance(x, HOST_VALUES):
            return self.xp.asarray(x)
        return x

    def _vjp(self, key: Any, fwd: Fn, bwd: Fn) -> Fn:
        """``fwd`` with ``bwd`` as its transpose (a custom vjp made once per key)."""
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self.be.custom_vjp(fwd, bwd)
        return fn

    def _check(self, op: str, axes: tuple[str, ...], x: Any, params: object = ()) -> None:
        self.calls += 1
        agree(self.comm, self.calls, op, axes, x, params)

    def _summer(self, axes: tuple[str, ...]) -> Fn:
        """A transpose that sums the cotangent over ``axes`` (the group looked up once)."""
        comm = self.comm
        g = comm.group(axes)
        return lambda ct: comm.all_reduce(ct, g, "sum")

    def _visit(self, op: str, axes: tuple[str, ...]) -> None:
        """Count a collective against the plan's trace of the body (when there is a plan)."""
        plan = self.plan
        if plan is not None:
            plan.visit(op, axes)

    def _mesh_order(self, axes: frozenset[str] | set[str]) -> tuple[str, ...]:
        return tuple(a for a in self.mesh.axis_names if a in axes)

    def _no_derivative(self, op: str, axes: tuple[str, ...]) -> Fn:
        def fail(ct: Any) -> Any:
            raise UnsupportedError(
                f"{op}() over {axes} has no derivative (jax.lax.{op} has none either): stop "
                "the gradient before it (torch: .detach(), MLX: mx.stop_gradient)",
                backend=self.be.name,
                capability="shard_map",
            )

        return fail

    def _reduction(self, axes: tuple[str, ...], op: str) -> Fn:
        """The forward of ``op`` over ``axes``: the backend's primitive directly where it has
        the group (the common case: no engine code between the step and the primitive)."""
        g = self.comm.group(axes)
        if g.size > 1 and g.handle is not None:
            return self.comm.bound(g.handle.all_reduce, op)
        comm = self.comm
        return lambda v: comm.all_reduce(v, g, op)

    # -- the collectives (AxisEnv) --------------------------------------------------------------
    def _bound(self, op: str, axes: tuple[str, ...], params: Any) -> Fn:
        """``op`` over ``axes`` with ``params``, its gradient rule included, as one function of
        the block: the rule set's table entry bound (:meth:`_bind`) on the first call, then
        one lookup."""
        key = (op, axes, params)
        run = self._collectives.get(key)
        if run is None:
            run = self._collectives[key] = self._bind(op, axes, params)
        return run

    def _pair(self, op: str, axes: tuple[str, ...], params: Any) -> tuple[Fn, Fn]:
        """(forward, transpose) of ``op`` over ``axes`` with ``params``, from the table."""
        rule = self.rules[op]
        return rule.forward(self, axes, params), rule.transpose(self, axes, params)

    def psum(self, x: Any, axes: tuple[str, ...]) -> Any:
        """A step's usual call: one lookup of the function bound once per axes. In checked
        mode, or while a plan is set, :meth:`_reduce`'s path."""
        if self.checked or self.plan is not None:
            return self._reduce(x, axes, "psum")
        run = self._collectives.get(("psum", axes, ()))
        if run is None:
            run = self._bound("psum", axes, ())
        return run(x)

    def pmax(self, x: Any, axes: tuple[str, ...]) -> Any:
        return self._reduce(x, axes, "pmax")

    def pmin(self, x: Any, axes: tuple[str, ...]) -> Any:
        return self._reduce(x, axes, "pmin")

    def _reduce(self, x: Any, axes: tuple[str, ...], op: str) -> Any:
        """``op`` (``psum``, ``pmax``, ``pmin``) over ``axes``: in checked mode the call is
        checked first; while a plan is set it is counted against the plan's trace, and the
        rule set may place its transpose where the plan says (:meth:`_placed`)."""
        if self.checked:
            self._check(op, axes, x)
        plan = self.plan
        if plan is not None:
            placed = self._placed(x, axes, op, plan, plan.visit(op, axes))
            if placed is not None:
                return placed
        return self._bound(op, axes, ())(x)

    def all_gather(
        self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool, invariant: bool
    ) -> Any:
        if self.checked:
            self._check("all_gather", axes, x, (dim, tiled))
        op = "all_gather_invariant" if invariant else "all_gather"
        if self.plan is not None:
            self._visit(op, axes)
        return self._bound(op, axes, (dim, tiled))(x)

    def psum_scatter(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        if self.checked:
            self._check("psum_scatter", axes, x, (dim, tiled))
        if self.plan is not None:
            self._visit("psum_scatter", axes)
        return self._bound("psum_scatter", axes, (dim, tiled))(x)

    def all_to_all(
        self, x: Any, axes: tuple[str, ...], split_axis: int, concat_axis: int, tiled: bool
    ) -> Any:
        params = (split_axis, concat_axis, tiled)
        if self.checked:
            self._check("all_to_all", axes, x, params)
        if self.plan is not None:
            self._visit("all_to_all", axes)
        return self._bound("all_to_all", axes, params)(x)

    def ppermute(self, x: Any, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> Any:
        if self.checked:
            self._check("ppermute", axes, x, perm)
        if self.plan is not None:
            self._visit("ppermute", axes)
        return self._bound("ppermute", axes, perm)(x)

    def pbroadcast(self, x: Any, axes: tuple[str, ...], source: int) -> Any:
        if self.checked:
            self._check("pbroadcast", axes, x, source)
        if self.plan is not None:
            self._visit("pbroadcast", axes)
        return self._bound("pbroadcast", axes, source)(x)

    # -- the rule set's ---------------------------------------------------------------------------
    def _bind(self, op: str, axes: tuple[str, ...], params: Any) -> Fn:
        """``op`` over ``axes`` with ``params`` as one function of the block: the table's
        forward, with its transpose as the gradient rule (how is the rule set's)."""
        raise NotImplementedError

    def _placed(self, x: Any, axes: tuple[str, ...], op: str, plan: VmaPlan, site: int) -> Any:
        """``op`` over ``axes`` with the transpose the plan places for collective ``site``
        (:mod:`unimesh.vmaplan`); None: the usual rule."""
        return None

    def _edge(self, block: Any, layout: Layout) -> Any:
        """A shard_map argument's block, at the program's edge."""
        raise NotImplementedError

    def leave(self, block: Any, layout: Layout, index: int = 0) -> Any:
        """A result block, at the program's edge."""
        raise NotImplementedError

    def finish_edges(self, plan: VmaPlan, blocks: list[Any]) -> None:
        """Once ``plan`` is solved, the gradient rules of the edges it decides."""

    # -- the program's edges ----------------------------------------------------------------------
    def input_plan(
        self, layout: Layout
    ) -> tuple[tuple[str, ...], tuple[tuple[int, tuple[str, ...]], ...], frozenset[str]]:
        """(axes an input is replicated over, (dim, axes) it is sharded over, axes it varies
        along)."""
        plan = self._in.get(layout)
        if plan is None:
            sharded = tuple(
                (d, (e,) if isinstance(e, str) else tuple(e))
                for d, e in enumerate(layout.spec)
                if e
            )
            plan = self._in[layout] = (replicated_axes(layout), sharded, varying_axes(layout))
        return plan

    def enter(self, arg: Any, layout: Layout | None) -> Any:
        """This process's block of a shard_map argument. Gradient: for a global array,
        assembled whole on every process (and, by the rule set, summed over the axes the input
        is replicated on). Under a None in_spec (``layout`` None) a non-array passes unchanged
        and an array is seen whole."""
        plan = self.plan
        if plan is not None:
            self._leaf = plan.entered
            plan.entered += 1
        if layout is None:
            if getattr(arg, "shape", None) is None:
                return arg
            layout = self._whole
        elif arg is None:
            return None
        return self._edge(arg, layout)

    def enter_all(self, leaves: list[Any], layouts: tuple[Layout | None, ...]) -> list[Any]:
        """Every argument leaf's block (:meth:`enter` of each; a rule set may replay what
        it decided for these layouts instead)."""
        return [self.enter(leaf, layout) for leaf, layout in zip(leaves, layouts)]

    def leave_all(
        self,
        blocks: list[Any],
        layouts: tuple[Layout, ...],
        last: Any,
        shapes: dict[tuple[Layout, tuple[int, ...]], tuple[int, ...]],
    ) -> list[Any]:
        """Every result block through :meth:`leave`, each after ``last`` (the program's last
        collective, on a lazy backend: a peer waits on every collective, used or not), as
        the backend's distributed array; ``shapes`` keeps each global shape."""
        be = self.be
        out = []
        for i, (block, layout) in enumerate(zip(blocks, layouts)):
            if last is not None:
                block = self.xp.after(self.xp.asarray(block), last)
            block = self.leave(block, layout, i)
            out.append(be.wrap_result(block, layout, global_shape(shapes, layout, block)))
        return out

    def _block(
        self,
        arg: Any,
        layout: Layout,
        replicated: tuple[str, ...],
        got: tuple[Any, bool] | None = None,
    ) -> tuple[Any, bool]:
        """(this process's block of ``arg``, whether it came from the backend's distributed
        array); a global array's block sends back the whole gradient, first summed over
        ``replicated``. ``got``: what the backend's ``local_block`` already gave for it."""
        assert self.device is not None
        block, is_global = self.be.local_block(arg, layout, self.device) if got is None else got
        if not is_global:
            return block, True
        _, sharded, _ = self.input_plan(layout)
        shape = tuple(int(n) for n in block.shape)
        if len(shape) < len(layout.spec):
            raise LayoutError(
                f"a shard_map argument of shape {shape} has fewer dims than "
                f"its in_spec {layout.spec!r}"
            )
        slices = self._slices.get((layout, shape))
        if slices is None:
            if len(self._slices) >= SLICES_KEPT:  # a program called with ever new shapes
                self._slices.clear()
            slices = self._slices[layout, shape] = layout.shard_slices(shape, self.device)
        block = self._array(block)
        if not self.xp.needs_grad(block):
            return block[slices], False
        comm = self.comm

        def whole(ct: Any) -> Any:
            if replicated:
                ct = comm.all_reduce(ct, comm.group(replicated), "sum")
            for dim, axes in sharded:
                ct = comm.all_gather_dim(ct, axes, dim, True)
            return ct

        return self._vjp(("enter", layout, shape, replicated), lambda v: v[slices], whole)(
            block
        ), False

    def whole(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any | None:
        """The global array (of ``shape``) whose block on this process is ``block`` under
        ``layout`` (of this env's mesh), gathered by collectives over the sharded dims, for a
        backend that moves a distributed array to another layout through the whole value.
        Differentiable: the whole value's cotangent, the same on every process, gives this
        block its own part (no communication). None where the layout has partial sums or
        blocks of unequal size (the backend's host path handles those; they only come from
        ``distribute``, whose blocks carry no gradient)."""
        if layout.spec.partial or layout.global_shape(tuple(block.shape)) != tuple(shape):
            return None
        _, sharded, _ = self.input_plan(layout)
        if not sharded:
            return block
        comm = self.comm

        def fwd(v: Any) -> Any:
            for dim, axes in sharded:
                v = comm.all_gather_dim(v, axes, dim, True)
            return v

        def bwd(ct: Any) -> Any:
            for dim, axes in reversed(sharded):
                ct = comm.own_block(ct, axes, dim, True)
            return ct

        block = self._array(block)
        if not self.xp.needs_grad(block):
            return self._plain(fwd, block)
        return self._plain(self._vjp(("whole", layout), fwd, bwd), block)

    def _plain(self, fn: Fn, x: Any) -> Any:
        """``fn(x)``, run as the engine's own operation (the rule set says how)."""
        return fn(x)
