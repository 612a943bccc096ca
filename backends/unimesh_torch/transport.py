"""The torch backend's reshard transport (``unimesh.reshard``'s runtime hooks): the pieces a
plan of ``unimesh.moves`` names, sent and received in one ``batch_isend_irecv`` per round on
the default process group, written into the target blocks as they arrive; the move under
autograd as one ``autograd.Function`` whose backward is the reverse move; DLPack handoffs to
and from another framework."""

from __future__ import annotations

import weakref
from typing import Any

from unimesh import Layout, UnsupportedError
from unimesh.transfer import refuse_gradient_of_extreme, same_blocks

from .autograd import move_function
from .runtime import TorchRuntime, import_dist, import_torch

__all__ = ["TorchTransport"]

#: process groups that have had a collective from every rank before their first point-to-point
#: batch: torch asks every rank of a group to take part in the group's first
#: ``batch_isend_irecv`` (NCCL creates its communicator there), and a rank may have nothing to
#: exchange in a round
_P2P_READY: weakref.WeakSet[Any] = weakref.WeakSet()


class TorchTransport(TorchRuntime):
    """The reshard transport, over the runtime (a rank is a device)."""

    writes_in_place = True

    def device_processes(self, device_ids: Any) -> list[int]:
        """A mesh's device id is a global rank: each device is its own process."""
        return [int(d) for d in device_ids]

    def native_reshard(
        self, array: Any, source: Layout | None, target: Layout, shape: tuple[int, ...]
    ) -> tuple[Any, dict[str, int] | None] | None:
        """To the layout the DTensor has: torch's own ``redistribute`` to its placements, a new
        DTensor on the same local tensor (nothing moves; differentiable, and a Parameter
        gives a plain DTensor as any reshard does). Else None: the plan."""
        from torch.distributed.tensor import DTensor

        if source is None or not isinstance(array, DTensor) or not same_blocks(source, target):
            return None
        return array.redistribute(array.device_mesh, array.placements), {}

    def native_blocks(self, array: Any) -> dict[int, Any]:
        """``{rank: the DTensor's local tensor}`` (none when the rank is outside its mesh)."""
        if array.device_mesh.get_coordinate() is None:
            return {}
        return {import_dist().get_rank(): array.to_local()}

    def exchange_buffers(self, sends: Any, counts: Any, dtype: Any) -> dict[int, Any]:
        """One message per pair of ranks each way (a rank's buffers joined, as bytes), on the
        default process group: ``batch_isend_irecv``."""
        torch, dist = import_torch(), import_dist()
        world = dist.group.WORLD
        if world is not None and world not in _P2P_READY:  # every rank's first round
            if dist.get_world_size() > 1:
                dist.all_reduce(torch.zeros(1, device=torch.device(self._device_type(None))))
            _P2P_READY.add(world)
        if not sends and not counts:
            return {}
        device = torch.device(self._device_type(None))
        outgoing = {q: ps[0] if len(ps) == 1 else torch.cat(list(ps)) for q, ps in sends.items()}
        return _p2p(outgoing, dict(counts), dtype, device)

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

    def export_block(self, block: Any) -> Any:
        """The block detached (DLPack carries no autograd; no gradient crosses frameworks)."""
        return block.detach()

    def import_block(self, block: Any, device_id: int | None) -> Any:
        """``torch.from_dlpack``: the other framework's memory, shared (no copy)."""
        return import_torch().from_dlpack(block)

    def empty_block(self, dtype: Any, shape: tuple[int, ...], device_id: int | None = None) -> Any:
        """``torch.empty`` on this rank's device: each piece is copied in as it arrives (no
        join, no waiting piece)."""
        torch = import_torch()
        return torch.empty(shape, dtype=dtype, device=torch.device(self._device_type(None)))

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

    def concatenate(self, parts: Any, axis: int) -> Any:
        return import_torch().cat(list(parts), dim=axis)


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
