"""torch tensor-parallel plans <-> neutral LayoutMaps of a module's parameters.

A plan for ``parallelize_module`` (``{"attn.wq": ColwiseParallel(), ...}``) fixes how each
parameter of the matched submodules is split over the tensor-parallel mesh axis; these helpers
write that down as a :class:`unimesh.LayoutMap` (parameter path -> spec, in torch's own shapes:
``nn.Linear.weight`` is ``[out, in]``) and read a LayoutMap back as a plan.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fnmatch import fnmatch
from typing import Any

from unimesh import Layout, LayoutError, LayoutMap, Mesh, P
from unimesh.messages import short

__all__ = ["layout_map_from_plan", "plan_from_layout_map"]

_STYLES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel")


def _kind(module: Any) -> str | None:
    from torch import nn

    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    return None


def _style_specs(style: str, kind: str | None, axis: str) -> dict[str, P] | None:
    """Parameter name -> spec that ``style`` gives a module of ``kind`` (None: not defined)."""
    if style == "SequenceParallel":
        return {}  # parameters replicated; the activations are split on the sequence dim
    if kind == "Linear":  # weight [out, in]
        if style == "ColwiseParallel":
            return {"weight": P(axis, None), "bias": P(axis)}
        return {"weight": P(None, axis), "bias": P()}
    if kind == "Embedding":  # weight [num_embeddings, dim]
        if style == "ColwiseParallel":
            return {"weight": P(None, axis)}
        return {"weight": P(axis, None)}
    return None


def _matches(key: str, name: str) -> bool:
    """``parallelize_module``'s matching: atom by atom, ``fnmatch`` on each."""
    k, n = key.split("."), name.split(".")
    return len(k) == len(n) and all(fnmatch(a, b) for a, b in zip(n, k))


#: Plan entries that move activations only (no parameters): read as nothing to lay out.
_ACTIVATIONS = ("PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput")

#: names="flax" / "keras": each torch parameter name -> (that framework's name, transposed?)
_RENAMES: dict[str, dict[tuple[str | None, str], tuple[str, bool]]] = {
    "flax": {
        ("Linear", "weight"): ("kernel", True),
        ("Embedding", "weight"): ("embedding", False),
        (None, "weight"): ("scale", False),  # LayerNorm / RMSNorm
    },
    "keras": {
        ("Linear", "weight"): ("kernel", True),
        ("Embedding", "weight"): ("embeddings", False),
        (None, "weight"): ("gamma", False),
        (None, "bias"): ("beta", False),
    },
}


