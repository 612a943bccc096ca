"""JAX's ``check_vma=True`` gradient placement for a per-process backend whose arrays carry no
vma (MLX), from the body's dataflow graph.

:class:`~unimesh.grad_rules.NoCheckVmaEnv` (JAX's ``check_vma=False``) gives ``jax.grad``'s
numbers for any body, at a price in communication: every ``psum`` transposes to a ``psum``, an input
replicated along an axis sums its gradient along it, and an output replicated along an axis has
its cotangent divided by the copies. The hand-written step (Megatron's ``f``/``g``, DDP) and
JAX's ``check_vma=True`` rules sum only where a value invariant along an axis meets one that
varies along it (``pvary``). Where the backend can give the body's graph (MLX: the graph
``mx.export_function`` hands a callback, made while ``unimesh.compile`` traces a step), the
engine finds those places. It never moves more than the check_vma=False rules, and in the
usual steps what the hand-written step moves; it sums at the source where check_vma sums at
the meeting point, so where a value is reduced on its way there (``w.sum() * x``: JAX sums
a scalar, the plan the weight's gradient) it can move more than JAX.

Per mesh axis ``A``, the values invariant along ``A`` form a region. Its *sources* are the
inputs replicated along ``A`` and the collectives over ``A`` whose result is invariant along it
(``psum``); its *sinks* are the places where a region value meets a value varying along ``A``
(a pvary edge, including a collective over ``A`` taking it and an output whose spec names
``A``) and the outputs replicated along ``A`` (whose cotangent is the same on every device).
check_vma sums the cotangent along ``A`` at each pvary edge. Every operation inside the region
runs the same on all devices along ``A`` and its transpose is linear, so that sum moves back to
the sources: a source reaching only pvary edges sums its cotangent along ``A`` (an input: the
DDP all-reduce; a psum: its transpose stays a psum), and a source reaching only replicated
outputs sums nothing (a psum transposes to the identity; the output's cotangent is not divided).
A source reaching both is what the check_vma=False rules exist for: that axis keeps them, and
so does an axis where an output varies though its spec says it does not (JAX's check_vma
refuses it; the unchecked rules give it a meaning), and an axis along which an invariant
``all_gather`` or ``pbroadcast`` is a source (their check_vma transposes are not placed here).
An axis also keeps them where an array the body closes over (a constant of the graph that
may carry a gradient, e.g. a parameter read from a model rather than passed in) meets a value
varying along it: no edge can sum its gradient. Where the graph cannot be had (the body
evaluates an array, calls a framework's collective itself or another program), every axis
keeps the check_vma=False rules. A collective whose result nothing uses is not in the graph
(and adds nothing to a gradient); it still runs.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .errors import UnimeshError
from .layout import Layout
from .program import AxisEnv, Body

if TYPE_CHECKING:
    from collections.abc import Callable

    from .mesh import Mesh
    from .primitives import Primitives

__all__ = ["BodyGraph", "Graph", "PlanError", "Site", "TraceEnv", "VmaPlan", "shape_after", "trace"]

#: collectives whose result is invariant along their axes (the rest vary along them)
INVARIANT = frozenset({"psum", "pmax", "pmin", "all_gather_invariant", "pbroadcast"})
#: invariant collectives whose check_vma transpose this module does not place
_UNPLACED = frozenset({"all_gather_invariant", "pbroadcast"})


class PlanError(UnimeshError):
    """The body's graph could not be read (the engine keeps the check_vma=False rules)."""


@dataclass(frozen=True)
class Site:
    """One collective the body calls, in call order."""

    op: str
    axes: tuple[str, ...]


@dataclass
class Graph:
    """The body's dataflow: nodes are value names. ``ops`` is in topological order, each
    ``(inputs, outputs, site)`` where ``site`` is the index of the collective it stands for
    (None: an ordinary operation). ``inputs`` names each argument leaf's value (None: not an
    array); ``outputs`` each result leaf's."""

    inputs: list[str | None]
    ops: list[tuple[tuple[str, ...], tuple[str, ...], int | None]]
    outputs: list[str]
    #: names of the constants the body captured or made (invariant)
    constants: frozenset[str] = frozenset()
    #: the constants that may carry a gradient (an array the body closes over, which a
    #: transform around the program may differentiate: its sum cannot be placed)
    closed: frozenset[str] = frozenset()
    #: the collectives whose mark is in the graph (None: all); one missing is one whose
    #: result nothing uses (the trace leaves it out)
    marked: frozenset[int] | None = None


