"""``mx.compile`` of a unimesh step (:func:`unimesh.compile` on MLX).

``mx.compile`` takes functions of trees of ``mx.array`` and constants; a unimesh step takes and
returns :class:`~unimesh_mlx.translate.MLXArray` values (a block plus its layout and global
shape). :func:`compiled` hands each MLXArray to the compiled function as its block and keeps the
layout and shape aside: they are static, like the shapes a jitted function is traced for, so
they are part of the key that picks the compiled trace (a new layout traces again). Results
come back as MLXArrays with the layouts the trace produced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unimesh import ConversionError
from unimesh.messages import short

from .translate import MLXArray


def _is_leaf(x: Any) -> bool:
    return isinstance(x, MLXArray)


def compiled(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` under ``mx.compile(..., **options)``, taking and returning MLXArrays."""
    import mlx.core as mx
    import optree

    traces: dict[Any, tuple[Callable[..., Any], dict[str, Any]]] = {}

    def split(tree: Any, what: str) -> tuple[list[Any], list[Any], Any]:
        """(the arrays handed to mx.compile, what each leaf is, the tree's structure)."""
        leaves, treedef = optree.tree_flatten(tree, is_leaf=_is_leaf, none_is_leaf=True)
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
                kinds.append(("constant", leaf))
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

    def call(*args: Any, **kwargs: Any) -> Any:
        arrays, kinds, treedef = split((args, kwargs), "an argument")
        key = (treedef, tuple(kinds))
        if key not in traces:
            result_of: dict[str, Any] = {}

            def blocks(*given: Any) -> list[Any]:
                a, kw = join(given, kinds, treedef)
                out, out_kinds, out_def = split(fn(*a, **kw), "the result")
                result_of["kinds"], result_of["treedef"] = out_kinds, out_def
                return out

            traces[key] = (mx.compile(blocks, **options), result_of)
        run, result_of = traces[key]
        out = run(*arrays)
        return join(out, result_of["kinds"], result_of["treedef"])

    call.__name__ = getattr(fn, "__name__", "compiled")
    call.__doc__ = getattr(fn, "__doc__", None)
    return call
