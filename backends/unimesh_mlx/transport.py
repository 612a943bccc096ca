"""The MLX backend's array operations (:class:`MLXArrays`, shared by the engine and the
reshard) and its reshard transport on ``mx.distributed`` (:class:`MLXTransport`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from unimesh import Layout
from unimesh.arrays import Arrays
from unimesh.transfer import same_blocks
from unimesh.transport import Transport

from . import tracing
from .process import PROCESS
from .runtime import host_to_mx, import_mx, mx_to_host
from .tracing import RULES
from .translate import MLXArray, MLXTranslator, is_fresh

__all__ = ["MLX_ARRAYS", "MLXArrays", "MLXTransport"]


class MLXArrays(Arrays):
    """``mlx.core``'s array operations (MLX's autodiff records them)."""

    def asarray(self, value: Any) -> Any:
        mx = import_mx()
        if isinstance(value, mx.array):
            return value
        return host_to_mx(value) if isinstance(value, (np.ndarray, np.generic)) else mx.array(value)

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        return import_mx().moveaxis(x, source, destination)

    def take(self, x: Any, index: list[int]) -> Any:
        mx = import_mx()
        return x[mx.array(index)] if len(index) > 1 else x[index[0] : index[0] + 1]

    def reduce(self, x: Any, op: str) -> Any:
        """``op`` over dim 0 in ``x``'s dtype (``mx.sum`` widens small ints: int8 -> int32;
        MLX's ``all_sum`` and JAX's ``psum`` keep the dtype, wrapping as they do)."""
        out = getattr(import_mx(), op)(x, axis=0)
        return out if out.dtype == x.dtype else out.astype(x.dtype)

    def zeros_like(self, x: Any) -> Any:
        return import_mx().zeros_like(x)

    def concatenate(self, parts: Sequence[Any], axis: int) -> Any:
        return import_mx().concatenate(list(parts), axis=axis)

    def to_host(self, x: Any) -> np.ndarray:
        return mx_to_host(x)

    def needs_grad(self, x: Any) -> bool:
        """Whether an MLX transform may trace ``x`` (:func:`.tracing.make_probe`); where this MLX
        cannot be asked, False only for an array made from host data (an argument's block
        from ``distribute`` or numpy)."""
        if RULES.forward_only:
            return False
        probe = tracing.tracer_probe()
        return not is_fresh(x) if probe is None else probe(x)

    def after(self, x: Any, done: Any) -> Any:
        return import_mx().depends(x, done)

    def evaluate(self, arrays: Sequence[Any]) -> None:
        import_mx().eval(*arrays)


#: the one instance (it holds nothing)
MLX_ARRAYS = MLXArrays()


class MLXTransport(Transport):
    """A reshard's pieces on ``mx.distributed`` (a device id is a rank of the world group)."""

    backend: MLXTranslator

    def processes(self, device_ids: Any) -> list[int]:
        """A device id is a rank of the world group: each device is its own process."""
        return [int(d) for d in device_ids]

    def native(
        self, array: Any, source: Layout | None, target: Layout, shape: tuple[int, ...]
    ) -> tuple[Any, dict[str, int] | None] | None:
        """To the layout the :class:`MLXArray` has: the array itself (immutable; nothing
        moves). Else None: the plan."""
        if source is None or not isinstance(array, MLXArray) or not same_blocks(source, target):
            return None
        return array, {}

    def exchange(self, sends: Any, counts: Any, dtype: Any) -> dict[int, Any]:
        """Each rank's buffers joined into one array, moved with ``mx.distributed.send`` and
        ``recv`` (:func:`_transport`)."""
        mx = import_mx()
        packed = {q: ps[0] if len(ps) == 1 else mx.concatenate(list(ps)) for q, ps in sends.items()}
        got = _transport(self.backend._world(), packed, dict(counts), dtype)
        return {q: got[q] for q in counts}

    def take(self, block: Any, device_id: int | None) -> Any:
        """An ``mx.array`` as it is (one device per rank); another framework's block through
        DLPack: a copy (an ``mx.array`` owns its memory)."""
        mx = import_mx()
        return block if isinstance(block, mx.array) else mx.array(block)

    def empty(self, dtype: Any, shape: tuple[int, ...], device_id: int | None = None) -> Any:
        """Zeros on this rank's device (the core joins the pieces of an MLX block)."""
        return import_mx().zeros(shape, dtype=dtype)


def _transport(
    group: Any, packed: dict[int, Any], totals: dict[int, int], dtype: Any
) -> dict[int, Any]:
    """Flat arrays to (``packed``) and from (``totals``: element counts) each rank. Under MPI,
    straight to the rank, in rounds where every rank has at most one partner (the circle
    method: in round k, rank r with (k - r) mod n), the lower rank of a pair sending first,
    so that blocking sends never wait in a cycle and the pairs of a round run together.
    MLX's ring backend links each rank to its neighbours only: there every rank learns the
    sizes of all messages (one small ``all_gather``) and each message is passed on from
    neighbour to neighbour, one hop at a time in an order all ranks share."""
    mx = import_mx()
    me = int(group.rank())
    got: dict[int, Any] = {}
    if PROCESS.launcher.mpi_ranks:
        n = int(group.size())
        for k in range(n):  # round k pairs each rank with (k - rank) mod n: every pair once
            peer = (k - me) % n
            if peer == me or (peer not in packed and peer not in totals):
                continue
            # the lower rank sends first, the higher receives first: no cycle of waits
            for send in (me < peer, me > peer):
                if send and peer in packed:
                    mx.eval(mx.distributed.send(packed[peer], peer, group=group))
                elif not send and peer in totals:
                    got[peer] = mx.distributed.recv((totals[peer],), dtype, peer, group=group)
                    mx.eval(got[peer])
        return got
    n = int(group.size())
    row = mx.array([int(packed[q].size) if q in packed else 0 for q in range(n)])
    sizes = np.asarray(mx.distributed.all_gather(row[None], group=group)).reshape(n, n)
    for src, dst in zip(*np.nonzero(sizes)):
        src, dst = int(src), int(dst)
        carried = packed.get(dst) if src == me else None
        hop = src
        while hop != dst:
            nxt = (hop + 1) % n
            if me == hop:
                mx.eval(mx.distributed.send(carried, nxt, group=group))
                carried = None
            elif me == nxt:
                carried = mx.distributed.recv((int(sizes[src, dst]),), dtype, hop, group=group)
                mx.eval(carried)
            hop = nxt
        if me == dst:
            got[src] = carried
    return got
