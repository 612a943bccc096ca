"""The backend contract as data, read by :class:`unimesh.Backend` and the docs: every hook
once (:data:`HOOKS`), the layers read off it (:data:`LAYERS`), the features a backend declares
(:data:`FEATURES`), the capabilities that follow from others (:data:`DERIVED`), what each
capability promises (:data:`CAPABILITIES`) and the concepts a backend maps to native APIs
(:data:`CONCEPTS`). Plain data: no framework, no other module of the core."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

__all__ = [
    "CAPABILITIES",
    "CONCEPTS",
    "DERIVED",
    "FEATURES",
    "HELPERS",
    "HOOKS",
    "LAYERS",
    "MOVED",
    "Hook",
    "Layer",
    "capability_hooks",
    "derive_capabilities",
    "hook_capability",
    "problems",
]


class Layer(NamedTuple):
    """One layer of the contract: each capability it gives, with the hooks that give it (all
    of them must be implemented) and what it promises. (A NamedTuple: ``dataclasses`` would
    add its import, and ``inspect``'s, to ``import unimesh``.)"""

    name: str
    required: bool
    summary: str
    hooks: dict[str, tuple[str, ...]]
    promises: dict[str, str]
    #: hooks of the layer that give no capability of their own (defaults that do nothing)
    extra_hooks: tuple[str, ...] = ()

    @property
    def all_hooks(self) -> tuple[str, ...]:
        """Every hook of the layer: those that give its capabilities, then the others."""
        return (*(h for hooks in self.hooks.values() for h in hooks), *self.extra_hooks)


class Hook(NamedTuple):
    """One row of the contract (:data:`HOOKS`): a method a backend may implement, the layer it
    belongs to, whether it is required, the capability it gives (with the other hooks of that
    capability; empty where it refines one or has a default) and what it promises."""

    name: str
    layer: str
    required: str
    capability: str
    promise: str


_T, _R, _P, _E = "translator", "runtime", "programs", "engine"

#: The contract in one table: every hook of :class:`Backend` (layers ``translator``,
#: ``runtime``, ``programs``) and of :class:`unimesh.spmd.ProcessBackend`'s engine (layer
#: ``engine``), once, in the order of ``backend.py``'s and ``spmd.py``'s sections. ``required``
#: is ``yes``, ``no`` (a default that does nothing or the obvious), or ``with X`` (needed for X).
#: :data:`LAYERS`, ``Backend.layers()``, ``contract_problems()``, ``unimesh backends`` and the
#: guide's hook table read it.
HOOKS: tuple[Hook, ...] = (
    Hook("mesh_to_native", _T, "yes", "mesh", "Mesh -> the framework's mesh object"),
    Hook("from_native", _T, "yes", "mesh", "the framework's mesh/layout/map -> the neutral one"),
    Hook("layout_to_native", _T, "no", "layout", "Layout -> the framework's sharding/layout"),
    Hook("layout_map_to_native", _T, "no", "layout_map", "LayoutMap -> the framework's map"),
    Hook("distribute", _T, "no", "distribute", "a global array laid out as a distributed one"),
    Hook("local_shards", _T, "with distribute", "distribute", "this process's blocks, by device"),
    Hook("from_local", _T, "no", "from_local", "a distributed array from this process's blocks"),
    Hook("native_blocks", _T, "no", "", "this process's blocks, unconverted (reshard, link)"),
    Hook("host_views", _T, "no", "", "its blocks as writable numpy on its memory (in-place load)"),
    Hook("owns", _T, "no", "", "whether an object is this framework's (by type, no import)"),
    Hook("describe_native", _T, "no", "", "how `unimesh convert` prints a native object"),
    Hook("native_code", _T, "no", "", "the native Python that builds a mesh or layout (porting)"),
    Hook("demo_compute", _T, "no", "", "`unimesh demo`'s check: a sharded matmul, whole"),
    Hook("model_state", _T, "no", "", "a model object's named arrays (save/load of a model)"),
    Hook("model_assign", _T, "with model_state", "", "loaded arrays written into a model"),
    Hook("prepare_devices", _R, "no", "", "ask for N devices in this process, before start"),
    Hook("process_devices", _R, "no", "", "the ids of a mesh's devices this process holds"),
    Hook("initialize", _R, "with multi_process", "", "start the runtime: (process, count)"),
    Hook("exchange", _R, "with multi_process", "", "every process's bytes, in process order"),
    Hook("launcher", _R, "no", "", "the command that runs Python in N processes"),
    Hook("axis_groups", _R, "no", "axis_groups", "each device's group along a mesh axis"),
    Hook(
        "arrays", _R, "no", "", "array operations: the engine's, the transport's (unimesh.arrays)"
    ),
    Hook("transport", _R, "no", "", "reshard: the transport (unimesh.transport, 6 operations)"),
    Hook("move_with_gradient", _R, "no", "", "reshard: the move, differentiable (reverse move)"),
    Hook("check_reshard", _R, "no", "", "reshard: the framework's own refusals, before moving"),
    Hook("shard_map", _P, "no", "shard_map", "per-shard programs (the engine gives it)"),
    Hook("full_array", _P, "with shard_map", "shard_map", "a distributed array whole, numpy"),
    Hook("context_mesh", _P, "no", "", "the mesh the framework's own context sets"),
    Hook("value_and_grad", _P, "no", "grad", "(value, grads) by the framework's autodiff"),
    Hook("shard_params", _P, "no", "shard_params", "a model's parameters laid out by rule"),
    Hook("param_paths", _P, "no", "", "each parameter's path and shape, before placing"),
    Hook("compile", _P, "no", "", "a step compiled by the framework's compiler"),
    Hook("program_entry", _P, "no", "", "a program as the compiler should meet it"),
    Hook("stop_gradient", _P, "no", "", "a value with no gradient through it"),
    Hook("process_index", _E, "yes", "", "this process's logical device id"),
    Hook("world_group", _E, "yes", "", "the group of every process (its collectives)"),
    Hook("split_group", _E, "with split", "", "this process's group of a row of the mesh"),
    Hook("group_cache_key", _E, "no", "", "groups are kept while this value is unchanged"),
    Hook("custom_vjp", _E, "with grad", "", "a function of one array with a given transpose"),
    Hook("vma_mode", _E, "with check_vma", "", "a mode tagging every operation's varying axes"),
    Hook("unwatched", _E, "no", "", "fn(x) outside vma_mode (the engine's own operations)"),
    Hook("graph", _E, "no", "", "the body's graph traced (vmaplan.BodyGraph) or None: no plan"),
    Hook("local_block", _E, "yes", "", "this process's block of an argument"),
    Hook("wrap_result", _E, "yes", "", "this process's block as a distributed array"),
    Hook("prepare_program", _E, "no", "", "once per program, by every process"),
)

#: Backend methods that are no hook: the core's helpers a backend calls (never overrides), the
#: class-level questions about the contract, and the engine's services.
HELPERS: frozenset[str] = frozenset(
    {
        "supports", "require", "reject_options", "request_devices", "implements", "layers",
        "contract_problems", "instance_problems", "available", "framework_version",
        "install_hint", "pip_extra", "axis_env", "forget_pending", "own_chain", "settle",
    }
)  # fmt: skip

#: What each layer is, and what each capability its hooks give promises.
_LAYER_FACTS: dict[str, tuple[bool, str, dict[str, str]]] = {
    _T: (
        True,
        "neutral objects <-> the framework's objects",
        {
            "mesh": "Mesh <-> the framework's mesh object (to_native / from_native)",
            "layout": "Layout <-> the framework's sharding/layout object",
            "layout_map": "LayoutMap -> the framework's layout map",
            "distribute": "distribute(array, layout) gives a native distributed array",
            "from_local": "from_local(blocks, layout, shape) builds one from this process's blocks",
        },
    ),
    _R: (
        False,
        "processes, devices and communication groups",
        {"axis_groups": "a communication group per mesh axis"},
    ),
    _P: (
        False,
        "per-shard programs, their gradients and sharded models",
        {
            "shard_map": "unimesh.shard_map runs per-shard functions",
            "grad": "unimesh.value_and_grad differentiates programs (the global function's "
            "gradient)",
            "shard_params": "unimesh.shard_params lays out a model's parameters by rule",
        },
    ),
}


def _layer(name: str) -> Layer:
    required, summary, promises = _LAYER_FACTS[name]
    rows = [h for h in HOOKS if h.layer == name]
    hooks = {cap: tuple(h.name for h in rows if h.capability == cap) for cap in promises}
    return Layer(name, required, summary, hooks, promises,
                 tuple(h.name for h in rows if not h.capability))  # fmt: skip


#: The layers of the contract, in the order a backend grows (read off :data:`HOOKS`).
LAYERS: tuple[Layer, ...] = (_layer(_T), _layer(_R), _layer(_P))

#: Refinements a backend declares in :attr:`Backend.features`: what each promises, and the
#: capability (or, for ``multi_process``, the runtime hooks) it needs.
FEATURES: dict[str, tuple[str, str]] = {
    "uneven_shards": (
        "layouts whose sharded dims do not divide evenly (torch.chunk blocks)",
        "layout",
    ),
    "tuple_axes": ("one tensor dim split over several mesh axes (P(('dp', 'tp')))", "layout"),
    "partial": ("pending reductions (P(..., partial={axis: op}))", "layout"),
    "axis_types": ("auto / explicit / manual axis types round-trip", "mesh"),
    "multi_process": ("meshes spanning several processes", "initialize+exchange"),
}

#: Capabilities that follow from others, with what each promises and the capabilities it needs
#: (a backend gets them by having those; nothing more to implement).
DERIVED: dict[str, tuple[str, tuple[str, ...]]] = {
    "checkpoint": (
        (
            "unimesh.save / unimesh.load of its distributed arrays, onto any layout "
            "(follows from distribute and from_local)"
        ),
        ("distribute", "from_local"),
    ),
    "reshard": (
        (
            "unimesh.reshard moves its distributed arrays to any layout on any mesh, each "
            "process receiving only what it lacks (follows from distribute and from_local; "
            "the reshard transport hooks move the pieces between processes)"
        ),
        ("distribute", "from_local"),
    ),
}

#: Every capability, with what it promises: the layers' hook capabilities, the features, then
#: the derived capabilities.
CAPABILITIES: dict[str, str] = {
    **{cap: text for layer in LAYERS for cap, text in layer.promises.items()},
    **{name: text for name, (text, _) in FEATURES.items()},
    **{name: text for name, (text, _) in DERIVED.items()},
}

#: capability -> the hooks that give it, over every layer
capability_hooks: dict[str, tuple[str, ...]] = {
    cap: hooks for layer in LAYERS for cap, hooks in layer.hooks.items()
}
hook_capability: dict[str, str] = {
    hook: cap for cap, hooks in capability_hooks.items() for hook in hooks
}


def derive_capabilities(
    implements: Callable[[str], bool], features: Iterable[str]
) -> frozenset[str]:
    """A backend class's capabilities: each hook capability whose hooks it all implements,
    its declared ``features``, and each derived capability whose needs those cover."""
    caps = {cap for cap, hooks in capability_hooks.items() if all(map(implements, hooks))}
    caps |= set(features)
    caps |= {cap for cap, (_, needs) in DERIVED.items() if caps.issuperset(needs)}
    return frozenset(caps)


#: hooks that are hooks no more, with where their work went: a class that still defines one
#: is told (its method would be ignored)
MOVED: dict[str, str] = {
    **{
        f"group_{op}": f"a method {op} of the group class named by group_type"
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute")
    },
    "group_broadcast": "a method broadcast of the group class named by group_type",
    "needs_grad": "a method of the object arrays() returns",
    "after": "a method of the object arrays() returns",
    "evaluate": "a method of the object arrays() returns",
    "plans_vma": "graph(), None where no plan is made",
    "body_graph": "graph().trace",
    "vma_marker": "graph().marker",
    "native_layout_code": "native_code(layout)",
}


def problems(
    implements: Callable[[str], bool],
    features: Iterable[str],
    capabilities: frozenset[str],
    hand_written: Iterable[str] | None = None,
) -> list[str]:
    """What a backend class gets wrong about the contract, each with its fix: capabilities
    written by hand, a missing required hook, a capability half implemented, a feature unknown
    or without what it refines. ``implements(hook)``: whether the class overrides it."""
    found: list[str] = []
    if hand_written is not None:
        found.append(
            f"sets capabilities={sorted(hand_written)} by hand: capabilities follow from the "
            f"hooks it implements; declare only `features` (some of {sorted(FEATURES)})"
        )
    for hook in ("mesh_to_native", "from_native"):
        if not implements(hook):
            found.append(f"implements no {hook}: the translator layer is required")
    for cap, hooks in capability_hooks.items():
        done = [h for h in hooks if implements(h)]
        if done and len(done) < len(hooks):
            missing = [h for h in hooks if h not in done]
            found.append(
                f"implements {', '.join(done)} but not {', '.join(missing)}: "
                f"{cap!r} needs all of {', '.join(hooks)}"
            )
    declared = set(features)
    unknown = sorted(declared - set(FEATURES))
    if unknown:
        found.append(f"declares unknown features {unknown}; known features are {sorted(FEATURES)}")
    for feature in sorted(declared & set(FEATURES)):
        needs = FEATURES[feature][1]
        if needs == "initialize+exchange":
            if not (implements("initialize") and implements("exchange")):
                found.append(
                    f"declares {feature!r} but implements no initialize and exchange "
                    "(the runtime layer)"
                )
        elif needs not in capabilities:
            found.append(
                f"declares {feature!r}, a refinement of {needs!r}, which it does not "
                f"implement ({', '.join(capability_hooks[needs])})"
            )
    return found


#: The concepts a backend maps to native APIs (:attr:`Backend.native_api`), with the neutral API
#: of each; the docs' cross-framework table is generated from these declarations.
CONCEPTS: dict[str, str] = {
    "mesh": "unimesh.Mesh",
    "layout": "unimesh.Layout (mesh + PartitionSpec)",
    "layout_map": "unimesh.LayoutMap",
    "distribute": "unimesh.distribute(array, layout)",
    "axis_groups": "Mesh.groups(axis)",
    "shard_map": "unimesh.shard_map(f, mesh, in_specs, out_specs)",
    "psum": "unimesh.psum(x, axis)",
    "all_gather": "unimesh.all_gather(x, axis)",
    "psum_scatter": "unimesh.psum_scatter(x, axis)",
    "all_to_all": "unimesh.all_to_all(x, axis, split_axis, concat_axis)",
    "ppermute": "unimesh.ppermute(x, axis, perm)",
    "value_and_grad": "unimesh.value_and_grad(fn, argnums)",
    "axis_index": "unimesh.axis_index(axis)",
    "shard_params": "unimesh.shard_params(model, rules)",
    "launch": "Backend.launcher(n) / unimesh check",
}
