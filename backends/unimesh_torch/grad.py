"""The torch backend's ``value_and_grad``: a function's value and, by torch autograd, the
gradients of its differentiated arguments, each laid out like its argument (a DTensor's
gradient is a DTensor of its layout, a global tensor's a global tensor).

Every floating-point leaf of a differentiated argument is handed to the function as a fresh
copy that requires grad, and ``torch.autograd.grad`` of the scalar value gives the gradients.
A DTensor leaf's copy also carries a plain tensor leaf for its local block (the ``LEAF``
attribute), which shard_map takes as the block: no ``to_local``/``from_local`` round trip
through autograd. The block's gradient is added to whatever reaches the DTensor itself
through DTensor operations. Under torch.compile (dynamo traces no ``DTensorSpec`` objects)
the copy is made from the block leaf instead, so the block's gradient is the whole of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from unimesh import ConversionError
from unimesh.messages import short
from unimesh.parallel import host_float

from .autograd import BLOCK, LEAF, dtensor
from .runtime import import_torch
from .translate import from_host

__all__ = ["value_and_grad"]


class Leaf(NamedTuple):
    """One leaf of a differentiated argument, as the function is given it."""

    given: Any  # what the function gets: a fresh copy that requires grad, or the leaf as it is
    differentiated: bool  # whether it gets a gradient (a floating-point or complex tensor)
    block: Any  # a DTensor copy's plain tensor leaf of its local block; None otherwise


class Tree(NamedTuple):
    """One differentiated argument: its tree structure and its leaves."""

    treedef: Any
    leaves: list[Leaf]


def value_and_grad(fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Callable[..., Any]:
    """``run(*args) -> (value, grads)`` (with ``has_aux``: ``((value, aux), grads)``), where
    ``grads`` holds one tree per argument of ``argnums``."""

    def run(*args: Any) -> Any:
        return _value_and_grad(fn, argnums, has_aux, args)

    return run


def _value_and_grad(fn: Any, argnums: tuple[int, ...], has_aux: bool, given: Any) -> Any:
    import optree

    torch = import_torch()
    from torch.distributed.tensor import DTensor

    traced = torch.compiler.is_compiling()
    args = list(given)
    trees: list[Tree] = []
    for i in argnums:
        flat, treedef = optree.tree_flatten(args[i])
        leaves = [_fresh(leaf, traced) for leaf in flat]
        trees.append(Tree(treedef, leaves))
        args[i] = optree.tree_unflatten(treedef, [leaf.given for leaf in leaves])
    watched = _watched(trees, traced)
    if not watched and any(tree.leaves for tree in trees):  # refused before fn runs
        raise ConversionError(
            f"value_and_grad of {getattr(fn, '__name__', 'fn')} with respect to "
            f"argument(s) {list(argnums)}: none of their leaves is a floating-point "
            "array (jax.grad refuses integer inputs too); pass float arrays there, or "
            "choose other argnums"
        )
    with torch.enable_grad():
        out = fn(*args)
        value, aux = out if has_aux else (out, None)
        scalar = _scalar(fn, value)
        found = (
            torch.autograd.grad(scalar.reshape(()), watched, allow_unused=True)
            if watched
            else ()  # argument trees with no leaf: empty gradients, as JAX gives
        )
    taken = iter(found)
    grads = []
    for tree in trees:
        tree_grads = [_gradient(leaf, taken, traced) for leaf in tree.leaves]
        grads.append(optree.tree_unflatten(tree.treedef, tree_grads))
    if isinstance(value, DTensor) and not traced:  # without DTensor's dispatch (4 us)
        value = dtensor(value._local_tensor.detach(), value._spec, requires_grad=False)
    else:
        value = value.detach()
    return ((value, aux) if has_aux else value), tuple(grads)


def _fresh(leaf: Any, traced: bool) -> Leaf:
    """An argument leaf as the function is given it. Floating numpy (and floats) become
    tensors first: torch differentiates only its own (JAX takes numpy; a global array gets
    a global gradient)."""
    torch = import_torch()
    from torch.distributed.tensor import DTensor

    if host_float(leaf):
        leaf = torch.tensor(leaf) if type(leaf) is float else from_host(np.array(leaf))
    if not torch.is_tensor(leaf) or not (leaf.is_floating_point() or leaf.is_complex()):
        return Leaf(leaf, False, None)
    if not isinstance(leaf, DTensor):
        return Leaf(leaf.detach().requires_grad_(True), True, None)
    if traced:  # the copy made from the block leaf: the block's gradient is all of it
        block = leaf.to_local().detach().requires_grad_(True)
        return Leaf(_laid_like(block, leaf), True, block)
    local = leaf._local_tensor.detach()
    copy = dtensor(local, leaf._spec, requires_grad=True)
    block = local.view_as(local).requires_grad_(True)
    setattr(copy, LEAF, block)
    return Leaf(copy, True, block)


def _watched(trees: list[Tree], traced: bool) -> list[Any]:
    """The tensors autograd differentiates, in the order :func:`_gradient` takes their
    gradients (positions, not ids: ids are guards torch.compile cannot keep): a plain
    leaf's copy; a DTensor leaf's copy, then its block (traced: its block alone)."""
    watched: list[Any] = []
    for tree in trees:
        for leaf in tree.leaves:
            if not leaf.differentiated:
                continue
            if leaf.block is None:
                watched.append(leaf.given)
            elif traced:
                watched.append(leaf.block)
            else:
                watched += [leaf.given, leaf.block]
    return watched


def _scalar(fn: Any, value: Any) -> Any:
    """The one-element tensor autograd differentiates: a DTensor value's whole value when it
    is not replicated, else its shard_map block or its local tensor."""
    torch = import_torch()
    from torch.distributed.tensor import DTensor

    scalar = value
    if isinstance(value, DTensor):
        if any(not p.is_replicate() for p in value.placements):
            scalar = value.full_tensor()
        else:  # a shard_map result: its block, else the local tensor
            scalar = getattr(value, BLOCK, None)
            scalar = value.to_local() if scalar is None else scalar
    if not torch.is_tensor(scalar) or scalar.numel() != 1:
        raise ConversionError(
            f"value_and_grad needs {getattr(fn, '__name__', 'fn')} to return a "
            f"scalar, got {short(value)}"
        )
    return scalar


def _gradient(leaf: Leaf, taken: Iterator[Any], traced: bool) -> Any:
    """``leaf``'s gradient, its parts taken from ``taken`` in :func:`_watched`'s order;
    zeros where nothing reached it, None for a leaf not differentiated."""
    torch = import_torch()
    if not leaf.differentiated:
        return None
    copy = leaf.given
    if traced and leaf.block is not None:  # dynamo: the block's gradient is all of it
        local = next(taken)
        return torch.zeros_like(copy) if local is None else _laid_like(local, copy)
    whole = next(taken)
    if leaf.block is not None:
        local = next(taken)
        if local is not None:
            if local.dtype != copy.dtype:  # pragma: no cover - autograd keeps dtypes
                local = local.to(copy.dtype)
            part = dtensor(local, copy._spec, requires_grad=False)
            whole = part if whole is None else whole + part
    return torch.zeros_like(copy) if whole is None else whole


def _laid_like(local: Any, like: Any) -> Any:
    """``local`` as a DTensor laid out as ``like`` (what dynamo traces)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
