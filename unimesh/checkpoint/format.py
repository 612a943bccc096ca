"""The checkpoint format on disk, read and written strictly: its dtypes, boxes and tensors and
the JSON manifest (``docs/checkpoints.md``); its data files' safetensors in
:mod:`.safetensors_file`. Framework-free: numpy and the standard
library; no pickle, nothing evaluated. Every fault of a file is a :class:`CheckpointError`
naming the file and what is wrong."""

from __future__ import annotations

import itertools
import json
import math
import zlib
from typing import Any, Protocol, cast

import numpy as np

from ..errors import CheckpointError
from ..messages import short

__all__ = [
    "DTYPES",
    "FORMAT",
    "MANIFEST",
    "MAX_HEADER",
    "VERSION",
    "Box",
    "Hasher",
    "Tensor",
    "check_fields",
    "check_file_name",
    "check_int",
    "check_ints",
    "check_tiling",
    "checksum",
    "dtype_name",
    "dtype_text",
    "hasher",
    "load_json",
    "manifest_bytes",
    "numpy_dtype",
    "parse_manifest",
]

FORMAT = "unimesh-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
#: a manifest or safetensors header larger than this is refused before it is read
MAX_HEADER = 256 << 20

#: unimesh dtype name -> (safetensors dtype, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a checkpoint dtype name (bfloat16 and float8 from ml_dtypes, which
    JAX installs; without it they are refused, naming the package)."""
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        try:
            import ml_dtypes
        except ImportError:
            raise CheckpointError(
                f"dtype {name} needs the ml_dtypes package to become numpy (pip install "
                "ml_dtypes; JAX installs it)"
            ) from None
        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return found
    return np.dtype(name)


def dtype_text(dtype: Any) -> str:
    """A numpy or framework dtype as its plain name: ``float32`` for numpy's and TF's
    (``.name``), torch's (``torch.float32``) and MLX's (``mlx.core.float32``)."""
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def dtype_name(dtype: Any) -> str:
    """The checkpoint name of a numpy (or framework) dtype; CheckpointError for one the format
    does not hold."""
    name = dtype_text(dtype)
    if name not in DTYPES:
        raise CheckpointError(
            f"dtype {name} cannot be checkpointed; the format holds {', '.join(DTYPES)}: cast "
            "it first"
        )
    return name


class Box:
    """One saved block: where it sits in the global array, and its bytes in a data file."""

    __slots__ = ("checksum", "end", "file", "offset", "size", "start", "strides")

    def __init__(
        self,
        offset: tuple[int, ...],
        size: tuple[int, ...],
        file: str,
        start: int,
        end: int,
        checksum: tuple[str, int] | None = None,
        strides: tuple[int, ...] | None = None,
    ) -> None:
        self.offset = offset
        self.size = size
        self.file = file
        self.start = start
        self.end = end
        # (kind, value) of the box's bytes where the writer gave one: ("xxh3", xxh3_64) as
        # save writes, or ("crc32", zlib.crc32) as earlier saves wrote
        self.checksum = checksum
        # element strides of a box not stored row-major (a DCP chunk of a transposed tensor):
        # such a box is read whole, bytes start..end, and viewed with these strides
        self.strides = strides

    def to_json(self) -> dict[str, Any]:
        out = {
            "offset": list(self.offset),
            "size": list(self.size),
            "file": self.file,
            "start": self.start,
            "end": self.end,
        }
        if self.checksum is not None:
            kind, value = self.checksum
            out[kind] = f"{value:016x}" if kind == "xxh3" else value
        return out


class Tensor:
    """A tensor of the manifest: global shape, dtype, its layout as saved, and its boxes."""

    __slots__ = ("boxes", "dtype", "layout", "name", "shape")

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: str,
        layout: dict[str, Any] | None,
        boxes: list[Box],
    ) -> None:
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.layout = layout
        self.boxes = boxes

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "layout": self.layout,
            "boxes": [b.to_json() for b in self.boxes],
        }


# -- reading, strictly ---------------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CheckpointError(f"duplicate key {short(key)}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise CheckpointError(f"{name} is not a JSON number")


def load_json(data: bytes, where: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity."""
    try:
        text = data.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not valid JSON: {str(exc)[:200]}") from None


