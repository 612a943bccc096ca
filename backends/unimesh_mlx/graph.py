"""A shard_map body's dataflow graph, read from MLX's ``mx.export_function`` callback: what
:mod:`unimesh.vmaplan` plans a program's cotangent sums from (JAX's check_vma placement)."""

from __future__ import annotations

from typing import Any

from unimesh.vmaplan import Graph, PlanError

from .runtime import import_mx

__all__ = ["BODY_GRAPH", "MLXGraph"]

#: the first two values of a constant that marks a collective in a traced body's graph
_MARK = (-1_912_731, 55_527)
#: MLX's distributed primitives: a body calling them itself is not planned
_DISTRIBUTED = frozenset({"AllReduce", "AllGather", "Send", "Recv", "ReduceScatter", "AllToAll"})


class MLXGraph:
    """MLX's :class:`unimesh.vmaplan.BodyGraph`: a body traced by ``mx.export_function``,
    each collective a marker found in the graph again."""

    def trace(self, run: Any, leaves: list[Any]) -> Graph:
        """The body's graph from ``mx.export_function`` with a callback (MLX hands it every
        input, constant and primitive with the names of the arrays it takes and makes). A body
        that draws from MLX's global random state draws once more here (MLX 0.32 gives no way
        to put its key back), once per trace."""
        mx = import_mx()
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, mx.array)]
        examples = [mx.zeros(leaves[i].shape, leaves[i].dtype) for i in at]

        def fn(*arrays: Any) -> Any:
            given = list(leaves)
            for i, a in zip(at, arrays):
                given[i] = a
            return run(given)

        events: list[dict[str, Any]] = []
        mx.export_function(events.append, fn, *examples)
        inputs: list[str | None] = [None] * len(leaves)
        outputs: list[str] = []
        tags: dict[str, int] = {}
        constants: set[str] = set()
        closed: set[str] = set()
        for event in events:  # the inputs, outputs and constants first, wherever they come
            kind = event["type"]
            if kind == "inputs":
                for i, (name, *_) in zip(at, event["inputs"]):
                    inputs[i] = name
            elif kind == "outputs":
                outputs = [name for name, *_ in event["outputs"]]
            elif kind == "constants":
                for name, value in event["constants"]:
                    constants.add(name)
                    if (
                        value.dtype == mx.int32
                        and value.shape == (3,)
                        and tuple(value[:2].tolist()) == _MARK
                    ):
                        tags[name] = int(value[2].item())
                    elif value.size > 1 and mx.issubdtype(value.dtype, mx.inexact):
                        # an array the body closes over, which a transform around the program
                        # may differentiate (MLX hands the callback a copy: whether it is
                        # traced cannot be asked; what it is computed from is in the graph);
                        # a 0-d constant is a number written in the body
                        closed.add(name)
        ops: list[tuple[tuple[str, ...], tuple[str, ...], int | None]] = []
        for event in events:
            if event["type"] != "primitive":
                continue
            name = event["name"]
            if name in _DISTRIBUTED:
                raise PlanError(f"the body calls MLX's {name} itself")
            ins = tuple(n for n, *_ in event["inputs"])
            outs = tuple(n for n, *_ in event["outputs"])
            marks = [tags[n] for n in ins if n in tags]
            if len(marks) > 1:
                raise PlanError(f"one {name} takes the marks of collectives {marks}")
            ins = tuple(n for n in ins if n not in tags)
            ops.append((ins, outs, marks[0] if marks else None))
        return Graph(
            inputs, ops, outputs, frozenset(constants), frozenset(closed), frozenset(tags.values())
        )

    def marker(self, site: int, x: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """``x``'s link to an operation on a constant that names ``site`` (found by
        :meth:`trace`), broadcast to the collective's result."""
        mx = import_mx()
        tag = mx.array([*_MARK, site], dtype=mx.int32)
        link = mx.array(0, mx.int32) if x is None else mx.sum(mx.equal(x, x).astype(mx.int32))
        mark = tag + link  # the one operation that takes the tag
        return mx.broadcast_to(mark[0].astype(dtype or mx.int32), shape)


BODY_GRAPH = MLXGraph()
