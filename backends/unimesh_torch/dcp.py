"""A unimesh checkpoint (or any checkpoint :func:`unimesh.open_checkpoint` reads) as a torch
Distributed Checkpoint ``StorageReader``: ``dcp.load(state_dict,
storage_reader=unimesh_torch.CheckpointReader(path))`` loads it with torch's own API, DCP's
planner resharding each saved box onto the state dict's DTensors. Each process reads only the
byte runs of the requests its planner makes. Imports torch (this module is loaded when
``unimesh_torch.CheckpointReader`` is first used)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from unimesh.checkpoint.reader import Checkpoint, open_checkpoint
from unimesh.errors import CheckpointError

from .translate import from_host

__all__ = ["CheckpointReader"]


class CheckpointReader(StorageReader):
    """DCP's ``StorageReader`` over a unimesh checkpoint at ``path`` (also Hugging Face
    safetensors and DCP directories, as :func:`unimesh.open_checkpoint` reads them). Every
    saved box is one DCP chunk; ``verify=True`` checks the boxes' checksums as they are read."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        super().__init__()
        self.path: str | os.PathLike[str] = path
        self.verify = verify
        self._ckpt: Checkpoint | None = None
        self._where: dict[Any, tuple[str, int]] = {}

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint, opened on first use."""
        if self._ckpt is None:
            self._ckpt = open_checkpoint(self.path, verify=self.verify)
        return self._ckpt

    @property
    def bytes_read(self) -> int:
        """Bytes read from data files so far by this process."""
        return 0 if self._ckpt is None else self._ckpt.bytes_read

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._ckpt = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            open_checkpoint(checkpoint_id)
        except (CheckpointError, OSError, TypeError):
            return False
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        ckpt = self.checkpoint
        entries: dict[str, Any] = {}
        storage: dict[MetadataIndex, tuple[str, int]] = {}
        for name, t in ckpt.tensors.items():
            entries[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=getattr(torch, t.dtype)),
                size=torch.Size(t.shape),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(b.offset), sizes=torch.Size(b.size))
                    for b in t.boxes
                ],
            )
            for i, box in enumerate(t.boxes):
                storage[MetadataIndex(name, box.offset, i)] = (name, i)
        return Metadata(
            state_dict_metadata=entries,
            planner_data={name: tuple(name.split(".")) for name in entries},
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=str(self.path)),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:  # fmt: skip
        self._where = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ckpt = self.checkpoint
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointError(
                    f"{ckpt.path} holds tensors only; {req.storage_index.fqn!r} asks for an "
                    "object (leave non-tensor entries out of the state dict)"
                )
            name, i = self._where[req.storage_index]
            t = ckpt.tensor(name)
            box = t.boxes[i]
            start = tuple(o + s for o, s in zip(box.offset, req.storage_offsets))
            stop = tuple(a + n for a, n in zip(start, req.lengths))
            block = from_host(ckpt.read_region(t, start, stop))
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != tuple(block.shape):
                raise CheckpointError(
                    f"{name!r}: DCP asked for a {tuple(target.shape)} block, the read gave "
                    f"{tuple(block.shape)}"
                )
            target.copy_(block)
            planner.commit_tensor(req, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done
