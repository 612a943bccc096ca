"""The trees a checkpoint saves and loads: a pytree's leaves by name (tree paths joined with
``.``, as torch's state_dict and Keras name them), and a framework's model object as its
named arrays (through the backend's ``model_state`` hook)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CheckpointError, UnimeshError
from ..layout import Layout
from ..messages import short

__all__ = ["flatten", "is_leaf", "model_state"]


def is_leaf(x: object) -> bool:
    """An array (anything with a shape and a dtype) or a Layout."""
    return isinstance(x, Layout) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Names, leaves and the treedef of ``tree``; two leaves of one name are refused."""
    import optree

    leaves, treedef = optree.tree_flatten(tree, is_leaf=is_leaf)
    names = [".".join(str(p) for p in path) for path in optree.treespec_paths(treedef)]
    if not names:
        raise CheckpointError(f"the tree {short(tree)} has no arrays to save or load")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise CheckpointError(f"two leaves of the tree are both named {name!r}")
        seen.add(name)
    return names, leaves, treedef


def model_state(obj: Any, backend: Any) -> tuple[Any, dict[str, Any]] | None:
    """(backend, named arrays) when ``obj`` is a framework's model object (a torch
    ``nn.Module``, a Keras model, an ``mlx.nn.Module``), through the backend's
    ``model_state`` hook; None for anything else (a pytree)."""
    from ..registry import get_backend, owner_of

    # (an mlx.nn.Module is a dict: the exact builtin containers are what is passed over)
    if type(obj) in (dict, list, tuple) or isinstance(obj, (np.ndarray, Layout)) or is_leaf(obj):
        return None
    try:
        be = get_backend(backend) if backend is not None else owner_of(obj)
    except UnimeshError:
        return None
    state = be.model_state(obj)
    return None if state is None else (be, state)
