"""The per-process SPMD engine: ``shard_map`` for frameworks that run one device per process.

torch, MLX and third-party backends whose processes each hold one device of the mesh derive
from :class:`ProcessBackend` and supply a few primitives on a group of processes (all-reduce,
all-gather, and where the framework has them reduce-scatter, all-to-all, permute, broadcast,
splitting a group) plus array glue. Everything else lives here, once: cutting arguments into
blocks, pytrees, assembling results, the collectives with ``jax.lax``'s meaning (member order
along the axis index, tuple axes), collectives the framework lacks (built from all-gather),
groups a framework cannot split (emulated over the world), and the gradient rules.

Gradients follow the global function the program computes, with one of JAX's two sets of rules:

- typed (JAX's ``check_vma``), where the backend can watch every operation the function runs
  (torch's ``TorchFunctionMode``): each value carries the axes along which it varies; where an
  invariant value meets a varying one, the engine inserts ``pvary`` (identity forward, psum
  backward), so ``psum`` transposes to nothing, inputs need no boundary reduction and an output
  must be invariant along the axes its spec leaves out (checked, as JAX does);
- untyped (JAX's ``check_vma=False``) elsewhere (MLX has no such hook): every collective
  transposes to its adjoint collective (``psum`` to ``psum``, ``all_gather`` to
  ``psum_scatter``, ``all_to_all`` to the reverse ``all_to_all``, ``ppermute`` to the inverse
  permutation, ``pbroadcast`` to a sum at the source); an input replicated over some axes gets
  its gradient summed over them; an output replicated over some axes counts once (its cotangent
  is divided by their size).

Both give the numbers of ``jax.grad``; the typed rules move no more bytes than JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .backend import Backend
from .errors import LayoutError, MeshMismatchError, UnsupportedError
from .layout import Layout
from .mesh import Mesh
from .program import AxisEnv, Body, Program, SpecTree
from .spec import PartitionSpec

__all__ = ["ENGINE_REQUIRED", "PRIMITIVES", "Group", "ProcessAxisEnv", "ProcessBackend"]

#: The primitives a per-process backend may implement natively (``native_primitives``);
#: ``all_reduce`` and ``all_gather`` are required, the engine builds the others from them.
PRIMITIVES: dict[str, str] = {
    "all_reduce": "group_all_reduce(x, group, op): op in sum/max/min over the members",
    "all_gather": "group_all_gather(x, group): the members' x stacked on a new dim 0",
    "reduce_scatter": "group_reduce_scatter(x, group): sum over members of x[my index]",
    "all_to_all": "group_all_to_all(x, group): y[j] = member j's x[my index]",
    "permute": "group_permute(x, group, sources): member sources[i]'s x (None: zeros)",
    "broadcast": "group_broadcast(x, group, root): member root's x",
    "split": "split_group(mesh, axes, rows, row): a group per row, this process's returned",
}

_PRIMITIVE_HOOK: dict[str, str] = {
    p: ("split_group" if p == "split" else f"group_{p}") for p in PRIMITIVES
}

#: What a :class:`ProcessBackend` implements for the engine to give it ``shard_map``.
ENGINE_REQUIRED: tuple[str, ...] = (
    "process_index",
    "world_group",
    "group_all_reduce",
    "group_all_gather",
    "as_array",
    "moveaxis",
    "take",
    "reduce_stack",
    "zeros_like",
    "local_block",
    "wrap_result",
)

_REQUIRED_PRIMITIVES = frozenset({"all_reduce", "all_gather"})

_REDUCE = ("sum", "max", "min")


def _engine_base(cls: type) -> Any:
    # ProcessBackend itself, found through the MRO (its name is unbound while it is created)
    return next(c for c in cls.__mro__ if c.__dict__.get("_is_engine_base"))


class Group:
    """This process's communication group along some axes: ``members`` (logical device ids)
    in the order of their index along the axes, this process's ``index`` among them, and the
    backend's ``handle`` (None: emulated over the world group)."""

    __slots__ = ("handle", "index", "members", "size")

    def __init__(self, members: tuple[int, ...], index: int, handle: Any) -> None:
        self.members = members
        self.index = index
        self.size = len(members)
        self.handle = handle

    def __repr__(self) -> str:
        how = "emulated over the world" if self.handle is None else "native group"
        return f"Group(members={self.members}, index={self.index}, {how})"