def check_fields(
    obj: Any, where: str, required: set[str], optional: frozenset[str] | set[str] = frozenset()
) -> None:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} must be a JSON object, got {short(obj)}")
    missing = sorted(required - set(obj))
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    unknown = sorted(set(obj) - required - optional)
    if unknown:
        raise CheckpointError(f"{where} has unknown fields {unknown}")


def check_ints(value: Any, where: str, lo: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise CheckpointError(f"{where} must be a list of at most 64 ints, got {short(value)}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < 2**62:
            raise CheckpointError(f"{where} must hold ints in [{lo}, 2**62), got {short(v)}")
    return tuple(value)


def check_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise CheckpointError(f"{where} must be an int in [0, 2**62), got {short(value)}")
    return value


def check_file_name(name: Any, where: str) -> str:
    """A data file's name: a plain name inside the checkpoint directory."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or len(name) > 255
    ):
        raise CheckpointError(
            f"{where} names file {short(name)}: data files must be plain names inside the "
            "checkpoint directory (no separators, no '..')"
        )
    return name


def manifest_bytes(tensors: dict[str, Tensor]) -> bytes:
    """The manifest of ``tensors``, as the writer commits it, read back by
    :func:`parse_manifest` first (what is written can be read)."""
    doc = {"format": FORMAT, "version": VERSION,
           "tensors": {name: t.to_json() for name, t in tensors.items()}}  # fmt: skip
    text = json.dumps(doc, indent=1).encode()
    parse_manifest(text, "the manifest being written")
    return text


def parse_manifest(data: bytes, where: str) -> dict[str, Tensor]:
    """The manifest's tensors, checked: fields and types, every box inside the tensor and of
    numel x itemsize bytes, the boxes tiling the tensor exactly once."""
    if len(data) > MAX_HEADER:
        raise CheckpointError(f"{where} is {len(data)} bytes, over the {MAX_HEADER} cap")
    doc = load_json(data, where)
    check_fields(doc, where, {"format", "version", "tensors"})
    if doc["format"] != FORMAT:
        raise CheckpointError(f"{where}: format is {short(doc['format'])}, not {FORMAT!r}")
    if doc["version"] != VERSION:
        raise CheckpointError(
            f"{where}: format version {short(doc['version'])}; this unimesh reads version {VERSION}"
        )
    if not isinstance(doc["tensors"], dict):
        raise CheckpointError(f"{where}: tensors must be an object of name -> tensor")
    tensors: dict[str, Tensor] = {}
    for name, t in doc["tensors"].items():
        at = f"{where}: tensor {short(name)}"
        check_fields(t, at, {"shape", "dtype", "boxes"}, {"layout"})
        shape = check_ints(t["shape"], f"{at} shape")
        dtype = t["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{at}: unknown dtype {short(dtype)}; known: {list(DTYPES)}")
        layout = t.get("layout")
        if layout is not None:
            check_fields(layout, f"{at} layout", {"mesh", "spec"})
        if not isinstance(t["boxes"], list):
            raise CheckpointError(f"{at}: boxes must be a list")
        boxes = []
        itemsize = DTYPES[dtype][1]
        for i, b in enumerate(t["boxes"]):
            bw = f"{at} box {i}"
            check_fields(b, bw, {"offset", "size", "file", "start", "end"}, {"crc32", "xxh3"})
            offset, size = (
                check_ints(b["offset"], f"{bw} offset"),
                check_ints(b["size"], f"{bw} size"),
            )
            if len(offset) != len(shape) or len(size) != len(shape):
                raise CheckpointError(f"{bw}: offset and size need {len(shape)} entries")
            for d, (o, n, g) in enumerate(zip(offset, size, shape)):
                if o + n > g:
                    raise CheckpointError(
                        f"{bw} reaches past dim {d} of the tensor ({o} + {n} > {g})"
                    )
            start, end = check_int(b["start"], f"{bw} start"), check_int(b["end"], f"{bw} end")
            if end - start != math.prod(size) * itemsize:
                raise CheckpointError(
                    f"{bw}: byte range {start}..{end} is {end - start} bytes, but {size} of "
                    f"{dtype} is {math.prod(size) * itemsize}"
                )
            file = check_file_name(b["file"], bw)
            boxes.append(Box(offset, size, file, start, end, _checksum(b, bw)))
        check_tiling(at, shape, boxes)
        tensors[name] = Tensor(name, shape, dtype, layout, boxes)
    _check_bytes_once(where, tensors)
    return tensors


_HEX = "0123456789abcdef"


def _checksum(box: dict[str, Any], where: str) -> tuple[str, int] | None:
    """A box's checksum as (kind, value): ``xxh3`` (16 lowercase hex digits) or ``crc32`` (an
    int, as earlier saves wrote), at most one of them; None where the box has none."""
    if "crc32" in box and "xxh3" in box:
        raise CheckpointError(f"{where}: give one checksum, crc32 or xxh3, not both")
    if "xxh3" in box:
        text = box["xxh3"]
        if not isinstance(text, str) or len(text) != 16 or not set(text) <= set(_HEX):
            raise CheckpointError(
                f"{where}: xxh3 must be 16 lowercase hex digits (xxh3_64 of the box's bytes), "
                f"got {short(text)}"
            )
        return "xxh3", int(text, 16)
    crc = box.get("crc32")
    if crc is None:
        return None
    if isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 2**32:
        raise CheckpointError(f"{where}: crc32 must be an int in [0, 2**32), got {short(crc)}")
    return "crc32", crc


class Hasher(Protocol):
    """What :func:`hasher` gives: bytes in, the checksum's value out."""

    def update(self, data: Any, /) -> None: ...

    def intdigest(self) -> int: ...


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any, /) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def _xxhash() -> Any:
    """The ``xxhash`` module (a dependency of unimesh), or a CheckpointError saying so."""
    try:
        import xxhash
    except ImportError as exc:
        raise CheckpointError(
            f"checkpoint checksums need the xxhash package ({exc}): pip install xxhash (a "
            "dependency of unimesh, missing from an install made with --no-deps)"
        ) from None
    return xxhash