@dataclass
class VmaPlan:
    """Where one call of a program sums its cotangents. Until :meth:`solve` succeeds (and
    where it does not), every answer is the check_vma=False rules'."""

    #: axes placed by the graph (the rest keep the check_vma=False rules)
    exact: frozenset[str] = frozenset()
    #: per argument leaf: the exact axes along which its gradient is summed
    inputs: dict[int, frozenset[str]] = field(default_factory=dict)
    #: per psum site: the exact axes along which its transpose sums
    sums: dict[int, frozenset[str]] = field(default_factory=dict)
    #: the collectives the body called while it was traced (checked at each call)
    sites: list[Site] | None = None
    #: why the graph placed nothing (None once solved)
    reason: str | None = "not solved"
    at: int = 0
    entered: int = 0
    #: (argument leaf, axes it is replicated along) of the edges waiting for the solution
    edges: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)
    #: the backend's tracer of the body's graph (``ProcessBackend.graph``)
    graph: BodyGraph | None = None

    # -- the engine's questions --------------------------------------------------------------
    def input_axes(self, leaf: int, replicated: tuple[str, ...]) -> tuple[str, ...]:
        """The axes along which argument ``leaf``'s gradient is summed."""
        keep = self.inputs.get(leaf, frozenset())
        return tuple(a for a in replicated if a not in self.exact or a in keep)

    def sum_axes(self, site: int, axes: tuple[str, ...]) -> tuple[str, ...]:
        """The axes along which the transpose of psum ``site`` (over ``axes``) sums."""
        keep = self.sums.get(site, frozenset())
        return tuple(a for a in axes if a not in self.exact or a in keep)

    def copies_axes(self, replicated: tuple[str, ...]) -> tuple[str, ...]:
        """The axes over whose copies a replicated output's cotangent is divided."""
        return tuple(a for a in replicated if a not in self.exact)

    def visit(self, op: str, axes: tuple[str, ...]) -> int:
        """The index of the collective being called; checked against the traced one."""
        k = self.at
        self.at += 1
        if self.sites is not None and self.exact:
            want = self.sites[k] if k < len(self.sites) else None
            if want != Site(op, axes):
                raise PlanError(
                    f"the program's body called {op}{axes} as its collective {k}, where the "
                    f"trace of the same call (same argument shapes and layouts) called "
                    f"{want.op + str(want.axes) if want else 'none'}: a body must call the same "
                    "collectives for the same arguments (no Python state that changes between "
                    "its traces)"
                )
        return k

    # -- solving -------------------------------------------------------------------------------
    def solve(
        self,
        graph: Graph,
        sites: list[Site],
        in_vma: list[frozenset[str] | None],
        outs: list[tuple[frozenset[str], frozenset[str]]],
        axes: frozenset[str],
        fed: list[bool] | None = None,
    ) -> None:
        """Place the sums for ``graph``. ``in_vma``: per argument leaf the axes it varies
        along (None: not an array); ``outs``: per result leaf (axes its spec names, axes it
        is replicated along); ``axes``: the mesh axes of size > 1; ``fed``: per collective,
        whether it took an array (whose link to it the graph must show)."""
        vma: dict[str, frozenset[str]] = {}
        for j, name in enumerate(graph.inputs):
            if name is not None:
                v = in_vma[j]
                vma[name] = (v or frozenset()) & axes
        #: value -> axes along which it meets a value varying along them
        meets: dict[str, set[str]] = {}
        #: site -> its output names (the region sources it makes)
        made: dict[int, tuple[str, ...]] = {}

        for name in graph.constants:
            vma[name] = frozenset()  # invariant
        #: values computed from constants alone (a collective's operand must not be one)
        fixed = set(graph.constants)

        def of(name: str) -> frozenset[str]:
            try:
                return vma[name]
            except KeyError:
                raise PlanError(f"the graph uses value {name!r} before making it") from None

        for ins, outs_, site in graph.ops:
            u = frozenset().union(*(of(i) for i in ins)) if ins else frozenset()
            if site is not None and (site in made or site >= len(sites)):
                raise PlanError(f"collective {site} appears twice, or is not one of the body's")
            if all(i in fixed for i in ins):
                if site is not None and fed is not None and fed[site]:
                    raise PlanError(f"collective {site}'s operand is not in the graph")
                fixed.update(outs_)
            if site is None:
                out = u
                want = u
            else:
                s = sites[site]
                over = frozenset(s.axes) & axes
                want = u | over
                if s.op == "axis_index":
                    out = over
                elif s.op in INVARIANT:
                    out = want - over
                else:
                    out = want
                made[site] = outs_
            for i in ins:
                missing = want - of(i)
                if missing:
                    meets.setdefault(i, set()).update(missing)
            for o in outs_:
                vma[o] = out
        marked = set(range(len(sites))) if graph.marked is None else graph.marked
        if sites and not marked:
            raise PlanError("no collective of the body is marked in its graph")
        if set(made) != marked:
            lost = sorted(marked - set(made))
            raise PlanError(f"collectives {lost} of the body are not found in its graph")
        seeds: dict[str, set[str]] = {}
        unplaced: set[str] = set()
        for name, (named, replicated) in zip(graph.outputs, outs):
            w = of(name)
            unplaced |= w & replicated  # varies where its spec says it does not
            fans = (named & axes) - w
            if fans:
                meets.setdefault(name, set()).update(fans)
            if replicated - w:
                seeds.setdefault(name, set()).update(replicated - w)
        for s in sites:
            if s.op in _UNPLACED:
                unplaced |= set(s.axes)
        # backwards through the region: what each value's cotangent comes from
        reach_p = {k: set(v) for k, v in meets.items()}
        reach_s = {k: set(v) for k, v in seeds.items()}
        for ins, outs_, site in reversed(graph.ops):
            p: set[str] = set()
            s_: set[str] = set()
            for o in outs_:
                p |= reach_p.get(o, set())
                s_ |= reach_s.get(o, set())
            if not p and not s_:
                continue
            if site is not None:
                stop = frozenset(sites[site].axes) if sites[site].op in INVARIANT else frozenset()
                p, s_ = p - stop, s_ - stop  # a source along these: its input is not reached
            for i in ins:
                inside = vma[i]
                if p - inside:
                    reach_p.setdefault(i, set()).update(p - inside)
                if s_ - inside:
                    reach_s.setdefault(i, set()).update(s_ - inside)
        sources: list[tuple[str, frozenset[str]]] = []
        for name in graph.inputs:
            if name is not None:
                sources.append((name, axes - vma[name]))
        for k, names in made.items():
            if sites[k].op == "psum":  # pmax and pmin have no derivative
                for name in names:
                    sources.append((name, frozenset(sites[k].axes) & axes))
        for name in graph.closed:  # its gradient would need a sum no edge can place
            unplaced |= reach_p.get(name, set())
        both: set[str] = set()
        for name, along in sources:
            both |= along & reach_p.get(name, set()) & reach_s.get(name, set())
        exact = axes - both - unplaced
        self.exact = frozenset(exact)
        self.inputs = {
            j: frozenset(reach_p.get(name, set())) & exact
            for j, name in enumerate(graph.inputs)
            if name is not None
        }
        self.sums = {
            k: frozenset().union(*(reach_p.get(n, set()) for n in names)) & exact
            for k, names in made.items()
            if sites[k].op == "psum"
        }
        self.sites = list(sites)
        self.reason = None if exact else "every axis has a source reaching both kinds of sink"

    def finished(self) -> None:
        """At the end of the call: the body called every collective its trace did."""
        if self.sites is not None and self.exact and self.at != len(self.sites):
            raise PlanError(
                f"the program's body called {self.at} collectives, where its trace for the "
                f"same arguments called {len(self.sites)}: a body must call the same "
                "collectives for the same arguments"
            )