class ProcessBackend(Backend):
    """A backend whose processes each run one device (logical device id = process index).

    Override the ``group_*`` primitives named in :attr:`native_primitives` (members of a group
    handle come in the order :meth:`split_group` was given them) and the array glue; the
    engine provides :meth:`shard_map` and the collectives.
    """

    #: primitives of :data:`PRIMITIVES` this backend implements; the engine builds the others
    native_primitives: ClassVar[frozenset[str]] = frozenset({"all_reduce", "all_gather"})
    #: whether :meth:`typing` can watch the function's operations (JAX's check_vma rules)
    typed: ClassVar[bool] = False
    #: whether collectives run when their result is evaluated rather than when called (MLX):
    #: the engine then chains them (each one's input depends on the previous one's result), so
    #: every process runs them in program order, whatever order its graph would be walked in
    lazy: ClassVar[bool] = False
    _is_engine_base: ClassVar[bool] = True

    @classmethod
    def implements(cls, hook: str) -> bool:
        """``shard_map`` counts as implemented once the engine's required primitives are."""
        if hook == "shard_map" and cls.shard_map is _engine_base(cls).shard_map:
            return not cls._engine_missing()
        return super().implements(hook)

    @classmethod
    def _engine_missing(cls) -> list[str]:
        base = _engine_base(cls)
        return [h for h in ENGINE_REQUIRED if getattr(cls, h) is getattr(base, h)]

    @classmethod
    def contract_problems(cls) -> list[str]:
        problems = super().contract_problems()
        unknown = sorted(set(cls.native_primitives) - set(PRIMITIVES))
        if unknown:
            problems.append(
                f"native_primitives names unknown primitives {unknown}; known: {sorted(PRIMITIVES)}"
            )
        # all_reduce and all_gather are required primitives, checked with the others below
        for prim in sorted(set(cls.native_primitives) & set(PRIMITIVES) - _REQUIRED_PRIMITIVES):
            hook = _PRIMITIVE_HOOK[prim]
            if getattr(cls, hook) is getattr(ProcessBackend, hook):
                problems.append(f"lists {prim!r} in native_primitives but implements no {hook}")
        missing = cls._engine_missing()
        if 0 < len(missing) < len(ENGINE_REQUIRED) and cls.shard_map is ProcessBackend.shard_map:
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

    def world_group(self) -> Any:
        """The handle of the group of every process, members in rank order."""
        raise NotImplementedError

    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        """Called by every process of ``mesh`` together: one group per row of ``rows``
        (``mesh.groups_array(axes)``: logical ids, members in the order given), returning the
        handle of row ``row`` (this process's); None if the framework cannot make one."""
        raise NotImplementedError

    def group_cache_key(self) -> Any:
        """Groups stay valid while this is unchanged (e.g. the world group object)."""
        return None

    # -- primitives on a group handle ----------------------------------------------------------
    def group_all_reduce(self, x: Any, group: Any, op: str) -> Any:
        raise NotImplementedError

    def group_all_gather(self, x: Any, group: Any) -> Any:
        raise NotImplementedError

    def group_reduce_scatter(self, x: Any, group: Any) -> Any:
        raise NotImplementedError

    def group_all_to_all(self, x: Any, group: Any) -> Any:
        raise NotImplementedError

    def group_permute(self, x: Any, group: Any, sources: tuple[int | None, ...]) -> Any:
        raise NotImplementedError

    def group_broadcast(self, x: Any, group: Any, root: int) -> Any:
        raise NotImplementedError

    # -- array glue ---------------------------------------------------------------------------
    def as_array(self, value: Any) -> Any:
        """``value`` (an array, or a Python/numpy number or array) as the framework's array."""
        raise NotImplementedError

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        raise NotImplementedError

    def take(self, x: Any, index: list[int]) -> Any:
        """``x[index]`` along dim 0 for a list of indices."""
        raise NotImplementedError

    def reduce_stack(self, x: Any, op: str) -> Any:
        """``op`` (sum/max/min) over dim 0."""
        raise NotImplementedError

    def zeros_like(self, x: Any) -> Any:
        raise NotImplementedError

    def to_host(self, x: Any) -> np.ndarray:
        """``x`` as a numpy array (used by the checked mode)."""
        return np.asarray(x)

    def after(self, x: Any, done: Any) -> Any:
        """``x``, computed only after ``done`` (lazy frameworks drop a collective whose result
        is unused on one process, and its peers would wait for it forever)."""
        return x

    def typing(self, env: ProcessAxisEnv) -> Any:
        """With :attr:`typed`: a context manager under which every operation the function runs
        tags its array results with the union of its array arguments' :meth:`vma_of`, and
        passes each argument that needs a gradient and lacks some of those axes through
        ``env.pvary`` first (JAX's implicit pvary)."""
        raise NotImplementedError

    def vma_of(self, x: Any) -> frozenset[str]:
        """The axes along which ``x`` varies (empty: untagged, invariant everywhere)."""
        return frozenset()

    def tag(self, x: Any, vma: frozenset[str]) -> Any:
        """``x`` tagged as varying along ``vma``; returns ``x``."""
        return x

    def needs_grad(self, x: Any) -> bool:
        """Whether a gradient may flow through ``x`` (False lets the engine skip its rules)."""
        return True

    def untyped(self, fn: Callable[[Any], Any], x: Any) -> Any:
        """``fn(x)`` unwatched by :meth:`typing` (the engine's own operations: it tags their
        results itself)."""
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

    def forget_pending(self) -> None:
        """Drop the engine's references to collective results (a lazy backend's chain), e.g.
        before the framework's runtime shuts down: an unevaluated result may hold a group."""
        for env in self.__dict__.get("_axis_envs", {}).values():
            env._last = None

    def axis_env(self, mesh: Mesh) -> ProcessAxisEnv:
        """The (cached) collectives of this process on ``mesh``."""
        key = (self.group_cache_key(), mesh)
        envs: dict[Any, ProcessAxisEnv] = self.__dict__.setdefault("_axis_envs", {})
        env = envs.get(key)
        if env is None:
            device = self.process_index()
            if not (mesh.device_ids == device).any():
                raise MeshMismatchError(
                    f"process {device} is not a device of {mesh!r}; shard_map runs on the "
                    "mesh's processes: call it there only"
                )
            env = envs[key] = ProcessAxisEnv(self, mesh, device)
        return env


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
        self._shapes: dict[tuple[Layout, tuple[int, ...]], tuple[int, ...]] = {}

    def __call__(self, *args: Any) -> Any:
        import optree

        leaves, treedef = optree.tree_flatten(args)  # type: ignore[arg-type,var-annotated]
        return self.run_flat(leaves, treedef, self.ins.for_leaves(args, treedef))

    def run_flat(self, leaves: list[Any], treedef: Any, layouts: tuple[Layout | None, ...]) -> Any:
        """The program on the arguments' leaves (of tree ``treedef``) laid out as ``layouts``."""
        import optree

        env = self.env
        if env is None:
            env = self.env = self.be.axis_env(self.mesh)
            self.be.prepare_program(self.mesh, self.ins.layouts + self.outs.layouts)
        env.checked, env.calls = self.body.checked, 0
        env._last = None  # a chain starts with each call (and never reaches into mx.compile)
        blocks = [env.enter(leaf, lay) for leaf, lay in zip(leaves, layouts)]
        args = optree.tree_unflatten(treedef, blocks)
        if env.typed:
            with self.be.typing(env):
                _, out_leaves, out_def, out_layouts = self.body.flat(env, *args)
        else:
            _, out_leaves, out_def, out_layouts = self.body.flat(env, *args)
        wrapped = []
        for i, (block, layout) in enumerate(zip(out_leaves, out_layouts)):
            block = env.leave(block, layout, i)
            key = (layout, tuple(block.shape))
            shape = self._shapes.get(key)
            if shape is None:
                shape = self._shapes[key] = layout.global_shape(key[1])
            wrapped.append(self.be.wrap_result(block, layout, shape))
        return optree.tree_unflatten(out_def, wrapped)


