"""The array operations the core asks of a framework, in one vocabulary: the engine builds
collectives from a framework's primitives with them (:mod:`unimesh.groups`), and a reshard
joins its pieces with them (:mod:`unimesh.transfer`). A backend gives one object
(:meth:`unimesh.Backend.arrays`); the default is numpy's. Plain numpy, no framework."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Arrays"]


class Arrays:
    """A framework's array operations (default: numpy's). Each keeps its argument's dtype
    and device; none needs to be differentiable unless the engine runs it under the
    framework's autodiff (torch, MLX: their own operations are)."""

    def asarray(self, value: Any) -> Any:
        """``value`` (the framework's array, or a Python/numpy number or array) as the
        framework's array (where its collectives run)."""
        return np.asarray(value)

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        return np.moveaxis(x, source, destination)

    def take(self, x: Any, index: list[int]) -> Any:
        """The rows ``index`` of dim 0 (a list of ints), in that order."""
        return x[index]

    def reduce(self, x: Any, op: str) -> Any:
        """``op`` (sum/max/min) over dim 0, in ``x``'s dtype (wrapping as a collective does)."""
        return getattr(np, op)(x, axis=0).astype(x.dtype, copy=False)

    def zeros_like(self, x: Any) -> Any:
        return np.zeros_like(x)

    def concatenate(self, parts: Sequence[Any], axis: int) -> Any:
        return np.concatenate(list(parts), axis=axis)

    def to_host(self, x: Any) -> np.ndarray:
        """``x`` as numpy (the checked mode compares every process's values)."""
        return np.asarray(x)

    # -- autodiff and a lazy framework's order (the engine's; defaults: numpy's) ------------
    def needs_grad(self, x: Any) -> bool:
        """Whether a gradient may flow through ``x`` (False lets the engine skip its
        gradient rules; numpy has no autodiff)."""
        return False

    def after(self, x: Any, done: Any) -> Any:
        """``x``, computed only after ``done`` (lazy frameworks drop a collective whose result
        is unused on one process, and its peers would wait for it forever; MLX:
        ``mx.depends``)."""
        return x

    def evaluate(self, arrays: Sequence[Any]) -> None:
        """Compute ``arrays`` now, in one call (a lazy framework; MLX: ``mx.eval``): before
        communication that runs as it is called rather than when evaluated."""


#: numpy's operations (the default of :meth:`unimesh.Backend.arrays`)
NUMPY = Arrays()