def layout_map_from_plan(
    module: Any,
    plan: Mapping[str, Any],
    mesh: Mesh,
    axis: str = "tp",
    *,
    under: str | None = None,
    names: str = "torch",
) -> LayoutMap:
    """The layout of every parameter that ``parallelize_module(module, mesh[axis], plan)``
    shards, as a LayoutMap on ``mesh`` keyed by the parameter's path (``named_parameters``'
    dotted name, regex-escaped). Parameters of ``SequenceParallel`` modules are replicated.

    Takes plans as torch's tutorial and torchtitan write them: ``ColwiseParallel``,
    ``RowwiseParallel`` and ``SequenceParallel`` on ``nn.Linear`` / ``nn.Embedding`` (what
    torch defines them for; ``SequenceParallel`` on any module), wildcard keys
    (``layers.*.attention.wq``), and ``PrepareModuleInput`` / ``PrepareModuleOutput`` entries,
    which move activations and hold no parameters (skipped). ``under``: the plan is a
    per-block plan (block-relative keys such as ``attention.wq``), applied to every submodule
    that ``under`` names (``layers.*``), as torchtitan's loop over its blocks does.

    ``names``: ``"torch"`` (the default), or ``"flax"`` / ``"keras"`` for the same model
    written in that framework: paths joined by ``/`` (any prefix such as ``params/``
    allowed), ``weight`` of a Linear as ``kernel`` with its spec transposed (``[in, out]``
    there), of an Embedding as ``embedding`` (Keras: ``embeddings``), of a norm as ``scale``
    (Keras: ``gamma``, and ``bias`` as ``beta``). Module names must agree between the two.
    """
    if not isinstance(mesh, Mesh):
        raise LayoutError(f"layout_map_from_plan() needs a unimesh.Mesh, got {short(mesh)}")
    if axis not in mesh.axis_names:
        raise LayoutError(
            f"axis {short(axis)} is not in {mesh!r}; name the tensor-parallel axis of the mesh"
        )
    if not isinstance(plan, Mapping):
        raise LayoutError(f"a TP plan is a dict {{module path: style}}, got {short(plan)}")
    if names not in ("torch", *_RENAMES):
        raise LayoutError(
            f"layout_map_from_plan() names={short(names)}: pick 'torch', 'flax' or 'keras'"
        )
    if under is not None and (not isinstance(under, str) or not under):
        raise LayoutError(
            f"under= is a module path such as 'layers.*' (the blocks a per-block plan is for), "
            f"got {short(under)}"
        )
    modules = [n for n, _ in module.named_modules() if n]
    blocks = [""] if under is None else [n for n in modules if _matches(under, n)]
    if not blocks:
        raise LayoutError(
            f"under={under!r} names no submodule of {type(module).__name__}; its submodules "
            f"are {short(modules, 120)}"
        )
    # parallelize_module applies the entries in order: a later entry for a module (a wildcard
    # first, then the module by name) is the one its parameters end up with
    rules: dict[str, tuple[P, Any, str]] = {}
    for key, style in plan.items():
        kind_name = type(style).__name__
        if kind_name in _ACTIVATIONS:
            continue
        if kind_name not in _STYLES:
            raise LayoutError(
                f"TP plan entry {key!r} is {short(style)}; unimesh reads {', '.join(_STYLES)} "
                f"(and skips {', '.join(_ACTIVATIONS)}, which hold no parameters)"
            )
        hits = [
            n
            for block in blocks
            for n in modules
            if _matches(f"{block}.{key}" if block else str(key), n)
        ]
        if not hits:
            raise LayoutError(
                f"TP plan key {key!r} names no submodule of {type(module).__name__}"
                + (f" under {under!r}" if under else "")
                + f"; its submodules are {short(modules, 120)}"
            )
        for name in hits:
            sub = module.get_submodule(name)
            specs = _style_specs(kind_name, _kind(sub), axis)
            if specs is None:
                raise LayoutError(
                    f"{kind_name} on {name!r} ({type(sub).__name__}): torch defines it for "
                    "nn.Linear and nn.Embedding only"
                )
            for pname, _ in sub.named_parameters(recurse=False):
                path = f"{name}.{pname}"
                rules.pop(path, None)  # keeps the order of the entry that decides
                rules[path] = (specs.get(pname, P()), _kind(sub), pname)
    out = LayoutMap(mesh)
    for path, (spec, kind, pname) in rules.items():
        if names == "torch":
            out[re.escape(path)] = spec
            continue
        new, flip = _RENAMES[names].get((kind, pname), (pname, False))
        if flip and len(spec) == 2:
            spec = P(spec[1], spec[0])
        parts = [*path.split(".")[:-1], new]
        out["(?:.*/)?" + re.escape("/".join(parts))] = spec
    return out


def plan_from_layout_map(module: Any, layout_map: LayoutMap, axis: str = "tp") -> dict[str, Any]:
    """The TP plan whose ``ColwiseParallel`` / ``RowwiseParallel`` give the ``nn.Linear`` and
    ``nn.Embedding`` weights of ``module`` the layouts ``layout_map`` assigns them (paths as
    ``named_parameters`` spells them). Modules whose parameters it leaves replicated get no
    entry; a layout no style gives is a :class:`LayoutError` naming the parameter."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(layout_map, LayoutMap):
        raise LayoutError(
            f"plan_from_layout_map() needs a unimesh.LayoutMap, got {short(layout_map)}"
        )
    plan: dict[str, Any] = {}
    replicated = Layout(layout_map.mesh, P())  # a parameter the map does not name
    for name, sub in module.named_modules():
        kind = _kind(sub)
        if not name or kind is None:
            continue
        got = {
            pname: layout_map.get(f"{name}.{pname}")
            for pname, _ in sub.named_parameters(recurse=False)
        }
        if all(lay is None or not lay.spec.axes() for lay in got.values()):
            continue
        for style in ("ColwiseParallel", "RowwiseParallel"):
            want = _style_specs(style, kind, axis) or {}
            if all(
                (lay or replicated) == Layout(layout_map.mesh, want.get(pname, P()))
                for pname, lay in got.items()
            ):
                plan[name] = ColwiseParallel() if style == "ColwiseParallel" else RowwiseParallel()
                break
        else:
            found = {p: (lay.spec if lay is not None else None) for p, lay in got.items()}
            raise LayoutError(
                f"the layouts of {name!r} ({kind}) are {found}; no torch TP style gives them: "
                f"ColwiseParallel gives {_style_specs('ColwiseParallel', kind, axis)}, "
                f"RowwiseParallel {_style_specs('RowwiseParallel', kind, axis)}"
            )
    return plan
