"""Laying out a model's parameters by rule (:func:`shard_params`): every parameter's layout
read from a :class:`~unimesh.rules.LayoutMap` or :class:`~unimesh.rules.AxisRules` and checked
for the backend before any parameter is placed; the backend places them (its
``shard_params`` hook), or, for the neutral model of nested dicts, ``distribute``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .backend import Backend
from .errors import ConversionError, LayoutError
from .layout import Layout
from .mesh import Mesh
from .messages import short
from .rules import AxisRules, LayoutMap, Resolver
from .spec import PartitionSpec

__all__ = ["shard_params"]


def _resolver(
    rules: LayoutMap | AxisRules, mesh: Mesh | None, logical_axes: Any, be: Backend
) -> tuple[Resolver, Callable[[str, tuple[int, ...]], Layout]]:
    """The rules' reading, and each parameter's layout from it, checked for the backend."""
    from .convert import require_layout

    rules_of = Resolver(rules, mesh, logical_axes, "shard_params()")

    def resolve(path: str, shape: tuple[int, ...]) -> Layout:
        layout = rules_of.layout(path)
        if layout is None:
            return Layout(rules_of.mesh, PartitionSpec())
        if len(layout.spec) > len(shape):
            raise LayoutError(
                f"parameter {path!r} has shape {shape}, but its layout "
                f"{layout.spec!r} names {len(layout.spec)} dims"
            )
        require_layout(be, layout)
        if not layout.is_even(shape) and not be.supports("uneven_shards"):
            raise LayoutError(
                f"parameter {path!r} of shape {shape} does not divide evenly under "
                f"{layout.spec!r} on {rules_of.mesh!r}, and backend {be.name!r} needs even "
                "shards; change the rule for it or the mesh axis sizes"
            )
        return layout

    return rules_of, resolve


def shard_params(
    model: Any,
    rules: LayoutMap | AxisRules,
    *,
    mesh: Mesh | None = None,
    logical_axes: Any = None,
    backend: str | Backend | None = None,
    strict: bool = True,
) -> Any:
    """Every parameter of ``model`` laid out by rule; unmatched parameters are replicated.

    ``rules`` is a :class:`LayoutMap` (patterns matched against each parameter's path with
    ``re.fullmatch``, as Keras does) or :class:`AxisRules` with ``logical_axes`` (a dict or a
    function from parameter path to logical axis names) and ``mesh``. Paths are the framework's
    own: ``fc1.weight`` (torch ``named_parameters``), ``dense/kernel`` (Keras variable paths),
    ``layers.0.weight`` (MLX), ``w1`` / ``block/w`` (JAX pytree keys joined with ``/``).

    A LayoutMap key (or a ``logical_axes`` dict key) that matches no parameter is almost always
    a path in another framework's spelling: it is a :class:`LayoutError` naming the keys and the
    closest parameter paths, before any parameter is touched; ``strict=False`` makes it a
    :class:`UserWarning`.

    torch ``nn.Module``: parameters become DTensors, in place; returns the module. JAX pytree:
    returns a new pytree of ``jax.Array``. Keras model: each variable is re-placed with its
    layout (Keras on JAX), in place. MLX ``nn.Module``: each parameter becomes this process's
    block, in place.
    """
    from .registry import get_backend

    be = get_backend(backend)
    be.require("shard_params")
    rules_of, resolve = _resolver(rules, mesh, logical_axes, be)
    if type(model) is dict:  # the neutral model: nested dicts (and lists) of arrays
        # (exactly dict: an mlx.nn.Module is a dict too, and its backend lays it out)
        hosts = dict(_dict_leaves(model))
        layouts = {path: resolve(path, host.shape) for path, host in hosts.items()}
        rules_of.unmatched(list(layouts), strict, _WHAT, _WHOSE)
        return _rebuilt(model, "", lambda path: be.distribute(hosts[path], layouts[path]))
    params = be.param_paths(model)
    if params is not None and [p for p, _ in params] == [""] and not hasattr(model, "shape"):
        # the whole "model" is one leaf that is no array: not a model or a pytree at all
        raise ConversionError(
            f"shard_params() got {short(model)} ({type(model).__name__}), which is neither a "
            f"model nor a pytree of parameters for the {be.name} backend; pass the model "
            "(or its parameters' pytree)"
        )
    if params is None:  # a backend that cannot list them first: checked after placing
        seen: list[str] = []

        def recording(path: str, shape: tuple[int, ...]) -> Layout:
            seen.append(path)
            return resolve(path, shape)

        out = be.shard_params(model, recording)
        rules_of.unmatched(seen, strict, _WHAT, _WHOSE)
        return out
    # every layout resolved (and so checked) before the backend changes anything
    layouts = {path: resolve(path, tuple(shape)) for path, shape in params}
    rules_of.unmatched(list(layouts), strict, _WHAT, _WHOSE)
    return be.shard_params(model, lambda path, shape: layouts.get(path) or resolve(path, shape))


_MAX_DEPTH = 64
_WHAT, _WHOSE = "parameter of the model", "The model's parameter paths"


def _dict_leaves(tree: Any, path: str = "", depth: int = 0) -> list[tuple[str, np.ndarray]]:
    """(path, host array) of each leaf of nested dicts and lists, paths joined with ``/``
    (as JAX names pytree keys)."""
    if depth > _MAX_DEPTH:
        raise ConversionError(
            f"shard_params() model nests deeper than {_MAX_DEPTH} levels at {path!r}; "
            "pass a flatter dict of arrays"
        )
    if isinstance(tree, dict):
        out = []
        for key, value in tree.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ConversionError(
                    f"shard_params() model keys are str, got {short(key)} under {path!r}"
                )
            out += _dict_leaves(value, f"{path}/{key}" if path else str(key), depth + 1)
        return out
    if isinstance(tree, (list, tuple)):
        return [
            kv
            for i, value in enumerate(tree)
            for kv in _dict_leaves(value, f"{path}/{i}" if path else str(i), depth + 1)
        ]
    try:
        host = np.asarray(tree)
    except Exception as exc:  # noqa: BLE001 - any array-like that numpy cannot read
        host = np.asarray(None)
        reason = f" ({type(exc).__name__})"
    else:
        reason = ""
    if host.dtype.kind not in "biufc":
        raise ConversionError(
            f"shard_params() lays out a pytree of arrays; leaf {path or '(the root)'!r} is "
            f"{short(tree)} ({type(tree).__name__}){reason}; pass the parameters' pytree"
        )
    return [(path, host)]


def _rebuilt(tree: Any, path: str, place: Callable[[str], Any]) -> Any:
    """``tree`` with each leaf replaced by ``place(its path)``."""
    if isinstance(tree, dict):
        return {k: _rebuilt(v, f"{path}/{k}" if path else str(k), place) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_rebuilt(v, f"{path}/{i}" if path else str(i), place) for i, v in enumerate(tree)]
        return type(tree)(items) if type(tree) in (list, tuple) else items
    return place(path)
