"""torch's fake process group for in-process tests of the torch backend."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def fake_torch_world(rank: int, world: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` under torch's fake group (a world an earlier
    test left is ended first); the group is destroyed after the block."""
    dist = pytest.importorskip("torch.distributed")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
