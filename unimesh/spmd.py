"""The per-process SPMD engine: ``shard_map`` for frameworks that run one device per process.

torch, MLX and third-party backends whose processes each hold one device of the mesh derive
from :class:`ProcessBackend` and supply their groups of processes, objects with a few
collectives (:class:`ProcessGroup`: all-reduce, all-gather, and where the framework has them
reduce-scatter, all-to-all, permute, broadcast), splitting a group, and the array operations
(``Backend.arrays``). Everything else lives here, once: cutting arguments into blocks,
pytrees, assembling results, the collectives with ``jax.lax``'s meaning (member order along
the axis index, tuple axes), collectives the framework lacks (built from all-gather), groups a
framework cannot split (emulated over the world), and the gradient rules.

The engine's floor plan: this module holds the contract a per-process backend implements
(:class:`ProcessBackend`) and runs a program (its blocks in, its results out);
:mod:`unimesh.groups` holds the groups and the collectives on them (no gradient knowledge);
:mod:`unimesh.process_env` the collectives with their gradients (what both rule sets share) and
:mod:`unimesh.grad_rules` JAX's two rule sets, one class each (``check_vma`` or not, chosen once per
backend); :mod:`unimesh.checked` the checked mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from . import vmaplan
from .arrays import Arrays
from .backend import HOOKS, Backend
from .errors import MeshMismatchError
from .grad_rules import CheckVmaEnv, NoCheckVmaEnv
from .groups import Chain, Group, GroupComm
from .layout import Layout
from .mesh import Mesh
from .primitives import ProcessGroup
from .process_env import ProcessAxisEnv
from .program import Body, Program, SpecTree
from .vmaplan import BodyGraph

__all__ = [
    "ENGINE_REQUIRED",
    "PRIMITIVES",
    "Group",
    "ProcessAxisEnv",
    "ProcessBackend",
    "ProcessGroup",
]

#: The primitives a per-process backend may implement natively (``native_primitives``): the
#: collectives, methods of its :class:`ProcessGroup` (``all_reduce`` and ``all_gather`` are
#: required, the engine builds the others from them), and ``split``.
PRIMITIVES: dict[str, str] = {
    "all_reduce": "group.all_reduce(x, op): op in sum/max/min over the members",
    "all_gather": "group.all_gather(x): the members' x stacked on a new dim 0",
    "reduce_scatter": "group.reduce_scatter(x): sum over members of x[my index]",
    "all_to_all": "group.all_to_all(x): y[j] = member j's x[my index]",
    "permute": "group.permute(x, sources): member sources[i]'s x (None: zeros)",
    "broadcast": "group.broadcast(x, root): member root's x",
    "split": "split_group(mesh, axes, rows, row): a group per row, this process's returned",
}

#: What a :class:`ProcessBackend` implements for the engine to give it ``shard_map`` (the
#: required rows of the engine in :data:`unimesh.backend.HOOKS`), with a
#: :attr:`~ProcessBackend.group_type` that implements the required primitives.
ENGINE_REQUIRED: tuple[str, ...] = tuple(
    h.name for h in HOOKS if h.layer == "engine" and h.required == "yes"
)

_REQUIRED_PRIMITIVES = ("all_reduce", "all_gather")


def _engine_base(cls: type) -> Any:
    # ProcessBackend itself, found through the MRO (its name is unbound while it is created)
    return next(c for c in cls.__mro__ if c.__dict__.get("_is_engine_base"))


class ProcessBackend(Backend):
    """A backend whose processes each run one device (logical device id = process index).

    Return :class:`ProcessGroup` objects of :attr:`group_type` from :meth:`world_group` and
    :meth:`split_group`, implementing the collectives named in :attr:`native_primitives`, and
    override :meth:`arrays`; the engine provides :meth:`shard_map` and the collectives.
    """

    #: primitives of :data:`PRIMITIVES` this backend implements; the engine builds the others
    native_primitives: ClassVar[frozenset[str]] = frozenset({"all_reduce", "all_gather"})
    #: the class of the groups :meth:`world_group` and :meth:`split_group` return (what the
    #: engine reads, with :attr:`native_primitives`, to know which collectives it implements)
    group_type: ClassVar[type[ProcessGroup]] = ProcessGroup
    #: whether :meth:`vma_mode` can watch the function's operations: JAX's check_vma rules
    #: (:class:`unimesh.grad_rules.CheckVmaEnv`) instead of check_vma=False's
    check_vma: ClassVar[bool] = False
    #: whether collectives run when their result is evaluated rather than when called (MLX):
    #: the engine then chains them (each one's input depends on the previous one's result), so
    #: every process runs them in program order, whatever order its graph would be walked in
    lazy: ClassVar[bool] = False
    #: whether the framework's own derivative of its all-reduce (``ProcessGroup.all_reduce``
    #: with "sum") is the identity (MLX's ``all_sum``), so a psum whose transpose sums nothing
    #: needs no custom rule around it (:mod:`unimesh.vmaplan`)
    sum_derivative_is_identity: ClassVar[bool] = False
    _is_engine_base: ClassVar[bool] = True

    def __init__(self) -> None:
        #: this process's collectives per mesh (:meth:`axis_env`)
        self._axis_envs: dict[Any, ProcessAxisEnv] = {}
        #: the program order of this process's collectives on a lazy backend, every mesh's
        self._chain = Chain()

    def instance_problems(self) -> list[str]:
        if "_axis_envs" not in self.__dict__:
            name = type(self).__name__
            why = "call super().__init__() first (the engine keeps its state there)"
            return [f"{name}.__init__ does not call ProcessBackend.__init__: {why}"]
        problems = super().instance_problems()
        grads = type(self).custom_vjp is not ProcessBackend.custom_vjp
        if grads and type(self.arrays()).needs_grad is Arrays.needs_grad:
            problems.append(
                "implements custom_vjp, but its arrays() answer needs_grad with numpy's False: "
                "the engine would skip every gradient rule; give arrays() a needs_grad"
            )
        if self.lazy:
            xp = type(self.arrays())
            lacking = [h for h in ("after", "evaluate") if getattr(xp, h) is getattr(Arrays, h)]
            if lacking:
                problems.append(
                    f"declares lazy = True but its arrays() implement no "
                    f"{' or '.join(lacking)}: the engine orders a lazy framework's collectives "
                    "with after, and runs them before a reshard's sends with evaluate"
                )
        return problems

    @classmethod
    def implements(cls, hook: str) -> bool:
        """``shard_map`` counts as implemented once the engine's required primitives are."""
        if hook == "shard_map" and cls.shard_map is _engine_base(cls).shard_map:
            return not cls._engine_missing()
        return super().implements(hook)

    @classmethod
    def _engine_missing(cls) -> list[str]:
        base = _engine_base(cls)
        missing = [h for h in ENGINE_REQUIRED if getattr(cls, h) is getattr(base, h)]
        return missing + [f"group_type.{op}" for op in _REQUIRED_PRIMITIVES
                          if not cls.group_type.has(op)]  # fmt: skip

    @classmethod
    def contract_problems(cls) -> list[str]:
        problems = super().contract_problems()
        unknown = sorted(set(cls.native_primitives) - set(PRIMITIVES))
        if unknown:
            problems.append(
                f"native_primitives names unknown primitives {unknown}; known: {sorted(PRIMITIVES)}"
            )
        # all_reduce and all_gather are required primitives, checked with the others below
        for prim in sorted(set(cls.native_primitives) & set(PRIMITIVES) - {*_REQUIRED_PRIMITIVES}):
            if prim == "split":
                if cls.split_group is ProcessBackend.split_group:
                    problems.append(
                        "lists 'split' in native_primitives but implements no split_group"
                    )
            elif not cls.group_type.has(prim):
                problems.append(
                    f"lists {prim!r} in native_primitives but its group_type "
                    f"{cls.group_type.__name__} implements no {prim}"
                )
        missing = cls._engine_missing()
        every = len(ENGINE_REQUIRED) + len(_REQUIRED_PRIMITIVES)
        if 0 < len(missing) < every and cls.shard_map is ProcessBackend.shard_map:
            problems.append(
                f"implements part of the engine's primitives but not {', '.join(missing)}: "
                "shard_map needs all of them"
            )
        return problems

    # -- the process world --------------------------------------------------------------------
    def process_index(self) -> int:
        """This process's logical device id (its rank)."""
        raise NotImplementedError

    def process_devices(self, mesh: Mesh) -> tuple[int, ...]:
        """This process's one device, when the mesh has it."""
        rank = self.process_index()
        return (rank,) if bool((mesh.device_ids == rank).any()) else ()

    def world_group(self) -> ProcessGroup:
        """The group of every process (a :attr:`group_type`), members in rank order."""
        raise NotImplementedError

    def split_group(
        self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int
    ) -> ProcessGroup | None:
        """Called by every process of ``mesh`` together: one group per row of ``rows``
        (``mesh.groups_array(axes)``: logical ids, members in the order given), returning the
        group of row ``row`` (this process's, a :attr:`group_type`); None if the framework
        cannot make one."""
        raise NotImplementedError

    def group_cache_key(self) -> Any:
        """Groups stay valid while this is unchanged (e.g. the world group object)."""
        return None

    def vma_mode(self, env: ProcessAxisEnv) -> Any:
        """With :attr:`check_vma`: a context manager under which every operation the function
        runs tags its array results (:func:`unimesh.grad_rules.tag`) with the union of its array
        arguments' axes (:func:`unimesh.grad_rules.vma_of`), and passes each argument that needs a
        gradient and lacks some of those axes through ``env.pvary`` first (JAX's implicit
        pvary). None where it cannot watch the operations about to run (torch while
        ``torch.compile`` traces: its tracer does not keep the tags): the program then runs
        with JAX's check_vma=False rules, which give the same values and gradients without
        the tags (and without check_vma's refusals)."""
        raise NotImplementedError

    def unwatched(self, fn: Callable[[Any], Any], x: Any) -> Any:
        """``fn(x)`` unwatched by :meth:`vma_mode` (the engine's own operations)."""
        return fn(x)

    def custom_vjp(
        self, fwd: Callable[[Any], Any], bwd: Callable[[Any], Any]
    ) -> Callable[[Any], Any]:
        """A differentiable function of one array: ``fwd`` forward, ``bwd`` maps the output's
        cotangent to the input's. Both run collectives; neither needs to be differentiable."""
        raise NotImplementedError

    # -- arguments and results ------------------------------------------------------------------
    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]:
        """``(block, False)`` when ``arg`` is the framework's distributed array (its local
        block, laid out as ``layout``, redistributed first if needed, differentiable), or
        ``(array, True)`` for a global array the engine slices itself."""
        raise NotImplementedError

    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any:
        """This process's ``block`` of a result laid out as ``layout``, of global ``shape``,
        as the framework's distributed array."""
        raise NotImplementedError

    def prepare_program(self, mesh: Mesh, layouts: tuple[Layout, ...]) -> None:
        """Called once per program on its first run, by every process (e.g. build the
        framework's mesh for the layouts)."""

    # -- the engine ------------------------------------------------------------------------------
    def shard_map(self, body: Body, mesh: Mesh, ins: SpecTree, outs: SpecTree) -> Any:
        """Runs ``body`` on this process's blocks; the engine does the rest."""
        return _Program(self, body, mesh, ins, outs)

    @contextlib.contextmanager
    def own_chain(self) -> Iterator[None]:
        """A chain of collectives of its own while a framework's compiler traces a step (a
        lazy backend's ``compile`` wraps its traced function in it; MLX: ``mx.compile``): the
        trace's collectives depend on nothing outside it, and the traced arrays they leave in
        the chain do not leak out; the caller's chain resumes after (not ordered with the
        trace's collectives)."""
        chain = self._chain
        saved = chain.last, chain.depth
        chain.last, chain.depth = None, 0
        try:
            yield
        finally:
            chain.last, chain.depth = saved

    def settle(self, arrays: Sequence[Any]) -> None:
        """Before communication that runs as it is called (a reshard's sends and receives on
        a lazy backend), on every process alike: this thread's pending collectives (the
        chain, so in program order), then what ``arrays`` are computed from. Else a process
        whose first send evaluates a collective left in its graph waits there for a peer that
        is already waiting on a receive from it."""
        if not self.lazy:
            return
        last, evaluate = self._chain.last, self.arrays().evaluate
        if last is not None:
            evaluate([last])
        if arrays:
            evaluate(arrays)

    def forget_pending(self) -> None:
        """Drop the engine's references to collective results (a lazy backend's chain), e.g.
        before the framework's runtime shuts down: an unevaluated result may hold a group."""
        self._chain.last = None

    def axis_env(self, mesh: Mesh, check_vma: bool | None = None) -> ProcessAxisEnv:
        """The (cached) collectives of this process on ``mesh``, with the backend's rule set
        (``check_vma`` False: JAX's check_vma=False rules, whatever the backend declares)."""
        if vmaplan.TRACING.get():
            raise vmaplan.PlanError(
                "a program or a reshard inside a body being traced for its graph"
            )
        check = self.check_vma if check_vma is None else check_vma and self.check_vma
        key = (self.group_cache_key(), mesh, check)
        envs = self._axis_envs
        env = envs.get(key)
        if env is None:
            other = envs.get(key[:2] + (not check,))  # the other rule set's: the same groups
            if other is not None:
                comm = other.comm
            else:
                device = self.process_index()
                if not (mesh.device_ids == device).any():
                    raise MeshMismatchError(
                        f"process {device} is not a device of {mesh!r}; shard_map runs on the "
                        "mesh's processes: call it there only"
                    )
                comm = GroupComm(self, mesh, device, self._chain)
            rules = CheckVmaEnv if check else NoCheckVmaEnv
            env = envs[key] = rules(self, comm)
        return env

    def graph(self) -> BodyGraph | None:
        """Where a program about to run (with JAX's check_vma=False rules) should read its
        body's graph to sum its cotangents only where check_vma would
        (:mod:`unimesh.vmaplan`): the object that traces it, when the backend can give the
        graph and a gradient may be taken. Default: None (never)."""
        return None