def hasher(kind: str) -> Hasher:
    """A running checksum of ``kind`` (``"xxh3"`` or ``"crc32"``, as :class:`Box` holds)."""
    if kind == "crc32":
        return _Crc32()
    return cast("Hasher", _xxhash().xxh3_64())


def checksum(data: Any) -> tuple[str, int]:
    """The checksum :func:`~unimesh.checkpoint.save` writes for a block's bytes: xxh3_64
    (xxhash, which releases the GIL for inputs over 64 KiB), about 18 GB/s a core against
    zlib crc32's 2 here."""
    return "xxh3", int(_xxhash().xxh3_64_intdigest(data))


def _check_bytes_once(where: str, tensors: dict[str, Tensor]) -> None:
    """No two boxes share bytes of a file: each box's bytes are its own (a save writes every
    block once), so a manifest pointing two boxes at one byte range is refused, not read as
    two copies of one block."""
    runs = sorted(
        (b.file, b.start, b.end, name, list(b.offset))
        for name, t in tensors.items()
        for b in t.boxes
        if b.end > b.start
    )
    for (f0, _, e0, n0, o0), (f1, s1, e1, n1, o1) in itertools.pairwise(runs):
        if f0 == f1 and s1 < e0:
            raise CheckpointError(
                f"{where}: the box of tensor {short(n0)} at {o0} and the box of tensor "
                f"{short(n1)} at {o1} share bytes {s1}..{min(e0, e1)} of {f0}: each box must "
                "have bytes of its own"
            )


def check_tiling(where: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """The boxes cover every element once: their volumes add up to the tensor's and no two
    overlap (a sweep over the first dim's intervals keeps this near-linear)."""
    total = math.prod(shape)
    volume = sum(math.prod(b.size) for b in boxes if math.prod(b.size))
    if volume != total:
        raise CheckpointError(
            f"{where}: the boxes hold {volume} elements, the tensor {total}: they must tile "
            "it exactly once (no holes, no overlaps)"
        )
    live = [b for b in boxes if math.prod(b.size)]
    if len(live) > 1:
        live.sort(key=lambda b: b.offset)
        for i, a in enumerate(live):
            for b in live[i + 1 :]:
                if shape and b.offset[0] >= a.offset[0] + a.size[0]:
                    break
                if all(
                    max(ao, bo) < min(ao + an, bo + bn)
                    for ao, an, bo, bn in zip(a.offset, a.size, b.offset, b.size)
                ):
                    raise CheckpointError(
                        f"{where}: boxes at {list(a.offset)} and {list(b.offset)} overlap"
                    )
