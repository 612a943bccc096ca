"""Parser of the mesh short text form (internal). Linear time, no evaluation."""

from __future__ import annotations

import re
from typing import Any

from ._validate import check_size, fail
from .messages import short

_AXIS_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d{1,12})\s*\Z")
_INT_RE = re.compile(r"\s*(\d{1,18})\s*\Z")
_SECTIONS = ("ids", "types", "per_process")
_FORM = "'dp=2,tp=4' (optionally followed by ';ids=...', ';types=...', ';per_process=k')"


def parse_mesh_string(s: object) -> dict[str, Any]:
    """Split ``"dp=2,tp=4;ids=...;types=...;per_process=k"`` into Mesh keyword arguments."""
    if not isinstance(s, str):
        fail(f"Mesh.from_string() takes a str, got {short(s)} ({type(s).__name__})")
    if "|" in s:
        return parse_dtensor_string(s)
    head, *sections = s.split(";")
    if not head.strip():
        fail(f"mesh string {short(s)} names no axis; write it like {_FORM}")
    names: list[str] = []
    shape: list[int] = []
    _parse_axes(head, s, names, shape)
    out: dict[str, Any] = {"shape": tuple(shape), "axis_names": tuple(names)}
    seen: set[str] = set()
    for sec in sections:
        key, eq, value = sec.partition("=")
        key = key.strip()
        if not eq or key not in _SECTIONS:
            fail(
                f"unknown section {short(sec.strip())} in mesh string {short(s)}; sections are "
                f"{', '.join(k + '=...' for k in _SECTIONS)}"
            )
        if key in seen:
            fail(f"section {key!r} appears twice in mesh string {short(s)}")
        seen.add(key)
        if key == "ids":
            size = check_size(tuple(shape))
            items = value.split(",")
            if len(items) != size:
                fail(
                    f"mesh string {short(s)} gives {len(items)} device ids for a mesh of "
                    f"{size} devices; list one id per device in row-major order"
                )
            ids = []
            for item in items:
                m = _INT_RE.match(item)
                if not m:
                    fail(
                        f"device id {short(item.strip())} in mesh string {short(s)} is not a "
                        "non-negative int"
                    )
                ids.append(int(m.group(1)))
            out["device_ids"] = _reshape(ids, tuple(shape))
        elif key == "types":
            out["axis_types"] = tuple(t.strip() for t in value.split(","))
        else:
            m = _INT_RE.match(value)
            if not m:
                fail(
                    f"per_process={short(value.strip())} in mesh string {short(s)} must be a "
                    "positive int"
                )
            out["devices_per_process"] = int(m.group(1))
    return out


def _reshape(flat: list[int], shape: tuple[int, ...]) -> Any:
    import numpy as np

    return np.asarray(flat, dtype=np.int64).reshape(shape)


def _parse_axes(head: str, s: str, names: list[str], shape: list[int]) -> None:
    for part in head.split(","):
        m = _AXIS_RE.match(part)
        if not m:
            fail(
                f"cannot read axis {short(part.strip())} in mesh string {short(s)}; each axis is "
                f"name=size, like {_FORM}"
            )
        names.append(m.group(1))
        shape.append(int(m.group(2)))


def _ints(text: str, what: str, s: str) -> list[int]:
    out = []
    for item in text.split(","):
        m = _INT_RE.match(item)
        if not m:
            fail(
                f"{what} entry {short(item.strip())} in DTensor mesh string {short(s)} is not a "
                "non-negative int"
            )
        out.append(int(m.group(1)))
    return out


def parse_dtensor_string(s: str) -> dict[str, Any]:
    """TF DTensor's ``Mesh.to_string()``: ``name|dp=2,tp=4|global ids|local ids|devices[|...]``.

    With one client (local ids cover the mesh) the device at each position gives the neutral id
    (its device index); with several clients the neutral ids are DTensor's global ids and
    ``devices_per_process`` is the number of local ids.
    """
    parts = s.split("|")
    if len(parts) < 5:
        fail(
            f"DTensor mesh string {short(s)} needs 5 '|'-separated fields: "
            "name|dims|global ids|local ids|devices"
        )
    names: list[str] = []
    shape: list[int] = []
    _parse_axes(parts[1], s, names, shape)
    size = check_size(tuple(shape))
    global_ids = _ints(parts[2], "global id", s)
    local_ids = _ints(parts[3], "local id", s)
    devices = [d.strip() for d in parts[4].split(",")]
    if len(global_ids) != size:
        fail(
            f"DTensor mesh string {short(s)} lists {len(global_ids)} global ids for a mesh of "
            f"{size} devices"
        )
    if len(devices) != len(local_ids):
        fail(
            f"DTensor mesh string {short(s)} lists {len(local_ids)} local ids but "
            f"{len(devices)} local devices"
        )
    if sorted(global_ids) != list(range(size)) or not set(local_ids) <= set(global_ids):
        fail(
            f"DTensor mesh string {short(s)}: global ids must be 0..{size - 1} and local ids "
            "among them"
        )
    out: dict[str, Any] = {"shape": tuple(shape), "axis_names": tuple(names)}
    if len(local_ids) == size:
        ids = [0] * size
        for pos, dev in zip(local_ids, devices):
            index = dev.rsplit(":", 1)[-1]
            if not index.isdigit() or len(index) > 12:
                fail(
                    f"device {short(dev)} in DTensor mesh string {short(s)} does not end in "
                    "':<index>'"
                )
            ids[global_ids.index(pos)] = int(index)
        out["device_ids"] = _reshape(ids, tuple(shape))
    else:
        out["device_ids"] = _reshape(global_ids, tuple(shape))
        out["devices_per_process"] = len(local_ids)
    return out


#: How text spells a replicated dim (the command line's specs, config files).
REPLICATED = ("", "_", "None", "none")


def parse_spec_text(text: str) -> list[Any]:
    """Spec entries from text: split by ``,``; an entry is an axis name, ``a+b`` for several
    axes on one dim, or ``None`` / ``_`` / nothing for a replicated dim (names are checked
    later, against the mesh)."""
    entries: list[Any] = []
    for raw in text.split(","):
        item = raw.strip()
        if item in REPLICATED:
            entries.append(None)
        elif "+" in item:
            entries.append(tuple(part.strip() for part in item.split("+")))
        else:
            entries.append(item)
    return entries
