"""The torch backend's reshard: its array operations (:class:`TorchArrays`, shared with the
engine), its transport (:class:`TorchTransport`: the pieces a plan of ``unimesh.moves`` names,
sent and received in one ``batch_isend_irecv`` per round on the default process group,
written into the target blocks as they arrive; DLPack handoffs to and from another
framework) and the move under autograd as one ``autograd.Function`` whose backward is the
reverse move (:class:`TorchReshard`, the backend's hooks)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unimesh import Layout, UnsupportedError
from unimesh.arrays import Arrays
from unimesh.transfer import refuse_gradient_of_extreme, same_blocks
from unimesh.transport import Transport

from .autograd import move_function
from .runtime import TorchRuntime, import_dist, import_torch

__all__ = ["TorchArrays", "TorchReshard", "TorchTransport"]

#: process groups that have had a collective from every rank before their first point-to-point
#: batch: torch asks every rank of a group to take part in the group's first
#: ``batch_isend_irecv`` (NCCL creates its communicator there), and a rank may have nothing to
#: exchange in a round
_P2P_READY: weakref.WeakSet[Any] = weakref.WeakSet()


@functools.cache
def hot() -> tuple[Callable[[], bool], Any]:
    """torch's functions that the engine calls for every collective (``is_grad_enabled``,
    ``DisableTorchFunction``), looked up once torch is imported."""
    torch = import_torch()
    return torch.is_grad_enabled, torch._C.DisableTorchFunction


class TorchArrays(Arrays):
    """torch's array operations (differentiable: the engine runs them under autograd)."""

    def __init__(self, runtime: TorchRuntime) -> None:
        self.runtime = runtime

    def asarray(self, value: Any) -> Any:
        torch = import_torch()
        if isinstance(value, torch.Tensor):
            return value
        # numbers go where the collectives run: the GPU under NCCL
        device = self.runtime._device_type(None) if import_dist().is_initialized() else None
        return torch.as_tensor(value, device=device)

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        return import_torch().movedim(x, source, destination)

    def take(self, x: Any, index: list[int]) -> Any:
        return x[index]

    def reduce(self, x: Any, op: str) -> Any:
        """``op`` over dim 0 in ``x``'s dtype (``sum`` widens integers to int64)."""
        if op != "sum":
            return x.amax(0) if op == "max" else x.amin(0)
        return x.sum(0, dtype=x.dtype)

    def zeros_like(self, x: Any) -> Any:
        return import_torch().zeros_like(x)

    def concatenate(self, parts: Sequence[Any], axis: int) -> Any:
        return import_torch().cat(list(parts), dim=axis)

    def to_host(self, x: Any) -> np.ndarray:
        return x.detach().cpu().numpy()  # type: ignore[no-any-return]

    def needs_grad(self, x: Any) -> bool:
        return bool(x.requires_grad) and hot()[0]()


class TorchTransport(Transport):
    """The reshard transport over the runtime (a rank is a device)."""

    writes_in_place = True
    backend: TorchRuntime

    def processes(self, device_ids: Any) -> list[int]:
        """A mesh's device id is a global rank: each device is its own process."""
        return [int(d) for d in device_ids]

    def native(
        self, array: Any, source: Layout | None, target: Layout, shape: tuple[int, ...]
    ) -> tuple[Any, dict[str, int] | None] | None:
        """To the layout the DTensor has: torch's own ``redistribute`` to its placements, a new
        DTensor on the same local tensor (nothing moves; differentiable, and a Parameter
        gives a plain DTensor as any reshard does). Else None: the plan."""
        from torch.distributed.tensor import DTensor

        if source is None or not isinstance(array, DTensor) or not same_blocks(source, target):
            return None
        return array.redistribute(array.device_mesh, array.placements), {}

    def exchange(self, sends: Any, counts: Any, dtype: Any) -> dict[int, Any]:
        """One message per pair of ranks each way (a rank's buffers joined, as bytes), on the
        default process group: ``batch_isend_irecv``."""
        torch, dist = import_torch(), import_dist()
        device = torch.device(self.backend._device_type(None))
        world = dist.group.WORLD
        if world is not None and world not in _P2P_READY:  # every rank's first round
            if dist.get_world_size() > 1:
                dist.all_reduce(torch.zeros(1, device=device))
            _P2P_READY.add(world)
        if not sends and not counts:
            return {}
        outgoing = {q: ps[0] if len(ps) == 1 else torch.cat(list(ps)) for q, ps in sends.items()}
        return _p2p(outgoing, dict(counts), dtype, device)

    def export(self, block: Any) -> Any:
        """The block detached (DLPack carries no autograd; no gradient crosses frameworks)."""
        return block.detach()

    def take(self, block: Any, device_id: int | None) -> Any:
        """A tensor as it is (one device per rank); another framework's block through
        ``torch.from_dlpack``: its memory, shared (no copy)."""
        torch = import_torch()
        return block if isinstance(block, torch.Tensor) else torch.from_dlpack(block)

    def empty(self, dtype: Any, shape: tuple[int, ...], device_id: int | None = None) -> Any:
        """``torch.empty`` on this rank's device: each piece is copied in as it arrives (no
        join, no waiting piece)."""
        torch = import_torch()
        return torch.empty(shape, dtype=dtype, device=torch.device(self.backend._device_type(None)))