class _Program(Program):
    """One shard_map program on a per-process backend."""

    def __init__(
        self, be: ProcessBackend, body: Body, mesh: Mesh, ins: SpecTree, outs: SpecTree
    ) -> None:
        self.be = be
        self.body = body
        self.mesh = mesh
        self.ins = ins
        self.outs = outs
        self.env: ProcessAxisEnv | None = None
        #: the gradient plan of the last call that tried to read the body's graph (its
        #: ``reason`` says why not, where it could not; None: no call tried)
        self.plan: vmaplan.VmaPlan | None = None
        self._shapes: dict[tuple[Layout, tuple[int, ...]], tuple[int, ...]] = {}

    def __call__(self, *args: Any) -> Any:
        import optree

        leaves, treedef = optree.tree_flatten(args)  # type: ignore[arg-type,var-annotated]
        return self.run_flat(leaves, treedef, self.ins.for_leaves(args, treedef))

    def run_flat(self, leaves: list[Any], treedef: Any, layouts: tuple[Layout | None, ...]) -> Any:
        """The program on the arguments' leaves (of tree ``treedef``) laid out as ``layouts``."""
        if vmaplan.TRACING.get():
            raise vmaplan.PlanError("a program inside a body being traced for its graph")
        env = self.env
        if env is None:
            env = self.env = self.be.axis_env(self.mesh)
            self.be.prepare_program(self.mesh, self.ins.layouts + self.outs.layouts)
        mode = None
        if env.check_vma:
            mode = self.be.vma_mode(env) if self.body.check_vma else None
            if mode is None:
                env = self.be.axis_env(self.mesh, check_vma=False)
        # a program inside a program's body (on any mesh) shares the env of its mesh: what
        # the caller set is put back after it
        outer = env.plan, env.checked, env.calls
        env.checked, env.calls = self.body.checked, 0
        chain = env.comm.chain
        if not chain.depth:  # a chain starts with each top-level call
            chain.last = None
        # a program inside a program's body continues the caller's chain: the caller's
        # collectives before it stay in the graph (a peer may use their results where this
        # process does not) and every process runs the two programs' collectives in one order
        graph = None if env.check_vma or self.body.manual is not None else self.be.graph()
        plan = env.plan = None if graph is None else vmaplan.VmaPlan(graph=graph)
        chain.depth += 1
        try:
            return self._run(env, mode, plan, leaves, treedef, layouts)
        finally:
            chain.depth -= 1
            env.plan, env.checked, env.calls = outer

    def _run(
        self,
        env: ProcessAxisEnv,
        mode: Any,
        plan: vmaplan.VmaPlan | None,
        leaves: list[Any],
        treedef: Any,
        layouts: tuple[Layout | None, ...],
    ) -> Any:
        import optree

        blocks = env.enter_all(leaves, layouts)
        if plan is not None:
            self.plan = plan  # the last one made, for tests and debugging
            vmaplan.trace(plan, self.be, env.mesh, env.device, self.body, blocks, treedef, layouts)
            env.finish_edges(plan, blocks)
        args = optree.tree_unflatten(treedef, blocks)
        if mode is not None:
            with mode:
                _, out_leaves, out_def, out_layouts = self.body.flat(env, *args)
        else:
            _, out_leaves, out_def, out_layouts = self.body.flat(env, *args)
        if plan is not None:
            plan.finished()
        # every collective the program issued runs, used or not: a lazy framework runs only
        # what a result depends on, and a peer waits on the one left out
        wrapped = env.leave_all(out_leaves, out_layouts, env.comm.chain.last, self._shapes)
        return optree.tree_unflatten(out_def, wrapped)
