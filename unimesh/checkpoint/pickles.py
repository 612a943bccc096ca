"""DCP's pickles read with no code run: an unpickler that admits only DCP's metadata classes
(each an inert :class:`Record` of its pickled state) and plain values, and a second one for a
chunk's ``data.pkl`` that admits only ``torch._utils._rebuild_tensor_v2`` and the storage
types; any other class is refused with a :class:`~unimesh.CheckpointError` naming it, and the
opcodes are walked first, so that a hostile memo index cannot make the unpickler allocate."""

from __future__ import annotations

import io
import pickle
import pickletools
from collections import OrderedDict
from typing import Any, ClassVar

from ..errors import CheckpointError
from ..messages import short
from .format import DTYPES

__all__ = [
    "MAX_PICKLE",
    "DType",
    "Record",
    "StorageType",
    "load_chunk",
    "load_metadata",
    "torch_dtype_name",
]

_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"

#: torch dtype names (as pickled: ``torch.float32``) -> checkpoint dtype names
TORCH_DTYPES = {name: name for name in DTYPES} | {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}
#: torch's typed storage classes (a chunk's data.pkl) -> checkpoint dtype names
STORAGES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "Float8_e4m3fnStorage": "float8_e4m3fn",
    "Float8_e5m2Storage": "float8_e5m2",
}
MAX_PICKLE = 1 << 20  # a chunk's data.pkl: one rebuild call, a few hundred bytes


def torch_dtype_name(name: str) -> str:
    """The checkpoint dtype name of a torch dtype's name (``float32``, ``bfloat16``, ...)."""
    found = TORCH_DTYPES.get(name)
    if found is None:
        raise CheckpointError(
            f"torch dtype {name!r} has no checkpoint equivalent; readable: {', '.join(DTYPES)}"
        )
    return found


class Record:
    """An inert stand-in for one of DCP's classes: its pickled state, nothing else."""

    kind = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.state: Any = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def get(self, field: str, position: int | None = None) -> Any:
        """A field of the state: by name (a dict state) or by position (a tuple state)."""
        state = getattr(self, "state", None)
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
            state = state[0]  # (dict, slots) as pickle's default for slotted classes
        if isinstance(state, dict):
            return state.get(field)
        if isinstance(state, tuple) and position is not None and position < len(state):
            return state[position]
        return None


_RECORDS: dict[str, type[Record]] = {}


def _record(kind: str) -> type[Record]:
    found = _RECORDS.get(kind)
    if found is None:
        found = _RECORDS[kind] = type(kind, (Record,), {"kind": kind, "__slots__": ()})
    return found


class DType(str):
    """A torch dtype as pickled (``torch.float32``): its name."""


def _size(values: Any = ()) -> tuple[int, ...]:
    out = tuple(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise CheckpointError(f"a torch.Size of non-integers: {short(out)}")
    return out


def _text(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise CheckpointError(f"a path of non-strings: {short(parts)}")
    return "/".join(parts)


def _same(value: Any) -> Any:
    return value


_META_CLASSES = {
    (_DCP_META, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    )
} | {(_DCP_FS, "_StorageInfo"), ("torch.distributed.checkpoint._hf_utils", "_HFStorageInfo")}
_META_CALLS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _same,  # _get_layout('torch.strided')
    (_DCP_META, "_MEM_FORMAT_ENCODING"): _same,  # an Enum called with its value
    ("collections", "OrderedDict"): OrderedDict,
    **{("pathlib", name): _text for name in
       ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
}  # fmt: skip


class _Refusing(pickle.Unpickler):
    """An unpickler that admits only the globals of ``calls`` (each replaced by an inert
    function) and ``classes`` (each an inert record); anything else is refused, naming it."""

    calls: ClassVar[dict[tuple[str, str], Any]] = {}
    classes: ClassVar[set[tuple[str, str]]] = set()
    where = ""

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self.classes:
            return _record(name)
        found = self.calls.get(key)
        if found is not None:
            return found
        if module == "torch" and name in TORCH_DTYPES:
            return DType(name)
        raise CheckpointError(
            f"{self.where} asks for {short(module + '.' + name)}, which is not one of DCP's "
            "metadata classes; unimesh runs no other code from a pickle (if this file is a "
            "real DCP checkpoint, report the class so that it can be admitted)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.where} holds a persistent reference {short(pid)}")


class _MetaUnpickler(_Refusing):
    calls = _META_CALLS
    classes = _META_CLASSES


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Record:
    out = _record("TensorRebuild")()
    out.state = {"storage": storage, "offset": offset, "size": size, "stride": stride}
    return out


class StorageType:
    """A storage type named in a chunk's pickle (``torch.FloatStorage``)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _ChunkUnpickler(_Refusing):
    calls: ClassVar[dict[tuple[str, str], Any]] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild,
        ("torch._utils", "_rebuild_tensor"): _rebuild,
        ("collections", "OrderedDict"): OrderedDict,
        **{("torch", name): StorageType(dtype) for name, dtype in STORAGES.items()},
    }

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage type, key, location, numel)
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], StorageType)
            or not isinstance(pid[2], str)
            or not isinstance(pid[4], int)
        ):
            raise CheckpointError(f"{self.where} holds an unknown storage reference {short(pid)}")
        return pid


def _prescan(data: bytes, where: str) -> None:
    """Walk the pickle's opcodes (pickletools, reading no further than the data) before the C
    unpickler sees them: a memo index past the data's length is refused, since the unpickler
    would first grow its memo table to that size (``LONG_BINPUT 1298491233``: 10 GB zeroed,
    25 s, from a 1 KB file)."""
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and int(str(arg)) >= len(data):
                raise CheckpointError(
                    f"{where} stores into memo slot {arg}, beyond any a {len(data)}-byte "
                    "pickle can fill"
                )
    except CheckpointError:
        raise
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - a malformed pickle
        raise CheckpointError(
            f"{where} is not a readable DCP pickle: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None


def _unpickle(kind: type[_Refusing], data: bytes, where: str) -> Any:
    _prescan(data, where)
    reader = kind(io.BytesIO(data))
    reader.where = where
    try:
        return reader.load()
    except CheckpointError:
        raise
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - any fault of a hostile pickle
        raise CheckpointError(
            f"{where} is not a readable DCP pickle: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None


def load_metadata(data: bytes, where: str) -> Any:
    """The ``.metadata`` pickle as inert records (DCP's classes) and plain values."""
    return _unpickle(_MetaUnpickler, data, where)


def load_chunk(data: bytes, where: str) -> Any:
    """A ``.distcp`` chunk's ``data.pkl`` as a ``TensorRebuild`` record (storage, offset,
    size, stride), its storage a ``('storage', type, key, location, numel)`` reference."""
    return _unpickle(_ChunkUnpickler, data, where)
