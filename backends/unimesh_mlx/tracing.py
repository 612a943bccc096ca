"""Whether an MLX array is traced by one of MLX's transforms (``grad``, ``vjp``, ``jvp``,
``vmap``, ``compile``): only then can a gradient flow through it, and only then does a
program need its gradient rules (each a ``custom_function``: two more graph nodes to build
and evaluate, per collective and per replicated argument or result).

MLX's Python API has no such test, but its C++ library exports one,
``mlx::core::array::is_tracer() const``: true for the arrays a transform made and for every
array computed from them while it runs. The function :func:`make_probe` returns calls it on
the ``mlx::core::array`` that the Python object holds (nanobind keeps it inline, at the
offset its instance header records). That reaches past the public API, so the probe is used
only after a self-test on the installed MLX (outside any transform nothing is traced; inside
``mx.grad`` the traced argument and what is computed from it are, a closed-over array is
not), and only on an ``mx.array`` whose header is the one the self-test read. Where the test
fails, the library or symbol is missing, or ``UNIMESH_MLX_TRACER_PROBE=0`` is set, there is
no probe and the backend keeps the rules for every array but fresh blocks (always right).

The same per-process record of tracing (read by :mod:`.programs`, :mod:`.translate` and
:mod:`.compiled`, so none of them imports another for it): the probe, made once
(:func:`tracer_probe`), what the gradient rules did (``RULES``) and whether ``unimesh.compile``
is tracing a step (``TRACING``, per thread).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SYMBOL = "_ZNK3mlx4core5array9is_tracerEv"  # mlx::core::array::is_tracer() const
#: nanobind's instance header, after PyObject_HEAD: int32 offset of the C++ object, then the
#: state bits (low three: ready = 2, held inline = 4)
_HEADER_AT = object.__basicsize__  # 16 on 64-bit CPython
_READY_INLINE = 0b110


def _library() -> Path | None:
    import mlx

    name = "libmlx.dylib" if sys.platform == "darwin" else "libmlx.so"
    for root in mlx.__path__:
        path = Path(root) / "lib" / name
        if path.is_file():
            return path
    return None


def make_probe() -> Callable[[Any], bool] | None:
    """``may_be_traced(x)``: False only where MLX says no transform traces ``x``; None where
    MLX cannot be asked here (then every array may be traced)."""
    if os.environ.get("UNIMESH_MLX_TRACER_PROBE", "1") == "0":
        return None
    import mlx.core as mx

    path = _library()
    if path is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(str(path)), _SYMBOL)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_bool
    fn.argtypes = [ctypes.c_void_p]
    array_type = mx.array
    constant = mx.array([1.0, 2.0])
    header = ctypes.c_uint64.from_address(id(constant) + _HEADER_AT).value
    offset = header & 0xFFFFFFFF
    if (header >> 32) & 0b111 != _READY_INLINE or not (
        _HEADER_AT + 8 <= offset <= array_type.__basicsize__ - 16
    ):
        return None  # not the instance layout this probe knows
    read = ctypes.c_uint64.from_address

    def may_be_traced(x: Any) -> bool:
        if type(x) is not array_type:
            return True
        base = id(x)
        if read(base + _HEADER_AT).value != header:
            return True  # held some other way: cannot say
        return bool(fn(base + offset))

    seen: list[bool] = []

    def traced_fn(w: Any) -> Any:
        seen.extend(map(may_be_traced, (w, w * 2.0, constant, constant + 1.0)))
        return (w * constant).sum()

    try:
        mx.grad(traced_fn)(mx.array([3.0, 4.0]))
        outside = may_be_traced(constant + 1.0)
    except Exception:  # noqa: BLE001 - any surprise means: do not use the probe
        return None
    if seen != [True, True, False, False] or outside:
        return None
    return may_be_traced


@functools.cache
def tracer_probe() -> Any:
    """:func:`make_probe`'s function (None: this MLX cannot be asked), made once."""
    return make_probe()


class _Rules:
    """What the gradient rules did, for ``unimesh.compile`` (:mod:`.compiled`): how many were
    put in a graph (``applied``) and how many MLX differentiated (``transposed``, while a
    trace takes a gradient through them); while ``forward_only`` is set (a trace that took
    none), programs put none in."""

    applied = 0
    transposed = 0
    forward_only = False


RULES = _Rules()


class _Tracing(threading.local):
    """Per thread: whether ``unimesh.compile`` is tracing a step (:mod:`.compiled`), where a
    program refuses what ``mx.compile`` cannot evaluate (send/recv rounds)."""

    compiling = False


TRACING = _Tracing()
