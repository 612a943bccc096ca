"""``mx.compile`` of a unimesh step (:func:`unimesh.compile` on MLX).

``mx.compile`` takes functions of trees of ``mx.array`` and constants; a unimesh step takes and
returns :class:`~unimesh_mlx.translate.MLXArray` values (a block plus its layout and global
shape). :func:`compiled` hands each MLXArray to the compiled function as its block and keeps the
layout and shape aside: they are static, like the shapes a jitted function is traced for, so
they are part of the key that picks the compiled trace (a new layout traces again). Results
come back as MLXArrays with the layouts the trace produced.

A step that takes no gradient through a collective (a forward step, say) needs none of the
gradient rules (``mx.custom_function``) a program puts around its collectives whenever MLX may
trace them: compile traces every input, and nothing in MLX's API tells a compile trace from a
gradient trace. So the first call traces with the rules and counts how many a gradient went
through; where none, the next call traces the same function again without them (the one
compiled graph used from then on). A call made inside an outer transform (``mx.grad`` of a
function calling the compiled one) always runs the trace with the rules, since that transform
differentiates the compiled graph afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from unimesh import ConversionError
from unimesh.messages import short

from . import tracing
from .tracing import RULES, TRACING
from .translate import MLXArray


def _signature(leaf: Any, array: type) -> Any:
    """What picks a trace for one argument leaf, as :func:`compiled`'s ``split`` sees it: an
    MLXArray's layout (by id: an entry is kept only while its trace holds that layout, and
    traces are never dropped) and shape, an ``mx.array``'s type, any other value (a constant
    of the trace) with its type (1, 1.0 and True are equal but not the same constant)."""
    kind = type(leaf)
    if kind is MLXArray:
        return (id(leaf.layout), leaf.shape)
    if isinstance(leaf, array):
        return array
    return _constant(leaf)


def _constant(leaf: Any) -> Any:
    """A constant leaf as a key: with its type, and a float by its bits (-0.0 is not 0.0,
    and every NaN is the same key, where ``==`` says otherwise)."""
    kind = type(leaf)
    if kind is float:
        return (kind, leaf.hex())
    if kind is complex:
        return (kind, leaf.real.hex(), leaf.imag.hex())
    if hasattr(leaf, "dtype") and hasattr(leaf, "tobytes"):  # a numpy scalar
        return (kind, leaf.dtype.str, leaf.tobytes())
    return (kind, leaf)


@contextlib.contextmanager
def _tracing() -> Iterator[None]:
    """While ``mx.compile`` traces a step: programs refuse what it cannot evaluate."""
    before, TRACING.compiling = TRACING.compiling, True
    try:
        yield
    finally:
        TRACING.compiling = before


def compiled(
    fn: Callable[..., Any],
    options: dict[str, Any],
    own_chain: Callable[[], contextlib.AbstractContextManager[None]],
) -> Callable[..., Any]:
    """``fn`` under ``mx.compile(..., **options)``, taking and returning MLXArrays;
    ``own_chain``: the backend's context for a trace's own chain of collectives."""
    import mlx.core as mx
    import optree

    traces: dict[Any, Any] = {}

    def split(tree: Any, what: str) -> tuple[list[Any], list[Any], Any]:
        """(the arrays handed to mx.compile, what each leaf is, the tree's structure)."""
        leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)  # an MLXArray is a leaf
        arrays: list[Any] = []
        kinds: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, MLXArray):
                arrays.append(leaf.local)
                kinds.append(("block", leaf.layout, leaf.shape))
            elif isinstance(leaf, mx.array):
                arrays.append(leaf)
                kinds.append(("array",))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    raise ConversionError(
                        f"unimesh.compile on MLX: {what} has {short(leaf)} "
                        f"({type(leaf).__name__}), neither an array nor a hashable constant; "
                        "pass arrays, MLXArrays, numbers or strings"
                    ) from None
                kinds.append(("constant", leaf, _constant(leaf)))  # 1 and True: two traces
        return arrays, kinds, treedef

    def join(arrays: Any, kinds: list[Any], treedef: Any) -> Any:
        given = iter(arrays)
        leaves = []
        for kind in kinds:
            if kind[0] == "block":
                leaves.append(MLXArray(next(given), kind[1], kind[2]))
            elif kind[0] == "array":
                leaves.append(next(given))
            else:
                leaves.append(kind[1])
        return optree.tree_unflatten(treedef, leaves)

    probe = tracing.tracer_probe()

    #: positional MLXArray arguments: (id of each layout, shape) -> trace, without flattening
    #: (each trace holds its layouts, so an id found here is that layout's)
    quick: dict[Any, Any] = {}
    #: any arguments: (tree structure, each leaf's signature) -> trace
    by_signature: dict[Any, Any] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        # on 4 processes over 2 cores every microsecond of Python here counts twice
        at = (
            None
            if kwargs
            else tuple([(id(a.layout), a.shape) if type(a) is MLXArray else None for a in args])
        )
        trace = quick.get(at) if at is not None else None
        if trace is not None:
            arrays = [a.local for a in args]
        else:
            # any tree: keyed by its structure and each leaf's (id of layout, shape), type
            # or constant, as long as the trace holds those very layouts
            leaves, treedef = optree.tree_flatten(  # type: ignore[var-annotated]
                (args, kwargs),  # type: ignore[arg-type]
                none_is_leaf=True,
            )
            sig = (treedef, tuple([_signature(leaf, mx.array) for leaf in leaves]))
            try:
                trace = by_signature.get(sig)
            except TypeError:  # an unhashable constant: split() says so
                trace = None
            if trace is not None:
                arrays = [
                    leaf.local if type(leaf) is MLXArray else leaf
                    for leaf, kind in zip(leaves, trace.kinds)
                    if kind[0] != "constant"
                ]
            else:
                arrays, kinds, treedef = split((args, kwargs), "an argument")
                key = (
                    treedef,
                    tuple([("constant", k[2]) if k[0] == "constant" else k for k in kinds]),
                )
                trace = traces.get(key)
                if trace is None:
                    trace = traces[key] = _Trace(kinds, treedef)
                if all(
                    leaf.layout is kind[1]
                    for leaf, kind in zip(leaves, trace.kinds)
                    if type(leaf) is MLXArray
                ):
                    by_signature[sig] = trace
                    if at is not None and None not in at:
                        quick[at] = trace
        # an outer transform (mx.grad of a function calling this one) differentiates the
        # compiled graph after it is traced: such calls keep the rules (asked only where the
        # answer matters: the first call, and calls that could run the lean trace)
        outer = (trace.full is None or trace.lean_ok is True) and (
            probe is None or any(map(probe, arrays))
        )
        if outer or trace.lean_ok is not True:
            if trace.full is None:
                trace.full = mx.compile(trace.blocks, **options)
                transposed = RULES.transposed
                out = trace.full(*arrays)  # the first call traces, with the gradient rules
                if not outer:  # a gradient inside it went through a rule, or none did
                    trace.lean_ok = RULES.transposed == transposed
            else:
                out = trace.full(*arrays)
        else:
            if trace.lean is None:  # the same function traced again, without the rules
                trace.lean = mx.compile(trace.blocks, **options)
                RULES.forward_only = True
                try:
                    out = trace.lean(*arrays)
                finally:
                    RULES.forward_only = False
            else:
                out = trace.lean(*arrays)
        if trace.out_blocks is not None:
            return optree.tree_unflatten(
                trace.out_treedef,
                [MLXArray(o, layout, shape) for o, (layout, shape) in zip(out, trace.out_blocks)],
            )
        return join(out, trace.out_kinds, trace.out_treedef)

    class _Trace:
        """The compiled traces for one set of argument kinds: ``full`` with the gradient
        rules; ``lean`` without them, made once the first trace (outside any transform) has
        shown that no gradient goes through a rule (``lean_ok``), e.g. a forward step."""

        full: Callable[..., Any] | None = None
        lean: Callable[..., Any] | None = None
        lean_ok: bool | None = None
        out_kinds: list[Any]
        out_treedef: Any
        #: (layout, shape) of each result where all are MLXArrays
        out_blocks: list[Any] | None = None

        def __init__(self, kinds: list[Any], treedef: Any) -> None:
            self.kinds, self.treedef = kinds, treedef

        def blocks(self, *given: Any) -> list[Any]:
            """The step on blocks: what ``mx.compile`` traces (this Python runs only while it
            traces, on every trace it makes: a first call, a new shape, after an error)."""
            a, kw = join(given, self.kinds, self.treedef)
            with _tracing(), own_chain():
                result = fn(*a, **kw)
            out, self.out_kinds, self.out_treedef = split(result, "the result")
            self.out_blocks = (
                [(k[1], k[2]) for k in self.out_kinds]
                if all(k[0] == "block" for k in self.out_kinds)
                else None
            )
            return out

    call.__name__ = getattr(fn, "__name__", "compiled")
    call.__doc__ = getattr(fn, "__doc__", None)
    return call
