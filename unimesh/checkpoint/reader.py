"""Reading a checkpoint without any framework: :class:`Checkpoint` opens a place by asking the
table of format openers (:data:`~.openers.OPENERS`: a unimesh manifest, one safetensors file,
a Hugging Face index, torch DCP, Orbax, ...), each of which turns the format's metadata into
the same :class:`~.format.Tensor` s and :class:`~.format.Box` es; every read after that is the
same: the byte runs of the boxes a region touches (:mod:`.runs`), read through the place's
:class:`~.storage.Storage` straight into the destination's memory."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError, UnimeshError
from ..layout import Layout
from ..mesh import Mesh
from ..messages import close_match, short
from ..spec import PartitionSpec
from . import huggingface as hf
from .format import MAX_HEADER, Box, Tensor, hasher, numpy_dtype
from .openers import OPENERS, Opened, Opener, not_found
from .raw import aligned_empty
from .runs import BoxPart, overlaps, part
from .safetensors_file import read_header
from .storage import Storage, open_storage

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["OPENERS", "Checkpoint", "Opened", "Opener", "open_checkpoint", "to_safetensors"]


class Checkpoint:
    """A checkpoint opened for reading, without any framework: its tensors' names, global
    shapes, dtypes and saved layouts; :meth:`read` gives any slice as numpy, reading only its
    bytes. ``bytes_read`` counts what was read from data files. ``kind``: the format found
    (``unimesh``, ``safetensors``, ``dcp``, ``orbax``). With ``verify=True`` every box a read
    touches is first read whole and checked against the checksum the save wrote (``xxh3``),
    once."""

    def __init__(self, path: Any, *, verify: bool = False) -> None:
        self.verify = bool(verify)
        self.bytes_read = 0
        self._checked: set[tuple[str, int]] = set()
        self._headers: dict[str, dict[str, Any]] = {}
        self._extra: dict[str, dict[str, Any]] = {}
        #: the place's files: a local directory or an fsspec URL
        self.storage: Storage = open_storage(path)
        #: the one safetensors file the path named (its directory is the place), else None
        self.file: str | None = None
        where = self.storage.where
        if where.suffix == ".safetensors" and self.storage.is_object():
            self.storage, self.file = open_storage(where.parent), where.name
        #: the checkpoint's place: a Path, or a Url in object storage
        self.path: Any = self.storage.where
        try:
            for opener in OPENERS:
                if (not opener.local or self.storage.local is not None) and opener.found(self):
                    self.kind = opener.kind
                    opened = opener.open(self)
                    break
            else:
                raise CheckpointError(not_found(self))
        except BaseException:
            self.storage.close()
            raise
        self.tensors = opened.tensors
        #: names of entries that are not tensors (DCP's pickled objects), which are not read
        self.objects = list(opened.objects)
        self._read_other = opened.region

    def reads_runs(self, t: Tensor) -> bool:
        """Whether each part of tensor ``t`` is read as its own byte runs (no other library
        reads the chunks, and no box is strided): what :meth:`read_regions` orders."""
        return self._read_other is None and not any(box.strides for box in t.boxes)

    @property
    def reads_boxes(self) -> bool:
        """Whether unimesh reads the saved boxes' byte runs itself (its own format, DCP's,
        safetensors); False where another library reads the chunks (TensorStore, Orbax's)."""
        return self._read_other is None

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self.tensors)} tensors)"

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            if name in self.objects:
                raise CheckpointError(
                    f"{self.path}: {name!r} is a pickled object in this DCP checkpoint, not a "
                    "tensor; unimesh does not unpickle objects (load it with torch, or leave it "
                    "out of the target)"
                ) from None
            hint = close_match(name, list(self.tensors))
            raise CheckpointError(
                f"{self.path} has no tensor {name!r}{hint}; it has {short(list(self.tensors))}"
            ) from None

    def layout(self, name: str) -> Layout | None:
        """The layout the tensor was saved with (None for a host array)."""
        saved = self.tensor(name).layout
        if saved is None:
            return None
        try:
            mesh = Mesh.from_dict(saved["mesh"])
            return Layout(
                mesh,
                PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in saved["spec"])),
            )
        except (UnimeshError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{self.path}: the saved layout of {name!r} is invalid: {exc}"
            ) from None

    def close(self) -> None:
        """Close the data files this checkpoint keeps open (reading again reopens them)."""
        self.storage.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def header(self, name: str) -> dict[str, Any]:
        """The entries of data file ``name``'s safetensors header, ``{entry: (dtype, shape,
        start, end)}`` (absolute byte offsets), read once (8 bytes, then the JSON) and checked
        against the file's length."""
        found = self._headers.get(name)
        if found is not None:
            return found
        store = self.storage
        size = store.size(name)
        head = store.read(name, 0, min(size, 8))
        if len(head) == 8:
            length = int.from_bytes(head, "little")
            if length <= MAX_HEADER and 8 + length <= size:
                head += store.read(name, 8, 8 + length)
        extra: dict[str, Any] = {}
        found = read_header(head, size, str(self.path / name), extra)[1]
        self._headers[name], self._extra[name] = found, extra
        return found

    def metadata(self, name: str) -> dict[str, str]:
        """The ``__metadata__`` of data file ``name``'s safetensors header."""
        self.header(name)
        found = self._extra[name].get("__metadata__")
        if found is None:
            return {}
        if not isinstance(found, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in found.items()
        ):
            raise CheckpointError(f"{self.path / name}: __metadata__ must map strings to strings")
        return found

    def _data_file(self, name: str) -> None:
        """Check data file ``name``'s safetensors header on first use (DCP's files were
        checked chunk by chunk when opened)."""
        if self.kind not in ("dcp", "orbax"):
            self.header(name)

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The tensor, or its slice ``index`` (a tuple of slices with step 1, or None for the
        whole), as numpy; only the bytes of that slice are read."""
        t = self.tensor(name)
        start, stop = _bounds(t.shape, index, name)
        return self.read_region(t, start, stop)

    def read_region(
        self,
        t: Tensor,
        start: tuple[int, ...],
        stop: tuple[int, ...],
        out: np.ndarray | None = None,
        parts: list[BoxPart] | None = None,
    ) -> np.ndarray:
        """The region ``start:stop`` (global index) of tensor ``t`` as a new C-order array,
        reading only the byte runs of the boxes it touches (64-byte aligned: a CPU runtime
        may adopt it); or into ``out`` (C-order, the region's shape, an array of the tensor's
        item size whose bytes are the tensor's: a framework's tensor viewed by numpy).
        ``parts``: the saved boxes' parts in the region as a load planned them
        (:func:`.runs.planned`, the region a target block); by default the region is
        intersected with the boxes. A checkpoint read by another library (TensorStore: see
        :attr:`reads_boxes`) reads the chunks it touches whole, whatever the parts."""
        shape = tuple(b - a for a, b in zip(start, stop))
        fresh = out is None
        if out is None:
            dtype = numpy_dtype(t.dtype)
            out = aligned_empty(shape, dtype)
        else:
            dtype = out.dtype
            if (
                out.shape != shape
                or dtype.itemsize != t.itemsize
                or not out.flags.c_contiguous
                or not out.flags.writeable
            ):
                raise CheckpointError(
                    f"{self.path}: {t.name!r} cannot be read into a {dtype} array of shape "
                    f"{out.shape}: its region {shape} needs a writable C-order array of "
                    f"{t.itemsize}-byte items"
                )
        if out.size == 0:
            return out
        if self._read_other is not None:  # TensorStore reads the chunks it touches whole
            for box in t.boxes:
                if all(max(a, o) < min(b, o + n)
                       for a, b, o, n in zip(start, stop, box.offset, box.size)):  # fmt: skip
                    self.bytes_read += math.prod(box.size) * t.itemsize
            whole = self._read_other(t, start, stop)
            if whole.shape != out.shape or whole.dtype != numpy_dtype(t.dtype):
                raise CheckpointError(
                    f"{self.path}: {t.name!r} read as {whole.dtype} {whole.shape}, its metadata "
                    f"says {t.dtype} {out.shape}"
                )
            if fresh:
                return whole
            out[...] = whole.view(dtype)  # the same bytes, seen as the target's items
            return out
        for box, first, after in overlaps(t.boxes, start, stop) if parts is None else parts:
            self._read_part(t, box, first, after, out, start)
        return out

    def read_regions(
        self,
        t: Tensor,
        regions: list[tuple[tuple[int, ...], tuple[int, ...], list[BoxPart] | None]],
    ) -> list[np.ndarray]:
        """Several regions of tensor ``t``, each ``(start, stop, parts)`` as
        :meth:`read_region` takes them, as new C-order arrays: their parts read box by box in
        file order, so a box that several regions touch (one process's column blocks of a
        row-major box) is read once from the disk while its pages are fresh, and the disk
        sees one pass along the file instead of one per region."""
        if not self.reads_runs(t):
            return [self.read_region(t, a, b, parts=p) for a, b, p in regions]
        dtype = numpy_dtype(t.dtype)
        outs = [aligned_empty(tuple(y - x for x, y in zip(a, b)), dtype) for a, b, _ in regions]
        jobs = []
        for i, (start, stop, parts) in enumerate(regions):
            if outs[i].size:
                found = overlaps(t.boxes, start, stop) if parts is None else parts
                jobs += [(box.file, box.start, first, i, box, after) for box, first, after in found]
        jobs.sort(key=lambda job: job[:3])
        for _, _, first, i, box, after in jobs:
            self._read_part(t, box, first, after, outs[i], regions[i][0])
        return outs

    def _read_part(
        self,
        t: Tensor,
        box: Box,
        first: tuple[int, ...],
        after: tuple[int, ...],
        out: np.ndarray,
        start: tuple[int, ...],
    ) -> None:
        """Box ``box``'s part ``first:after`` (global index) of tensor ``t`` into ``out``, the
        region that starts at ``start``."""
        dtype = out.dtype
        piece = part(box, first, after, t.itemsize)
        box = piece.box
        if self.verify:
            self.check_box(t.name, box)
        self._data_file(box.file)
        where = tuple(slice(a - s, b - s) for a, b, s in zip(piece.start, piece.stop, start))
        self.bytes_read += piece.nbytes
        if not box.strides:  # straight into ``out``
            self.storage.read_into(box.file, piece.runs, out, where, t.name)
            return
        # a strided box (a DCP chunk of a transposed tensor): read whole, then viewed
        data = self.storage.read(box.file, box.start, box.end)
        if len(data) != box.end - box.start:
            raise CheckpointError(
                f"{self.path}: data file {box.file!r} is truncated (tensor {t.name!r} "
                f"needs bytes {box.start}..{box.end})"
            )
        view = np.lib.stride_tricks.as_strided(
            np.frombuffer(data, dtype=dtype),
            box.size,
            tuple(s * dtype.itemsize for s in box.strides),
            writeable=False,
        )[tuple(slice(a - o, b - o) for a, b, o in zip(piece.start, piece.stop, box.offset))]
        out[where] = view

    def check_box(self, name: str, box: Box) -> None:
        """Read ``box`` of tensor ``name`` whole and compare its checksum (xxh3, or an earlier
        save's crc32) with the manifest's (once per box; nothing to check where the writer
        gave no checksum)."""
        key = (box.file, box.start)
        if box.checksum is None or key in self._checked:
            return
        kind, expected = box.checksum
        running, at = hasher(kind), box.start
        self._data_file(box.file)
        while at < box.end:
            chunk = self.storage.read(box.file, at, min(at + (16 << 20), box.end))
            if not chunk:
                raise CheckpointError(
                    f"{self.path}: data file {box.file!r} is truncated (tensor {name!r} "
                    f"needs bytes {at}..{box.end})"
                )
            running.update(chunk)
            at += len(chunk)
        self.bytes_read += box.end - box.start
        found = running.intdigest()
        if found != expected:
            digits = 16 if kind == "xxh3" else 8
            raise CheckpointError(
                f"{self.path}: tensor {name!r}, the box at {list(box.offset)} in {box.file} "
                f"(bytes {box.start}..{box.end}) fails its checksum: {kind} "
                f"{found:#0{digits + 2}x}, the manifest says {expected:#0{digits + 2}x}; the "
                "file changed after the save"
            )
        self._checked.add(key)


def _bounds(
    shape: tuple[int, ...], index: Any, name: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, stop) of the slice ``index`` of a tensor of ``shape``."""
    if index is None:
        return (0,) * len(shape), shape
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape):
        raise CheckpointError(f"index {short(index)} has more entries than {name!r} has dims")
    index = index + (slice(None),) * (len(shape) - len(index))
    start, stop = [], []
    for d, (s, n) in enumerate(zip(index, shape)):
        if not isinstance(s, slice):
            raise CheckpointError(f"index entry {d} of {name!r} must be a slice, got {short(s)}")
        a, b, step = s.indices(n)
        if step != 1:
            raise CheckpointError(f"index entry {d} of {name!r} must have step 1")
        start.append(a)
        stop.append(max(a, b))
    return tuple(start), tuple(stop)


def open_checkpoint(path: Any, *, verify: bool = False) -> Checkpoint:
    """A checkpoint opened for inspection and reading, with no framework imported: a unimesh
    checkpoint, Hugging Face safetensors, torch DCP or Orbax. ``verify=True`` checks each
    box's checksum before it is first read (which reads the whole box)."""
    return Checkpoint(path, verify=verify)


def to_safetensors(
    src: Any,
    dst: Any,
    *,
    max_shard_bytes: int = 5 << 30,
    window: int = 256 << 20,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Write the checkpoint at ``src`` (any format :func:`open_checkpoint` reads) into the
    place ``dst`` (a directory or an fsspec URL) as Hugging Face safetensors:
    ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` files of at most
    ``max_shard_bytes`` each with ``model.safetensors.index.json``
    (:func:`.huggingface.write_safetensors`). Returns the files written."""
    hf.check_sizes(max_shard_bytes, window)  # before the source is opened
    with open_checkpoint(src) as ckpt:
        return hf.write_safetensors(
            ckpt, dst, max_shard_bytes=max_shard_bytes, window=window, progress=progress
        )
