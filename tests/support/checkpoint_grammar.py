"""Grammars over what a checkpoint reader is handed (issue 37, item 1): unimesh manifests,
safetensors headers and torch DCP ``.metadata`` pickles (written opcode by opcode, so that
torch is not needed and any global can be named), each valid by construction and then
damaged, for tests/support/grammar.py's driver (benchmarks/fuzz.py runs 100,000 of each).

Each family's parser must answer with its result or a CheckpointError, evaluate nothing (the
audit hook of tests/support/fuzzing.py watches) and stay within the time and memory bounds."""

from __future__ import annotations

import atexit
import json
import math
import shutil
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from unimesh.checkpoint.dcp import read_dcp
from unimesh.checkpoint.format import DTYPES, FORMAT, parse_manifest
from unimesh.checkpoint.safetensors_file import read_header
from unimesh.checkpoint.storage import LocalDir

HOSTILE_INTS = [-1, 0, 1, 2**31, 2**62, 2**63, 2**64 + 1, 10**30, -(2**63)]
HOSTILE_NAMES = ["", "..", "../x", "/etc/passwd", "a/b", "a\\b", "a\x00b", "x" * 300, "é"]


def _int(draw: Any, lo: int, hi: int) -> int:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(HOSTILE_INTS))
    return draw(st.integers(lo, hi))


def _rare(draw: Any, n: int) -> bool:
    """True about once in ``n`` draws (a middle value: hypothesis favours 0 and the bounds)."""
    return bool(draw(st.integers(0, n - 1)) == n // 2)


def _value(draw: Any) -> Any:
    """A JSON value of the wrong kind."""
    return draw(st.sampled_from([None, True, 1.5, "x", [], {}, [1, "a"], {"a": 1}, -1, 2**70]))


#: xxh3 values a hand-written manifest might carry, each one refused
XXH3_NEAR_MISSES = [
    "ABCDEF0123456789",
    "0x0123456789abcd",
    "0" * 15,
    "0" * 17,
    "g" * 16,
    "",
    " " * 16,
]


@st.composite
def _tensor(draw: Any) -> dict[str, Any]:
    ndim = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 6)) for _ in range(ndim)]
    dtype = draw(st.sampled_from([*DTYPES, *DTYPES, "F32", "complex64", "", "float32 "]))
    itemsize = DTYPES.get(dtype, ("", 4))[1]
    boxes = []
    # a valid tiling: cut dim 0 in two (where there is one), byte ranges back to back
    cuts = [(0, shape[0] // 2), (shape[0] // 2, shape[0])] if ndim and shape[0] > 1 else None
    at = draw(st.integers(0, 64)) * 8
    for lo, hi in cuts or [(0, shape[0] if ndim else 0)]:
        size = ([hi - lo] + shape[1:]) if ndim else []
        n = math.prod(size) * itemsize
        box: dict[str, Any] = {
            "offset": ([lo] + [0] * (ndim - 1)) if ndim else [],
            "size": size,
            "file": "data-00.safetensors",
            "start": at,
            "end": at + n,
        }
        kind = draw(st.sampled_from(["", "", "crc32", "xxh3"]))
        if kind == "crc32":
            box["crc32"] = _int(draw, 0, 2**32 - 1)
        elif kind == "xxh3":
            box["xxh3"] = f"{draw(st.integers(0, 2**64 - 1)):016x}"
        at += n
        boxes.append(box)
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 1, 2]))):  # damage a field of a box
        box = draw(st.sampled_from(boxes))
        fields = ["offset", "size", "file", "start", "end", "crc32", "xxh3", "new"]
        field = draw(st.sampled_from(fields))
        choice = draw(st.integers(0, 3))
        if choice == 0:
            box.pop(field, None)
        elif choice == 1 and field in ("file",):
            box[field] = draw(st.sampled_from(HOSTILE_NAMES))
        elif choice == 2 and field in ("offset", "size"):
            box[field] = [_int(draw, 0, 8) for _ in range(draw(st.integers(0, 4)))]
        elif choice == 1 and field == "xxh3":  # near misses of 16 lowercase hex digits
            box[field] = draw(st.sampled_from(XXH3_NEAR_MISSES))
        else:
            box[field] = _int(draw, 0, 10**6) if draw(st.booleans()) else _value(draw)
    tensor: dict[str, Any] = {"shape": shape, "dtype": dtype, "layout": None, "boxes": boxes}
    if draw(st.booleans()):
        tensor["layout"] = {"mesh": {"shape": [2], "axis_names": ["x"]}, "spec": ["x"]}
    if draw(st.integers(0, 9)) == 0:
        tensor[draw(st.sampled_from(["shape", "dtype", "layout", "boxes", "extra"]))] = _value(draw)
    return tensor


