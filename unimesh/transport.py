"""The transport a reshard plan is handed to: the ``reshard`` hooks of :class:`unimesh.Backend`
(a base class of it), with their defaults for a framework of one process.

:mod:`unimesh.moves` plans which piece of which block goes where; :mod:`unimesh.transfer`
carries the plan out through these hooks; :func:`unimesh.reshard` is the verb above both. A
backend overrides them in its own transport class (torch's
``unimesh_torch.transport.TorchTransport``) or beside its translator (JAX, MLX, Keras).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import UnsupportedError

if TYPE_CHECKING:
    from .layout import Layout

__all__ = ["Transport"]


class Transport:
    """The ``reshard`` layer of the backend contract (see :data:`unimesh.contract.HOOKS`):
    where each device's process is, this process's native blocks, moving flat buffers between
    processes and pieces between devices, joining them, and handing blocks to another
    framework. The core cuts, packs, unpacks and reduces. :class:`unimesh.Backend` inherits
    it; nothing else does."""

    name: ClassVar[str] = ""  # the backend's (declared on Backend)
    #: whether the framework's arrays take item assignment (torch): the core then writes each
    #: piece into an :meth:`empty_block` as it arrives; else it joins them with
    #: :meth:`concatenate` once all are there (JAX and MLX arrays are immutable)
    writes_in_place: ClassVar[bool] = False

    def local_shards(self, array: Any) -> dict[int, Any]:  # Backend's translator hook
        raise NotImplementedError

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:  # Backend's
        raise NotImplementedError

    def device_processes(self, device_ids: Sequence[int]) -> list[int]:
        """The process index of each logical device id. Default: one process holds them all."""
        return [0] * len(device_ids)

    def native_blocks(self, array: Any) -> dict[int, Any]:
        """This process's blocks of a native distributed array, ``{device id: native block}``,
        each on its device (no copy). Default: :meth:`local_shards` (numpy copies)."""
        return self.local_shards(array)

    def exchange_buffers(
        self,
        sends: Mapping[int, Sequence[Any]],
        counts: Mapping[int, int],
        dtype: Any,
    ) -> dict[int, Any]:
        """Send ``sends[q]`` (flat native buffers, in order: one message) to process ``q`` and
        receive from each ``q`` of ``counts`` one flat buffer of ``counts[q]`` elements of the
        framework's ``dtype`` (what ``q`` sent, its buffers one after another), on the
        framework's own transport; every process calls it with the matching arguments. The
        core packs and unpacks. Default: one process, nothing to exchange."""
        if sends or counts:
            raise UnsupportedError(
                f"the {self.name} backend moves no data between processes; reshard within "
                "this process's devices",
                backend=self.name,
                capability="multi_process",
            )
        return {}

    def move_with_gradient(
        self,
        blocks: Mapping[int, Any],
        forward: Callable[[Mapping[int, Any]], dict[int, Any]],
        backward: Callable[[Mapping[int, Any]], dict[int, Any]],
        like: Any,
    ) -> dict[int, Any]:
        """``forward(blocks)`` (this process's target blocks from its source ``blocks``), as
        one step of the framework's autodiff where it records one: given the cotangents of
        the target blocks, ``backward`` gives those of the source blocks (it moves data too,
        so every process that took part in the forward must run it). ``like`` is the array
        moved. Default: ``forward(blocks)``, outside any autodiff."""
        return forward(blocks)

    def place(self, piece: Any, device_id: int) -> Any:
        """``piece`` on logical device ``device_id`` (a copy only where it lives elsewhere).
        Default: as it is (one device per process)."""
        return piece

    def concatenate(self, parts: Sequence[Any], axis: int) -> Any:
        """The framework's concatenate of native ``parts`` along ``axis``."""
        import numpy as np

        return np.concatenate(parts, axis=axis)

    def empty_block(self, dtype: Any, shape: tuple[int, ...], device_id: int | None = None) -> Any:
        """A new block of ``shape`` of the framework's ``dtype`` on logical device
        ``device_id`` (None: where the framework puts a new array). Where
        :attr:`writes_in_place`, the core fills it by item assignment (``block[index] =
        piece``) as pieces arrive, so that no piece waits to be joined."""
        import numpy as np

        return np.empty(shape, dtype=np.dtype(dtype))

    def export_block(self, block: Any) -> Any:
        """A native block as another framework takes it (a DLPack producer): no gradient
        crosses frameworks. Default: as it is."""
        return block

    def import_block(self, block: Any, device_id: int | None) -> Any:
        """Another framework's block (a DLPack producer, from its :meth:`export_block`) as
        this framework's, on logical device ``device_id`` (None: wherever it is; for its
        dtype): no copy where DLPack can share the memory. Default: refused (the backend
        takes no other framework's arrays)."""
        raise UnsupportedError(
            f"the {self.name} backend takes no other framework's arrays, so reshard(..., "
            f"backend={self.name!r}) cannot hand it one; reshard on the array's own framework, "
            "or go through unimesh.save and unimesh.load",
            backend=self.name,
            capability="reshard",
        )

    def check_reshard(
        self, array: Any, source: Layout, target: Layout, shape: tuple[int, ...]
    ) -> None:
        """Refuse (``UnsupportedError``) a move this backend cannot make, before any array of
        the call moves; ``array`` None: the reverse move of a gradient (the cotangents), checked
        before it moves. Default: a move between processes needs :meth:`exchange_buffers`."""
        if (
            type(self).exchange_buffers is Transport.exchange_buffers
            and self.initialize(300.0)[1] > 1
        ):
            raise UnsupportedError(
                f"the {self.name} backend moves no data between processes, so it cannot "
                f"reshard {source!r} -> {target!r} across its {self.initialize(300.0)[1]} "
                "processes; save and load through a checkpoint instead",
                backend=self.name,
                capability="multi_process",
            )

    def native_reshard(
        self, array: Any, source: Layout | None, target: Layout, shape: tuple[int, ...]
    ) -> tuple[Any, dict[str, int] | None] | None:
        """The framework's own move of ``array`` to ``target`` where it is as cheap as the
        plan (JAX within one device set), with the bytes it moved (None: the plan's, which
        the core counts only where ``stats`` asks); None to follow the plan.
        ``source`` None: an array of this framework whose layout only its tracer knows (a JAX
        tracer under ``jit`` or ``grad``); return it moved by the framework's own
        differentiable verb, or None where it is a plain tensor that ``distribute`` lays out."""
        return None
