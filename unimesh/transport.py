"""A backend's reshard transport: the six operations only the framework can do.

:mod:`unimesh.moves` plans which piece of which block goes where; :mod:`unimesh.transfer`
cuts, packs, unpacks, writes and joins the pieces (with the backend's
:class:`~unimesh.arrays.Arrays`) and calls these; :func:`unimesh.reshard` is the verb above
both, and :mod:`unimesh.link` puts the same plan between two jobs. A backend returns its
transport from :meth:`unimesh.Backend.transport`; the defaults here are a framework of one
process whose blocks are numpy (TensorFlow's). A move, on every process, calls:

1. :meth:`Transport.processes` once per move: the process of each device id (the plan);
2. for each round of the plan's schedule, :meth:`Transport.exchange`, on every process alike
   (one may have nothing to send or receive in a round);
3. :meth:`Transport.take` for each piece that lands on a device (a piece of this framework's
   or, across frameworks, another framework's block from its :meth:`Transport.export`);
4. where :attr:`Transport.writes_in_place`, :meth:`Transport.empty` for each target block
   the pieces are written into as they arrive (else the core joins them, and asks
   :meth:`Transport.empty` only for a block no piece fills);
5. before all of it, :meth:`Transport.native`: the framework's own move where it is as cheap
   as the plan (then 1-4 do not run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import UnsupportedError

if TYPE_CHECKING:
    from .backend import Backend
    from .layout import Layout

__all__ = ["TRANSPORT_OPS", "Transport"]

#: The operations a transport may override, with what each promises (the docs' table).
TRANSPORT_OPS: dict[str, str] = {
    "processes": "the process index of each logical device id",
    "exchange": "flat buffers sent to and received from peer processes, one round",
    "take": "a block in: this framework's array on a device (a piece, or DLPack)",
    "export": "a block out, as another framework takes it (DLPack, no gradient)",
    "empty": "a new block on a device (written into where writes_in_place)",
    "native": "the framework's own move where it is as cheap as the plan",
}


class Transport:
    """The transport of ``backend``'s reshards: its :meth:`processes`, :meth:`exchange`,
    :meth:`take`, :meth:`export`, :meth:`empty` and :meth:`native`. Subclass it and
    override what the framework does otherwise; the core does the rest."""

    #: whether the framework's arrays take item assignment (torch): the core then writes each
    #: piece into an :meth:`empty` block as it arrives; else it joins them with the backend's
    #: ``Arrays.concatenate`` once all are there (JAX and MLX arrays are immutable)
    writes_in_place: ClassVar[bool] = False

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name
        #: the backend's array operations (joining pieces)
        self.arrays = backend.arrays()

    @classmethod
    def has(cls, op: str) -> bool:
        """Whether this transport overrides ``op`` (one of :data:`TRANSPORT_OPS`)."""
        return getattr(cls, op) is not getattr(Transport, op)

    def processes(self, device_ids: Sequence[int]) -> list[int]:
        """The process index of each logical device id. Default: one process holds them all."""
        return [0] * len(device_ids)

    def exchange(
        self, sends: Mapping[int, Sequence[Any]], counts: Mapping[int, int], dtype: Any
    ) -> dict[int, Any]:
        """Send ``sends[q]`` (flat native buffers, in order: one message) to process ``q`` and
        receive from each ``q`` of ``counts`` one flat buffer of ``counts[q]`` elements of the
        framework's ``dtype`` (what ``q`` sent, its buffers one after another), on the
        framework's own transport; every process calls it with the matching arguments.
        Default: one process, nothing to exchange."""
        if sends or counts:
            raise UnsupportedError(
                f"the {self.name} backend moves no data between processes; reshard within "
                "this process's devices",
                backend=self.name,
                capability="multi_process",
            )
        return {}

    def take(self, block: Any, device_id: int | None) -> Any:
        """``block`` as this framework's array on logical device ``device_id`` (None: where it
        is): a piece of this framework's (a copy only where it lives on another device), or
        another framework's block from its :meth:`export` (DLPack: no copy where the memory
        can be shared). Default: this framework's pieces as they are; other frameworks'
        blocks are refused (a transport that takes them overrides this)."""
        return block

    def export(self, block: Any) -> Any:
        """A native block as another framework takes it (a DLPack producer): no gradient
        crosses frameworks. Default: as it is."""
        return block

    def empty(self, dtype: Any, shape: tuple[int, ...], device_id: int | None = None) -> Any:
        """A new block of ``shape`` of the framework's ``dtype`` on logical device
        ``device_id`` (None: where the framework puts a new array). Where
        :attr:`writes_in_place`, the core fills it by item assignment (``block[index] =
        piece``) as pieces arrive, so that no piece waits to be joined."""
        import numpy as np

        return np.empty(shape, dtype=np.dtype(dtype))

    def native(
        self, array: Any, source: Layout | None, target: Layout, shape: tuple[int, ...]
    ) -> tuple[Any, dict[str, int] | None] | None:
        """The framework's own move of ``array`` to ``target`` where it is as cheap as the
        plan (JAX within one device set), with the bytes it moved (None: the plan's, which
        the core counts only where ``stats`` asks); None to follow the plan.
        ``source`` None: an array of this framework whose layout only its tracer knows (a JAX
        tracer under ``jit`` or ``grad``); return it moved by the framework's own
        differentiable verb, or None where it is a plain tensor that ``distribute`` lays out."""
        return None

    def refuse_foreign(self) -> None:
        """Raise the refusal of a transport that takes no other framework's blocks (the
        default :meth:`take`); nothing where it takes them."""
        if not self.has("take"):
            raise UnsupportedError(
                f"the {self.name} backend takes no other framework's arrays, so reshard(..., "
                f"backend={self.name!r}) cannot hand it one; reshard on the array's own "
                "framework, or go through unimesh.save and unimesh.load",
                backend=self.name,
                capability="reshard",
            )