@st.composite
def manifest_texts(draw: Any) -> str:
    """A manifest: mostly well formed, with damaged fields, names and text."""
    doc: dict[str, Any] = {
        "format": FORMAT if draw(st.integers(0, 9)) else draw(st.sampled_from(["", "x", 1])),
        "version": 1 if draw(st.integers(0, 9)) else _value(draw),
        "tensors": {
            draw(st.sampled_from(["w", "a.b", "", "é", "x" * 200])) + str(i): draw(_tensor())
            for i in range(draw(st.integers(0, 3)))
        },
    }
    if draw(st.integers(0, 9)) == 0:
        doc[draw(st.sampled_from(["mesh", "unknown", "tensors", "format"]))] = _value(draw)
    text = json.dumps(doc)
    how = draw(st.integers(0, 15))
    if how == 0 and len(text) > 2:  # cut short
        text = text[: draw(st.integers(0, len(text) - 1))]
    elif how == 1:  # a key twice
        text = text.replace('"version": ', '"version": 1, "version": ', 1)
    elif how == 2:  # deep nesting
        depth = draw(st.integers(1, 50_000))
        text = text[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    elif how == 3:
        text = text.replace("1", "NaN", 1) if draw(st.booleans()) else "\ud800" + text
    elif how == 4:
        text = draw(st.sampled_from(["[]", "null", "1", '"x"', "", " " * 10]))
    return text


def _parse_manifest(text: str) -> Any:
    return parse_manifest(text.encode("utf-8", "surrogatepass"), "fuzz manifest")


@st.composite
def safetensors_blobs(draw: Any) -> bytes:
    """A safetensors file: an 8-byte header length, the JSON header, the data."""
    header: dict[str, Any] = {}
    at = 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(["F32", "BF16", "I64", "BOOL", "F8_E4M3", "X", "f32", ""]))
        shape = [draw(st.integers(0, 5)) for _ in range(draw(st.integers(0, 3)))]
        n = math.prod(shape) * {"F32": 4, "BF16": 2, "I64": 8}.get(dtype, 1)
        entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        if draw(st.integers(0, 4)) == 0:
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets", "x"]))] = _value(draw)
        if draw(st.integers(0, 4)) == 0:
            entry["data_offsets"] = [_int(draw, 0, 100), _int(draw, 0, 100)]
        header[f"t{i}"] = entry
        at += n
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"} if draw(st.booleans()) else _value(draw)
    text = json.dumps(header).encode()
    if draw(st.integers(0, 5)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    length = len(text) if draw(st.integers(0, 4)) else _int(draw, 0, 2**40)
    if not 0 <= length < 2**64:
        length = 2**64 - 1
    data = b"\0" * (at + draw(st.sampled_from([0, 0, 0, 1, -1])) if at else 0)
    return struct.pack("<Q", length) + text + data


def _parse_safetensors(blob: bytes) -> Any:
    return read_header(blob, len(blob), "fuzz header")


# -- DCP .metadata: pickles written opcode by opcode -----------------------------------------
_META = "torch.distributed.checkpoint.metadata"
_BAD_GLOBALS = [
    ("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"),
    ("subprocess", "Popen"), ("torch", "load"), ("pickle", "loads"), ("copyreg", "_reconstructor"),
    ("builtins", "getattr"), (_META, "Nope"), ("torch", "Size "), ("", ""), ("torch", "float32"),
]  # fmt: skip


class _Pickle:
    """Protocol-2 opcodes for a tree of values, globals, objects and calls."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")

    def value(self, v: Any) -> None:
        if isinstance(v, tuple) and v and v[0] == "obj":  # ("obj", module, name, state)
            self.glob(v[1], v[2])
            self.out += b")\x81"  # EMPTY_TUPLE NEWOBJ
            if v[3] is not None:
                self.value(v[3])
                self.out += b"b"  # BUILD
        elif isinstance(v, tuple) and v and v[0] == "call":  # ("call", module, name, args)
            self.glob(v[1], v[2])
            self.value(tuple(v[3]))
            self.out += b"R"
        elif isinstance(v, tuple) and v and v[0] == "dict":  # ("dict", [(key, value), ...])
            self.out += b"}("
            for k, item in v[1]:
                self.value(k)
                self.value(item)
            self.out += b"u"
        elif isinstance(v, tuple) and v and v[0] == "nest":
            self.out += b"](" * v[1] + b"e" * v[1]
        elif isinstance(v, tuple) and v and v[0] == "global":
            self.glob(v[1], v[2])
        elif isinstance(v, bool):
            self.out += b"\x88" if v else b"\x89"
        elif v is None:
            self.out += b"N"
        elif isinstance(v, int):
            raw = v.to_bytes(max(1, (v.bit_length() + 8) // 8), "little", signed=True)
            self.out += b"\x8a" + bytes([len(raw)]) + raw if len(raw) < 256 else b"N"
        elif isinstance(v, str):
            raw = v.encode("utf-8", "surrogatepass")
            self.out += b"X" + struct.pack("<I", len(raw)) + raw
        elif isinstance(v, (list, tuple)):
            self.out += b"]" if isinstance(v, list) else b"("
            if isinstance(v, list):
                self.out += b"("
            for item in v:
                self.value(item)
            self.out += b"e" if isinstance(v, list) else b"t"
        elif isinstance(v, dict):
            self.out += b"}("
            for k, item in v.items():
                self.value(k)
                self.value(item)
            self.out += b"u"

    def glob(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode("utf-8", "replace") + b"\n"
        self.out += name.encode("utf-8", "replace") + b"\n"

    def done(self) -> bytes:
        return bytes(self.out + b".")


def _size(values: list[Any]) -> Any:
    return ("call", "torch", "Size", [tuple(values)])


@st.composite
def _dcp_tree(draw: Any) -> Any:
    """Metadata for tensor 'a' of shape (2, 3) float32 stored at its real place in the
    synthetic __0_0.distcp file (see _dcp_dir), with fields replaced by hostile values."""

    def maybe(value: Any) -> Any:
        if _rare(draw, 41):
            bad = draw(st.sampled_from(_BAD_GLOBALS))
            kind = draw(st.sampled_from(["call", "global", "obj"]))
            return (kind, bad[0], bad[1], [draw(st.sampled_from(["id", 1, None]))] if kind ==
                    "call" else None)  # fmt: skip
        if _rare(draw, 41):
            return _value(draw)
        if _rare(draw, 81):
            return ("nest", draw(st.integers(1, 20_000)))  # lists in lists, that deep
        return value

    props = maybe(("obj", _META, "TensorProperties", (
        maybe(("global", "torch", draw(st.sampled_from(["float32"] * 6 + ["bfloat16", "int8",
                                                                "complex64", "qint8"])))),
        maybe(("call", "torch.serialization", "_get_layout", ["torch.strided"])), False,
        maybe(("call", _META, "_MEM_FORMAT_ENCODING", [0])), False)))  # fmt: skip
    chunk_offsets = [0, 0] if not _rare(draw, 13) else [_int(draw, 0, 4), _int(draw, 0, 4)]
    chunk_sizes = [2, 3] if not _rare(draw, 13) else [_int(draw, 0, 4), _int(draw, 0, 4)]
    chunk = maybe(("obj", _META, "ChunkStorageMetadata", {
        "offsets": maybe(_size(chunk_offsets)), "sizes": maybe(_size(chunk_sizes))}))  # fmt: skip
    tensor = maybe(("obj", _META, "TensorStorageMetadata", {
        "properties": props, "size": maybe(_size([2, 3] if not _rare(draw, 13) else
                                                [_int(draw, 0, 9), _int(draw, 0, 9)])),
        "chunks": maybe([chunk])}))  # fmt: skip
    start, length = _DCP_PLACE
    info = maybe(("obj", "torch.distributed.checkpoint.filesystem", "_StorageInfo", {
        "relative_path": maybe(draw(st.sampled_from(["__0_0.distcp"] * 30 + HOSTILE_NAMES))),
        "offset": maybe(start if not _rare(draw, 13) else _int(draw, 0, 2000)),
        "length": maybe(length if not _rare(draw, 13) else _int(draw, 0, 2000))}))  # fmt: skip
    index = ("obj", _META, "MetadataIndex",
             {"fqn": maybe("a"), "offset": maybe(_size(chunk_offsets)), "index": 0})  # fmt: skip
    entries = [(maybe("a"), tensor)]
    if draw(st.booleans()):
        entries.append(("step", ("obj", _META, "BytesStorageMetadata", None)))
    return ("obj", _META, "Metadata", {
        "state_dict_metadata": maybe(("dict", entries)), "planner_data": None,
        "storage_data": maybe(("dict", [(index, info)])),
        "storage_meta": ("obj", _META, "StorageMeta", {"checkpoint_id": ("call", "pathlib",
                         "PosixPath", ["ckpt"])}), "version": "1.0.0"})  # fmt: skip


@st.composite
def dcp_metadata(draw: Any) -> bytes:
    p = _Pickle()
    p.value(draw(_dcp_tree()))
    blob = p.done()
    how = draw(st.integers(0, 19))
    if how == 0 and len(blob) > 3:  # cut short
        blob = blob[: draw(st.integers(2, len(blob) - 1))]
    elif how == 1:  # a byte changed
        i = draw(st.integers(0, len(blob) - 1))
        blob = blob[:i] + bytes([draw(st.integers(0, 255))]) + blob[i + 1 :]
    return blob


def _chunk_archive() -> bytes:
    """What torch.save writes for a (2, 3) float32 tensor, made with the standard library:
    a zip of data.pkl (``_rebuild_tensor_v2`` of a persistent storage id), byteorder and the
    storage record."""
    import io

    p = _Pickle()
    p.glob("torch._utils", "_rebuild_tensor_v2")
    p.out += b"(("  # the call's arguments; the storage id's tuple
    p.value("storage")
    p.glob("torch", "FloatStorage")
    for v in ("0", "cpu", 6):
        p.value(v)
    p.out += b"tQ"  # TUPLE, BINPERSID
    for v in (0, (2, 3), (3, 1), False, ("call", "collections", "OrderedDict", [])):
        p.value(v)
    p.out += b"tR"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", p.done())
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/data/0", struct.pack("<6f", *range(6)))
    return buf.getvalue()


_DCP_PLACE = (16, len(_chunk_archive()))
_DCP_DIR: list[Path] = []


def _dcp_dir() -> Path:
    """A directory with a synthetic __0_0.distcp (16 bytes, then one chunk's archive)."""
    if not _DCP_DIR:
        root = Path(tempfile.mkdtemp(prefix="unimesh-fuzz-dcp-"))
        atexit.register(shutil.rmtree, root, True)  # the process's own, gone when it ends
        (root / "__0_0.distcp").write_bytes(b"\0" * 16 + _chunk_archive())
        _DCP_DIR.append(root)
    return _DCP_DIR[0]


def _parse_dcp(blob: bytes) -> Any:
    root = _dcp_dir()
    (root / ".metadata").write_bytes(blob)
    return read_dcp(LocalDir(root))


FAMILIES = {
    "checkpoint manifest": (manifest_texts, _parse_manifest),
    "safetensors header": (safetensors_blobs, _parse_safetensors),
    "dcp metadata": (dcp_metadata, _parse_dcp),
}


# -- mutations of real checkpoints ------------------------------------------------------------
def _seed_checkpoints(root: Path) -> dict[str, tuple[Path, str]]:
    """Real checkpoints to mutate: a unimesh save (its manifest and its data file's header),
    and torch's own dcp.save where torch is installed; {what: (directory, file mutated)}."""
    import numpy as np

    import unimesh

    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((6, 4)).astype(np.float32), "n": np.arange(5),
            "m": {"b": rng.random(3) > 0.5}}  # fmt: skip
    unimesh.save(root / "unimesh", tree)
    data = next(p.name for p in (root / "unimesh").iterdir() if p.name.startswith("data-"))
    seeds = {"manifest": (root / "unimesh", "manifest.json"),
             "data file": (root / "unimesh", data)}  # fmt: skip
    try:
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return seeds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16),
                  "step": 3}, checkpoint_id=str(root / "dcp"))  # fmt: skip
    seeds["dcp .metadata"] = (root / "dcp", ".metadata")
    seeds["dcp chunk file"] = (root / "dcp", "__0_0.distcp")
    return seeds