def shape_after(
    op: str, shape: tuple[int, ...], n: int, dims: tuple[int, ...], tiled: bool
) -> tuple[int, ...]:
    """The block shape a collective over ``n`` devices gives (JAX's meaning): ``dims`` is
    ``(dim,)`` for all_gather and psum_scatter, ``(split, concat)`` for all_to_all."""
    s = list(shape)
    if op in ("all_gather", "all_gather_invariant"):
        (d,) = dims
        if tiled:
            s[d] *= n
        else:
            s.insert(d, n)
    elif op == "psum_scatter":
        (d,) = dims
        if tiled:
            s[d] //= n
        else:
            del s[d]
    elif op == "all_to_all":
        split, concat = dims
        if tiled:
            s[split] //= n
            s[concat] *= n
        else:
            del s[split]
            s.insert(concat, n)
    return tuple(s)


#: set while a body is traced for its graph: the engine refuses to run a program then
TRACING: ContextVar[bool] = ContextVar("unimesh_vma_tracing", default=False)


class BodyGraph(Protocol):
    """What a backend that plans a program's sums from its body's graph gives
    (``ProcessBackend.graph``)."""

    def trace(self, run: Callable[[list[Any]], list[Any]], leaves: list[Any]) -> Graph:
        """The graph of ``run`` (the body on argument leaves, its result leaves as arrays)
        traced on placeholders shaped as ``leaves``' arrays (other leaves as they are), with
        each :meth:`marker` found again as the site it stands for."""
        ...

    def marker(self, site: int, x: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """While :meth:`trace` runs: an array of ``shape`` and ``dtype`` (None: an integer
        scalar) computed from ``x`` (None: from nothing) by an operation the graph shows as
        collective ``site``."""
        ...


class TraceEnv(AxisEnv):
    """The collectives while a body is traced for its graph: each is a marker the backend
    can find in the graph again (:meth:`BodyGraph.marker`), of the shape and dtype the
    collective gives; ``axis_index`` too (an array varying along its axes, where the engine
    gives an int)."""

    def __init__(self, be: Primitives, graph: BodyGraph, mesh: Mesh, device: int | None) -> None:
        super().__init__(mesh, device)
        self.be, self.graph = be, graph
        self.sites: list[Site] = []
        #: per collective: whether it took an array
        self.fed: list[bool] = []

    def _mark(
        self, op: str, axes: tuple[str, ...], x: Any, dims: tuple[int, ...] = (), tiled: bool = True
    ) -> Any:
        k = len(self.sites)
        self.sites.append(Site(op, axes))
        self.fed.append(x is not None)
        if x is None:
            return self.graph.marker(k, None, (), None)
        if not hasattr(x, "shape"):
            x = self.be.arrays().asarray(x)
        shape = shape_after(op, tuple(int(d) for d in x.shape), self.size(axes), dims, tiled)
        return self.graph.marker(k, x, shape, x.dtype)

    def psum(self, x: Any, axes: tuple[str, ...]) -> Any:
        return self._mark("psum", axes, x)

    def pmax(self, x: Any, axes: tuple[str, ...]) -> Any:
        return self._mark("pmax", axes, x)

    def pmin(self, x: Any, axes: tuple[str, ...]) -> Any:
        return self._mark("pmin", axes, x)

    def all_gather(
        self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool, invariant: bool
    ) -> Any:
        op = "all_gather_invariant" if invariant else "all_gather"
        return self._mark(op, axes, x, (dim,), tiled)

    def psum_scatter(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        return self._mark("psum_scatter", axes, x, (dim,), tiled)

    def all_to_all(
        self, x: Any, axes: tuple[str, ...], split_axis: int, concat_axis: int, tiled: bool
    ) -> Any:
        return self._mark("all_to_all", axes, x, (split_axis, concat_axis), tiled)

    def ppermute(self, x: Any, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> Any:
        return self._mark("ppermute", axes, x)

    def pbroadcast(self, x: Any, axes: tuple[str, ...], source: int) -> Any:
        return self._mark("pbroadcast", axes, x)

    def axis_index(self, axes: tuple[str, ...]) -> Any:
        return self._mark("axis_index", axes, None)


def replicated_axes(layout: Layout) -> tuple[str, ...]:
    """Mesh axes of size > 1 along which ``layout`` says the value is the same."""
    used = set(layout.spec.axes()) | set(layout.spec.partial)
    return tuple(
        a for a in layout.mesh.axis_names if a not in used and layout.mesh.axis_size(a) > 1
    )


def varying_axes(layout: Layout) -> frozenset[str]:
    """Mesh axes along which ``layout`` says the value differs (sharded or pending)."""
    used = set(layout.spec.axes()) | set(layout.spec.partial)
    return frozenset(a for a in layout.mesh.axis_names if a in used)


def trace(
    plan: VmaPlan,
    be: Primitives,
    mesh: Mesh,
    device: int | None,
    body: Body,
    blocks: list[Any],
    treedef: Any,
    layouts: tuple[Layout | None, ...],
) -> None:
    """Trace ``body`` on placeholders of ``blocks`` (the argument leaves of tree ``treedef``,
    laid out as ``layouts``) for its graph, and solve ``plan`` from it; where the graph cannot
    be had, ``plan`` keeps the check_vma=False rules and says why (:attr:`VmaPlan.reason`)."""
    import optree

    graphs = plan.graph
    assert graphs is not None, "a plan is made with the backend's graph()"
    tracer = TraceEnv(be, graphs, mesh, device)
    seen: list[tuple[Layout, ...]] = []

    def run(leaves: list[Any]) -> list[Any]:
        args = optree.tree_unflatten(treedef, leaves)
        _, outs, _, out_layouts = body.flat(tracer, *args)
        seen.append(out_layouts)
        return [be.arrays().asarray(o) for o in outs]

    token = TRACING.set(True)
    try:
        graph = graphs.trace(run, blocks)
    except Exception as exc:  # noqa: BLE001 - any failure keeps the unchecked rules, e.g. the body evaluates
        plan.reason = f"{type(exc).__name__}: {exc}"[:300]
        return
    finally:
        TRACING.reset(token)
    axes = frozenset(a for a in mesh.axis_names if mesh.axis_size(a) > 1)
    in_vma: list[frozenset[str] | None] = []
    for leaf, layout in zip(blocks, layouts):
        if not hasattr(leaf, "shape"):
            in_vma.append(None)
        else:
            in_vma.append(varying_axes(layout) if layout is not None else frozenset())
    outs = [(varying_axes(layout), frozenset(replicated_axes(layout))) for layout in seen[-1]]
    try:
        plan.solve(graph, tracer.sites, in_vma, outs, axes, tracer.fed)
    except PlanError as exc:  # solve sets nothing before it is sure
        plan.reason = str(exc)
