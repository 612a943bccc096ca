"""The engine of ``unimesh.link`` on torch.distributed: a ``TCPStore`` at the link's address is
the rendezvous, and a ``ProcessGroupGloo`` of both jobs' processes, made from it and apart
from each job's own default group, moves the byte buffers point to point (``send``/``recv``,
a tag per message). It works whatever framework each job computes with: the buffers are
numpy arrays wrapped as CPU tensors, no copy."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .runtime import import_dist, import_torch

if TYPE_CHECKING:
    from unimesh.link import Message

__all__ = ["GlooEngine", "GlooWire"]


class GlooEngine:
    """The ``unimesh.links`` entry point ``gloo``."""

    def store(self, host: str, port: int, is_host: bool, timeout: float) -> Any:
        """The rendezvous: a ``TCPStore`` served here (``is_host``) or reached at
        ``host:port``, waiting up to ``timeout`` seconds for an answer."""
        dist = import_dist()
        return dist.TCPStore(
            host,
            port,
            None,
            is_host,
            timedelta(seconds=timeout),
            wait_for_workers=False,
        )

    def connect(self, store: Any, prefix: str, rank: int, size: int, timeout: float) -> GlooWire:
        """A gloo group of ``size`` processes over the store (keys under ``prefix``)."""
        dist = import_dist()
        # a send only reads its buffer, which may be a read-only block (a jax.Array's): torch
        # warns of writing to it. One filter for that message (catch_warnings per call would
        # change the process's filters while other threads run)
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        group = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout)
        )
        return GlooWire(group)


class GlooWire:
    """Byte buffers between the link's processes on one gloo group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def start(self, sends: Sequence[Message], receives: Sequence[Message]) -> Callable[[], None]:
        """Post every send and receive (gloo's ``send``/``recv``, matched by tag); the
        returned call waits for all of them."""
        torch = import_torch()
        works = [
            self.group.send([torch.from_numpy(buf)], q, tag) for q, tag, buf in sends if buf.size
        ]
        works += [
            self.group.recv([torch.from_numpy(buf)], q, tag) for q, tag, buf in receives if buf.size
        ]

        def wait() -> None:
            for work in works:
                work.wait()

        return wait

    def close(self) -> None:
        self.group = None
