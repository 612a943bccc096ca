"""``unimesh checkpoint show``, ``verify`` and ``convert``: a checkpoint as a person reads it,
every promise of its files checked, and the checkpoint written out as Hugging Face
safetensors with a progress bar; no framework imported."""

from __future__ import annotations

from typing import Any

from ..checkpoint import open_checkpoint
from ..errors import CheckpointError
from ..messages import short

__all__ = ["convert", "describe", "problems"]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def describe(path: str) -> dict[str, Any]:
    """What ``show --json`` prints: per tensor its shape, dtype, saved mesh and spec, boxes
    and bytes; the files and the total."""
    ck = open_checkpoint(path)
    tensors = {}
    for name, t in ck.tensors.items():
        saved = ck.layout(name) if t.layout is not None else None
        tensors[name] = {
            "shape": list(t.shape),
            "dtype": t.dtype,
            "mesh": None if saved is None else saved.mesh.to_string(),
            "spec": None if saved is None else repr(saved.spec),
            "boxes": len(t.boxes),
            "bytes": t.nbytes,
        }
    files = sorted({b.file for t in ck.tensors.values() for b in t.boxes})
    return {
        "path": str(ck.path),
        "tensors": tensors,
        "files": files,
        "bytes": sum(t.nbytes for t in ck.tensors.values()),
    }


def show(path: str, as_json: bool) -> int:
    info = describe(path)
    if as_json:
        import json

        print(json.dumps(info, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("tensor", "shape", "dtype", "saved layout", "boxes", "size"):
        table.add_column(col, overflow="fold")
    for name, t in info["tensors"].items():
        layout = "host array" if t["mesh"] is None else f"{t['spec']} on {t['mesh']}"
        table.add_row(
            name,
            "x".join(map(str, t["shape"])) or "scalar",
            t["dtype"],
            layout,
            str(t["boxes"]),
            _size(t["bytes"]),
        )
    console = Console(soft_wrap=False)
    console.print(table)
    n = len(info["tensors"])
    console.print(
        f"{n} tensor{'s' if n != 1 else ''}, {_size(info['bytes'])} in "
        f"{len(info['files'])} data file{'s' if len(info['files']) != 1 else ''}"
    )
    return 0


def problems(path: str) -> list[str]:
    """Everything wrong with the checkpoint at ``path`` (empty: it is sound): the manifest
    parses strictly and its boxes tile every tensor once; every data file is there with a
    sound safetensors header; every box's entry in its file has the manifest's dtype, shape
    and byte range, and its bytes the checksum the save wrote (this reads every byte)."""
    try:
        ck = open_checkpoint(path)
    except CheckpointError as exc:
        return [str(exc)]
    found: list[str] = []
    headers: dict[str, dict[str, Any]] = {}
    files = {b.file for t in ck.tensors.values() for b in t.boxes}
    # DCP's chunks were each checked on open; Orbax's zarr metadata too (its chunks are
    # TensorStore's to read)
    for name in sorted(files) if ck.kind not in ("dcp", "orbax") else ():
        try:
            headers[name] = ck.header(name)
        except CheckpointError as exc:
            found.append(str(exc))
    for tname, t in ck.tensors.items():
        for box in t.boxes:
            entries = headers.get(box.file)
            if entries is None:
                continue
            key = tname if ck.kind == "safetensors" else f"{tname}@{','.join(map(str, box.offset))}"
            entry = entries.get(key)
            if entry is None:
                found.append(f"tensor {tname!r}: {box.file} has no entry {short(key)}")
                continue
            dtype, shape, start, end = entry
            if (dtype, tuple(shape), start, end) != (t.dtype, box.size, box.start, box.end):
                found.append(
                    f"tensor {tname!r}: the manifest says {t.dtype} {box.size} at bytes "
                    f"{box.start}..{box.end} of {box.file}, its header {dtype} {tuple(shape)} "
                    f"at {start}..{end}"
                )
                continue
            try:
                ck.check_box(tname, box)
            except CheckpointError as exc:
                found.append(str(exc))
    return found


def verify(path: str) -> int:
    found = problems(path)
    if found:
        for line in found:
            print(f"unimesh: {line}")
        print(f"{path}: {len(found)} problem{'s' if len(found) != 1 else ''}")
        return 1
    ck = open_checkpoint(path)
    print(f"{path}: sound ({len(ck.tensors)} tensors, every box in its file and tiled once)")
    return 0


def convert(src: str, dst: str, max_shard: int, bar: bool) -> int:
    """``convert SRC DST --to safetensors``: :func:`unimesh.checkpoint.to_safetensors` with a
    progress bar of bytes (on stderr; none with ``bar=False``)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from ..checkpoint import to_safetensors
    from ..checkpoint.storage import open_storage

    console = Console(stderr=True)
    with Progress(
        TextColumn("converting"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not bar,
    ) as progress:
        task = progress.add_task("convert", total=None)

        def step(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        files = to_safetensors(src, dst, max_shard_bytes=max_shard, progress=step)
    written = open_storage(dst)  # a directory or an fsspec URL
    size = sum(written.size(f) for f in files)
    print(f"{dst}: {len(files)} file{'s' if len(files) != 1 else ''} ({', '.join(files[:3])}"
          f"{', ...' if len(files) > 3 else ''}), {_size(size)}")  # fmt: skip
    return 0