def _mutate(rnd: Any, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rnd.choice([1, 1, 1, 2, 4])):
        how = rnd.randint(0, 5)
        at = rnd.randint(0, max(0, len(out) - 1))
        if how == 0 and out:  # flip a bit
            out[at] ^= 1 << rnd.randint(0, 7)
        elif how == 1 and out:  # a byte
            out[at] = rnd.choice([0, 0xFF, 0x7F, 0x80, ord("9"), ord('"'), ord("{")])
        elif how == 2:  # cut
            del out[at : at + rnd.randint(1, 64)]
        elif how == 3:  # insert
            out[at:at] = bytes(rnd.randint(0, 255) for _ in range(rnd.randint(1, 16)))
        elif how == 4:  # a digit run grows
            out[at:at] = b"9" * rnd.randint(1, 30)
        else:  # truncate
            del out[at:]
    return bytes(out)


def mutate_checkpoints(count: int, seed: int = 0) -> Any:
    """``count`` mutations of real checkpoints' files (spread over the seeds), each opened
    and every tensor read: outcomes, failures (anything but a CheckpointError, or an audit
    event), the slowest input. Returns a grammar.Run-like record."""
    import random
    import shutil
    import time

    import unimesh

    from .fuzzing import watching
    from .grammar import Run

    rnd = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="unimesh-fuzz-ckpt-"))
    try:
        seeds = _seed_checkpoints(work / "seeds")
        run = Run("checkpoint mutations")
        originals = {k: (d, f, (d / f).read_bytes()) for k, (d, f) in seeds.items()}
        t0 = time.perf_counter()
        for i in range(count):
            what = list(originals)[i % len(originals)]
            directory, name, data = originals[what]
            blob = _mutate(rnd, data)
            (directory / name).write_bytes(blob)
            start = time.perf_counter()
            try:
                with watching() as seen:
                    ck = unimesh.open_checkpoint(directory)
                    for tensor in ck.names:
                        ck.read(tensor)
                outcome = "accepted"
            except unimesh.CheckpointError as exc:
                outcome = "CheckpointError" if str(exc).strip() else "empty message"
            except BaseException as exc:  # noqa: BLE001 - a failure to report
                outcome = "failure"
                run.failures.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
            if seen:
                outcome = "failure"
                run.failures.append(f"{what}: audit events {seen[:3]}")
            ms = (time.perf_counter() - start) * 1e3
            if ms > run.slowest_ms_per_100kb:
                run.slowest_ms_per_100kb = ms
                run.slowest = f"{ms:.2f} ms, {what}, {len(blob):,} bytes"
            key = f"{what}: {outcome}"
            run.outcomes[key] = run.outcomes.get(key, 0) + 1
            run.count += 1
        for directory, name, data in originals.values():
            (directory / name).write_bytes(data)
        run.seconds = time.perf_counter() - t0
        return run
    finally:
        shutil.rmtree(work, ignore_errors=True)