_OPS = (
    "psum",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pbroadcast",
)
_DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int32",
    "int64",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
)
_FIELDS = ("operation", "axes", "dtype", "shape", "parameters")
_MAX_DIMS = 8


def _describe(op: str, axes: tuple[str, ...], mesh: Mesh, x: Any, params: object) -> np.ndarray:
    """A collective call as int64s: operation, axes (mesh positions), dtype, ndim, the first
    dims, a crc of the rest and of the parameters: equal on every process that agrees."""
    import zlib

    shape = tuple(int(n) for n in x.shape)
    dtype = str(x.dtype).rsplit(".", 1)[-1]
    code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES) + zlib.crc32(dtype.encode())
    where = [mesh.axis_names.index(a) for a in axes] + [-1] * (mesh.ndim - len(axes))
    dims = list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    rest = zlib.crc32(repr((shape[_MAX_DIMS:], params)).encode())
    return np.array([_OPS.index(op), code, len(shape), rest, *where, *dims], dtype=np.int64)


def _field(row: np.ndarray, name: str) -> tuple[int, ...]:
    ndim_mesh = len(row) - 4 - _MAX_DIMS
    parts = {
        "operation": row[0:1],
        "dtype": row[1:2],
        "parameters": row[3:4],
        "axes": row[4 : 4 + ndim_mesh],
        "shape": np.concatenate([row[2:3], row[4 + ndim_mesh :]]),
    }
    return tuple(int(v) for v in parts[name])