class TorchReshard(TorchRuntime):
    """The backend's reshard hooks: its arrays, its transport, a DTensor's blocks, the move
    under autograd and the refusals autograd needs."""

    def arrays(self) -> TorchArrays:
        return TorchArrays(self)

    def transport(self) -> TorchTransport:
        return TorchTransport(self)

    def native_blocks(self, array: Any) -> dict[int, Any]:
        """``{rank: the DTensor's local tensor}`` (none when the rank is outside its mesh)."""
        if array.device_mesh.get_coordinate() is None:
            return {}
        return {import_dist().get_rank(): array.to_local()}

    def move_with_gradient(
        self, blocks: Any, forward: Any, backward: Any, like: Any
    ) -> dict[int, Any]:
        """Under autograd (``like`` requires grad), one ``autograd.Function``: its backward
        is the reverse move of the cotangents. A zero-size leaf of its own is an input too,
        so that a rank holding no source block (it only receives) runs the backward its
        senders wait for (``DTensor.to_local``'s backward fails on a rank outside the
        DTensor's mesh)."""
        torch = import_torch()
        if not (getattr(like, "requires_grad", False) and torch.is_grad_enabled()):
            return dict(forward(blocks))
        devices = sorted(blocks)
        anchor = torch.zeros(0, dtype=like.dtype, requires_grad=True)
        box: dict[str, Any] = {}
        outs = move_function().apply(
            (devices, forward, backward, box), anchor, *(blocks[d] for d in devices)
        )
        return dict(zip(box["out"], outs))

    def check_reshard(
        self, array: Any, source: Layout, target: Layout, shape: tuple[int, ...]
    ) -> None:
        """Under autograd, every rank that sends must hold a target block too: a rank outside
        the target mesh gets an empty result that no loss reaches, so it would never run the
        backward its peers wait for."""
        torch = import_torch()
        if not (getattr(array, "requires_grad", False) and torch.is_grad_enabled()):
            return
        refuse_gradient_of_extreme(self.name, source)
        outside = sorted(
            set(source.mesh.device_ids.ravel().tolist())
            - set(target.mesh.device_ids.ravel().tolist())
        )
        if outside:
            raise UnsupportedError(
                f"reshard() of a DTensor that requires grad from {source!r} to {target!r}: "
                f"ranks {outside} hold source blocks but no target block, so they could not "
                "take part in the backward; reshard onto a mesh with every source rank, or "
                "under torch.no_grad()",
                backend=self.name,
            )


def _p2p(
    outgoing: dict[int, Any], incoming: dict[int, int], dtype: Any, device: Any
) -> dict[int, Any]:
    """Flat tensors to and from each peer rank (``incoming``: element counts), as bytes, in
    one ``batch_isend_irecv``."""
    torch, dist = import_torch(), import_dist()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    ops, inbox = [], {}
    for q in sorted(set(outgoing) | set(incoming)):
        if q in outgoing:
            flat = outgoing[q].detach().contiguous()
            ops.append(dist.P2POp(dist.isend, flat.view(torch.uint8), q))
        if q in incoming:
            inbox[q] = torch.empty(incoming[q] * itemsize, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, inbox[q], q))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {q: buffer.view(dtype) for q, buffer in inbox.items()}