def _explain(row: np.ndarray, mesh: Mesh) -> str:
    """A descriptor row in words: ``psum over ('tp',) of float32 (4, 3)``."""
    axes = tuple(mesh.axis_names[i] for i in _field(row, "axes") if i >= 0)
    ndim, *dims = _field(row, "shape")
    shape = tuple(dims[: min(ndim, _MAX_DIMS)]) + (("...",) if ndim > _MAX_DIMS else ())
    code = int(row[1])
    dtype = _DTYPES[code] if code < len(_DTYPES) else "another dtype"
    return f"{_OPS[int(row[0])]} over {axes} of {dtype} {shape}"


def _replicated_axes(layout: Layout) -> tuple[str, ...]:
    """Mesh axes of size > 1 along which ``layout`` says the value is the same."""
    used = set(layout.spec.axes()) | set(layout.spec.partial)
    return tuple(
        a for a in layout.mesh.axis_names if a not in used and layout.mesh.axis_size(a) > 1
    )


class ProcessAxisEnv(AxisEnv):
    """The collectives of one process on one mesh, from its backend's primitives, with their
    gradient rules."""

    def __init__(self, be: ProcessBackend, mesh: Mesh, device: int) -> None:
        super().__init__(mesh, device)
        self.be = be
        self.native = be.native_primitives
        self.typed = be.typed
        self.checked = False  # set per run by the program (shard_map(checked=...))
        self.calls = 0
        self._groups: dict[tuple[str, ...], Group] = {}
        self._world: Group | None = None
        self._can_split: bool | None = None if "split" in self.native else False
        self._fns: dict[Any, Callable[[Any], Any]] = {}
        #: a collective's function with its rule, per (axes, op) or (axes, perm)
        self._collectives: dict[tuple[tuple[str, ...], Any], Callable[[Any], Any]] = {}
        self._in: dict[Layout, Any] = {}
        self._out: dict[Layout, int] = {}
        self._last: Any = None  # the latest collective's result (lazy backends)
        self._whole = Layout(mesh, PartitionSpec())  # an array under a None in_spec

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
        handle = None
        if len(members) > 1 and self._can_split is not False:
            handle = self.be.split_group(self.mesh, axes, rows, row)
            self._can_split = handle is not None
        made = self._groups[axes] = Group(members, members.index(self.device), handle)
        return made

    def world(self) -> Any:
        if self._world is None:
            self._world = self.be.world_group()
        return self._world

    # -- primitives, native or built -----------------------------------------------------------
    def _run(self, primitive: Callable[..., Any], x: Any, *args: Any) -> Any:
        """One collective primitive; on a lazy backend, after the previous one. Processes may
        build different graphs around the same collectives (a member that receives nothing in
        a permutation holds zeros), and a lazy framework walks each graph in its own order:
        without the chain, two processes could pair one's all-gather with another's."""
        if not self.be.lazy:
            return primitive(x, *args)
        if self._last is not None:
            x = self.be.after(x, self._last)
        self._last = out = primitive(x, *args)
        return out

    def _gather_members(self, x: Any, g: Group) -> Any:
        """The members' ``x`` stacked on dim 0, in member order."""
        if g.handle is not None:
            return self._run(self.be.group_all_gather, x, g.handle)
        every = self._run(self.be.group_all_gather, x, self.world())
        return self.be.take(every, list(g.members))

    def _row(self, x: Any, i: int) -> Any:
        """``x[i]`` along dim 0 (the dim dropped)."""
        return self.be.take(x, [i]).reshape(tuple(x.shape[1:]))

    def all_reduce_raw(self, x: Any, g: Group, op: str) -> Any:
        if g.size == 1:
            return x
        if g.handle is not None:
            return self._run(self.be.group_all_reduce, x, g.handle, op)
        return self.be.reduce_stack(self._gather_members(x, g), op)

    def reduce_scatter_raw(self, x: Any, g: Group) -> Any:
        """``x`` of shape (n, ...): the sum over members of their ``x[my index]``."""
        if g.size == 1:
            return self._row(x, 0)
        if g.handle is not None and "reduce_scatter" in self.native:
            return self._run(self.be.group_reduce_scatter, x, g.handle)
        total = self.all_reduce_raw(x, g, "sum")
        return self._row(total, g.index)

    def all_to_all_raw(self, x: Any, g: Group) -> Any:
        """``x`` of shape (n, ...): ``y[j]`` = member j's ``x[my index]``."""
        if g.size == 1:
            return x
        if g.handle is not None and "all_to_all" in self.native:
            return self._run(self.be.group_all_to_all, x, g.handle)
        every = self._gather_members(x, g)  # (n, n, ...): every[j] = member j's x
        return self._row(self.be.moveaxis(every, 1, 0), g.index)

    def permute_raw(self, x: Any, g: Group, sources: tuple[int | None, ...]) -> Any:
        """Member ``sources[i]``'s ``x`` on member i (zeros where None)."""
        if g.handle is not None and "permute" in self.native:
            return self._run(self.be.group_permute, x, g.handle, sources)
        src = sources[g.index]
        every = self._gather_members(x, g)
        if src is None:
            return self.be.after(self.be.zeros_like(x), every)
        return self._row(every, src)

    def broadcast_raw(self, x: Any, g: Group, root: int) -> Any:
        if g.size == 1:
            return x
        if g.handle is not None and "broadcast" in self.native:
            return self._run(self.be.group_broadcast, x, g.handle, root)
        return self.all_reduce_raw(x if g.index == root else self.be.zeros_like(x), g, "sum")

    # -- shapes around the primitives -----------------------------------------------------------
    def _stacked_to(self, stacked: Any, dim: int, tiled: bool) -> Any:
        """(n, *s) -> the pieces stacked at ``dim``, or concatenated along it when tiled."""
        moved = self.be.moveaxis(stacked, 0, dim)
        if not tiled:
            return moved
        shape = tuple(moved.shape)
        return moved.reshape(shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2 :])

    def _split_to_front(self, x: Any, dim: int, n: int, tiled: bool) -> Any:
        """Dim ``dim`` split into n blocks (tiled) or taken as n entries, moved to the front."""
        shape = tuple(x.shape)
        if tiled:
            x = x.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1 :])
        return self.be.moveaxis(x, dim, 0)

    def gather_raw(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        g = self.group(axes)
        return self._stacked_to(self._gather_members(x, g), dim, tiled)

    def scatter_raw(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        g = self.group(axes)
        return self.reduce_scatter_raw(self._split_to_front(x, dim, g.size, tiled), g)

    def a2a_raw(self, x: Any, axes: tuple[str, ...], split: int, concat: int, tiled: bool) -> Any:
        g = self.group(axes)
        y = self.all_to_all_raw(self._split_to_front(x, split, g.size, tiled), g)
        return self._stacked_to(y, concat, tiled)

    # -- differentiable collectives ---------------------------------------------------------------
    def _diff(self, key: Any, x: Any, fwd: Callable[[Any], Any], bwd: Callable[[Any], Any]) -> Any:
        """``fwd(x)`` with ``bwd`` as its transpose (a custom vjp made once per key)."""
        x = self.be.as_array(x)
        if not self.be.needs_grad(x):
            return self.be.untyped(fwd, x) if self.typed else fwd(x)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self.be.custom_vjp(fwd, bwd)
        return self.be.untyped(fn, x) if self.typed else fn(x)

    def agree(self, op: str, axes: tuple[str, ...], x: Any, params: object = ()) -> None:
        """Checked mode: every process of the mesh calls the same collective here, or every
        one raises MeshMismatchError naming the processes and what differs. One all-gather of
        a small descriptor over the whole mesh (which cannot itself wait on a disagreement
        about axes)."""
        self.calls += 1
        x = self.be.as_array(x)
        mine = _describe(op, axes, self.mesh, x, params)
        rows = self.be.to_host(
            self._gather_members(self.be.as_array(mine), self.group(self.mesh.axis_names))
        )
        rows = np.asarray(rows).reshape(len(rows), -1)
        if (rows == rows[0]).all():
            return
        members = self.group(self.mesh.axis_names).members
        said = [_explain(row, self.mesh) for row in rows]
        kinds = sorted({f for row in rows for f in _FIELDS if _field(row, f) != _field(rows[0], f)})
        groups: dict[str, list[int]] = {}
        for device, text in zip(members, said):
            groups.setdefault(text, []).append(device)
        if "parameters" in kinds:
            groups = {}
            for device, text, row in zip(members, said, rows):
                groups.setdefault(f"{text} with parameters #{int(row[3])}", []).append(device)
        detail = "; ".join(f"process(es) {devices} call {text}" for text, devices in groups.items())
        raise MeshMismatchError(
            f"collective {self.calls} of the program differs between processes ({', '.join(kinds)}"
            f"): {detail}. Every process of the mesh must call the same collectives in the same "
            "order, on the same axes, with arrays of the same dtype and shape"
        )

    def _mesh_order(self, axes: frozenset[str] | set[str]) -> tuple[str, ...]:
        return tuple(a for a in self.mesh.axis_names if a in axes)

    def pvary(self, x: Any, axes: frozenset[str] | set[str]) -> Any:
        """Typed rules: ``x`` as an operand varying along ``axes`` too (identity forward; the
        backward sums the cotangent over them). Its callers tag the results they make from it,
        so over axes of size 1 (nothing to sum) it is ``x`` itself, no graph node."""
        ordered = self._mesh_order(axes)
        if self.size(ordered) == 1:
            return x
        vma = self.be.vma_of(x) | frozenset(ordered)
        g = self.group(ordered)
        out = self._diff(
            ("pvary", ordered), x, lambda v: v, lambda ct: self.all_reduce_raw(ct, g, "sum")
        )
        return self.be.tag(out, vma)

    def _varying(self, x: Any, axes: tuple[str, ...]) -> tuple[Any, frozenset[str]]:
        """Typed rules: ``x`` as an array varying along ``axes`` (pvary where it is not), and
        its axes of variation."""
        x = self.be.as_array(x)
        have = self.be.vma_of(x)
        missing = set(axes) - have
        if missing:
            x = self.pvary(x, missing) if self.be.needs_grad(x) else x
            have = have | missing
        return x, have

    def _typed(
        self,
        key: Any,
        x: Any,
        axes: tuple[str, ...],
        fwd: Callable[[Any], Any],
        bwd: Callable[[Any], Any],
        invariant: bool,
    ) -> Any:
        """A collective under the typed rules: the input made varying along ``axes``; the
        result invariant along them (``invariant``) or varying."""
        x, have = self._varying(x, axes)
        out = self._diff(key, x, fwd, bwd)
        return self.be.tag(out, have - set(axes) if invariant else have)

    def reduce(self, x: Any, axes: tuple[str, ...], op: str) -> Any:
        if self.checked:
            self.agree("p" + op, axes, x)
        run = self._collectives.get((axes, op))
        if run is None:
            run = self._collectives[axes, op] = self._reducer(axes, op)
        return run(x)

    def _reducer(self, axes: tuple[str, ...], op: str) -> Callable[[Any], Any]:
        """``op`` over ``axes`` with its gradient rule, as one function of the block (built on
        the first call: a collective of a step runs with no per-call set-up)."""
        g = self.group(axes)

        fwd: Callable[[Any], Any]
        if g.size > 1 and g.handle is not None:  # the common case: the primitive directly
            prim, handle, run = self.be.group_all_reduce, g.handle, self._run
            if self.be.lazy:
                fwd = lambda v: run(prim, v, handle, op)  # noqa: E731
            else:
                fwd = lambda v: prim(v, handle, op)  # noqa: E731
        else:
            fwd = lambda v: self.all_reduce_raw(v, g, op)  # noqa: E731

        def no_derivative(ct: Any) -> Any:
            raise UnsupportedError(
                f"p{op}() over {axes} has no derivative (jax.lax.p{op} has none either): stop "
                "the gradient before it (torch: .detach(), MLX: mx.stop_gradient)",
                backend=self.be.name,
                capability="shard_map",
            )

        if self.typed:  # the cotangent of an invariant result is whole: nothing to move
            back = (lambda ct: ct) if op == "sum" else no_derivative
            return lambda x: self._typed(("t" + op, axes), x, axes, fwd, back, True)
        back = (lambda ct: self.all_reduce_raw(ct, g, "sum")) if op == "sum" else no_derivative
        key = ("psum" if op == "sum" else "p" + op, axes)
        return lambda x: self._diff(key, x, fwd, back)

    def _own_block(self, ct: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        """This device's block of dim ``dim`` of a gathered cotangent (no communication)."""
        g = self.group(axes)
        front = self._split_to_front(ct, dim, g.size, tiled)
        return self._row(front, g.index)

    def all_gather(
        self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool, invariant: bool
    ) -> Any:
        if self.checked:
            self.agree("all_gather", axes, x, (dim, tiled))

        def fwd(v: Any) -> Any:
            return self.gather_raw(v, axes, dim, tiled)

        if self.typed and invariant:
            return self._typed(
                ("ag_inv", axes, dim, tiled),
                x,
                axes,
                fwd,
                lambda ct: self._own_block(ct, axes, dim, tiled),
                True,
            )

        def bwd(ct: Any) -> Any:
            return self.scatter_raw(ct, axes, dim, tiled)

        if self.typed:
            return self._typed(("all_gather", axes, dim, tiled), x, axes, fwd, bwd, False)
        return self._diff(("all_gather", axes, dim, tiled), x, fwd, bwd)

    def psum_scatter(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        if self.checked:
            self.agree("psum_scatter", axes, x, (dim, tiled))

        def fwd(v: Any) -> Any:
            return self.scatter_raw(v, axes, dim, tiled)

        def bwd(ct: Any) -> Any:
            return self.gather_raw(ct, axes, dim, tiled)

        if self.typed:
            return self._typed(("psum_scatter", axes, dim, tiled), x, axes, fwd, bwd, False)
        return self._diff(("psum_scatter", axes, dim, tiled), x, fwd, bwd)

    def all_to_all(
        self, x: Any, axes: tuple[str, ...], split_axis: int, concat_axis: int, tiled: bool
    ) -> Any:
        if self.checked:
            self.agree("all_to_all", axes, x, (split_axis, concat_axis, tiled))
        key = ("all_to_all", axes, split_axis, concat_axis, tiled)

        def fwd(v: Any) -> Any:
            return self.a2a_raw(v, axes, split_axis, concat_axis, tiled)

        def bwd(ct: Any) -> Any:
            return self.a2a_raw(ct, axes, concat_axis, split_axis, tiled)

        if self.typed:
            return self._typed(key, x, axes, fwd, bwd, False)
        return self._diff(key, x, fwd, bwd)

    def ppermute(self, x: Any, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> Any:
        if self.checked:
            self.agree("ppermute", axes, x, perm)
        run = self._collectives.get((axes, perm))
        if run is None:
            run = self._collectives[axes, perm] = self._permuter(axes, perm)
        return run(x)

    def _permuter(
        self, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]
    ) -> Callable[[Any], Any]:
        """``ppermute`` by ``perm`` over ``axes`` with its rule, built on the first call."""
        g = self.group(axes)
        there: list[int | None] = [None] * g.size
        back: list[int | None] = [None] * g.size
        for src, dst in perm:
            there[dst], back[src] = src, dst
        sources, inverse = tuple(there), tuple(back)

        def fwd(v: Any) -> Any:
            return self.permute_raw(v, g, sources)

        def bwd(ct: Any) -> Any:
            return self.permute_raw(ct, g, inverse)

        key = ("ppermute", axes, perm)
        if self.typed:
            return lambda x: self._typed(key, x, axes, fwd, bwd, False)
        return lambda x: self._diff(key, x, fwd, bwd)

    def pbroadcast(self, x: Any, axes: tuple[str, ...], source: int) -> Any:
        if self.checked:
            self.agree("pbroadcast", axes, x, source)
        g = self.group(axes)

        def fwd(v: Any) -> Any:
            return self.broadcast_raw(v, g, source)

        if self.typed:  # the cotangent is whole on every device: the source keeps it
            return self._typed(
                ("pbroadcast", axes, source),
                x,
                axes,
                fwd,
                lambda ct: ct if g.index == source else self.be.zeros_like(ct),
                True,
            )

        def back(ct: Any) -> Any:
            total = self.all_reduce_raw(ct, g, "sum")
            return total if g.index == source else self.be.after(self.be.zeros_like(total), total)

        return self._diff(("pbroadcast", axes, source), x, fwd, back)

    def axis_index(self, axes: tuple[str, ...]) -> Any:
        """A Python int; under the typed rules an array tagged as varying along ``axes``."""
        index = super().axis_index(axes)
        if self.typed:
            return self.be.tag(self.be.as_array(index), frozenset(axes))
        return index

    # -- the program's edges ----------------------------------------------------------------------
    def _input_plan(
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
            used = set(layout.spec.axes()) | set(layout.spec.partial)
            plan = self._in[layout] = (
                _replicated_axes(layout),
                sharded,
                frozenset(a for a in self.mesh.axis_names if a in used),
            )
        return plan

    def enter(self, arg: Any, layout: Layout | None) -> Any:
        """This process's block of a shard_map argument. Gradient: for a global array,
        assembled whole on every process; untyped, summed over the axes the input is
        replicated on (typed: where it meets varying values, by pvary). Under a None in_spec
        (``layout`` None) a non-array passes unchanged and an array is seen whole."""
        if layout is None:
            if getattr(arg, "shape", None) is None:
                return arg
            layout = self._whole
        elif arg is None:
            return None
        block = self._enter(arg, layout)
        if self.typed:
            return self.be.tag(block, self._input_plan(layout)[2])
        return block

    def _enter(self, arg: Any, layout: Layout) -> Any:
        assert self.device is not None
        block, is_global = self.be.local_block(arg, layout, self.device)
        replicated, sharded, _ = self._input_plan(layout)
        if self.typed:
            replicated = ()
        if is_global:
            shape = tuple(int(n) for n in block.shape)
            if len(shape) < len(layout.spec):
                raise LayoutError(
                    f"a shard_map argument of shape {shape} has fewer dims than "
                    f"its in_spec {layout.spec!r}"
                )
            slices = layout.shard_slices(shape, self.device)
            if not self.be.needs_grad(block):
                return block[slices]

            def whole(ct: Any) -> Any:
                if replicated:
                    ct = self.all_reduce_raw(ct, self.group(replicated), "sum")
                for dim, axes in sharded:
                    ct = self.gather_raw(ct, axes, dim, True)
                return ct

            return self._diff(("enter", layout, shape), block, lambda v: v[slices], whole)
        if not replicated or not self.be.needs_grad(block):
            return block
        edge = self._fns.get(("replicated", replicated))
        if edge is None:  # identity; the gradient summed over the axes it is replicated on
            edge = self._fns["replicated", replicated] = self.be.custom_vjp(
                _same, lambda ct: self.all_reduce_raw(ct, self.group(replicated), "sum")
            )
        return edge(block)

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
        _, sharded, _ = self._input_plan(layout)
        if not sharded:
            return block

        def fwd(v: Any) -> Any:
            for dim, axes in sharded:
                v = self.gather_raw(v, axes, dim, True)
            return v

        def bwd(ct: Any) -> Any:
            for dim, axes in reversed(sharded):
                ct = self._own_block(ct, axes, dim, True)
            return ct

        return self._diff(("whole", layout), block, fwd, bwd)

    def leave(self, block: Any, layout: Layout, index: int = 0) -> Any:
        """A result block; replicated over some axes, it counts once in the gradient (typed:
        it must not vary along them, as JAX checks)."""
        block = self.be.as_array(block)
        if self.typed:
            varies = self.be.vma_of(block) & set(_replicated_axes(layout))
            if varies:
                axes = self._mesh_order(varies)
                raise LayoutError(
                    f"result {index} of the program varies along {axes} (it differs between "
                    f"devices there), but its out_spec {layout.spec!r} says it is the same "
                    f"along them: reduce it over {axes} (psum, pmean, all_gather with "
                    "to='invarying') or name the axes in the out_spec"
                )
            # an axis the out_spec names but the value is invariant along: the result holds
            # one copy per device there, each counted in the gradient (JAX's implicit pvary
            # at the boundary: its backward sums the copies' cotangents)
            fans = self._input_plan(layout)[2] - self.be.vma_of(block)
            if fans and self.be.needs_grad(block):
                block = self.pvary(block, fans)
            return block
        copies = self._out.get(layout)
        if copies is None:
            copies = self._out[layout] = math.prod(
                self.mesh.axis_size(a) for a in _replicated_axes(layout)
            )
        if copies == 1 or not self.be.needs_grad(block):
            return block
        edge = self._fns.get(("leave", copies))
        if edge is None:  # identity; the result counts once in the gradient
            edge = self._fns["leave", copies] = self.be.custom_vjp(_same, lambda ct: ct / copies)
        return edge(block)


def _same(v: Any) -> Any:
    return v
