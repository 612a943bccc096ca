"""Parser of the mesh short text form (internal). Linear time, no evaluation."""

from __future__ import annotations

import re
from typing import Any

from ._validate import check_size, fail, short

_AXIS_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d{1,12})\s*\Z")
_INT_RE = re.compile(r"\s*(\d{1,18})\s*\Z")
_SECTIONS = ("ids", "types", "per_process")
_FORM = "'dp=2,tp=4' (optionally followed by ';ids=...', ';types=...', ';per_process=k')"


def parse_mesh_string(s: object) -> dict[str, Any]:
    """Split ``"dp=2,tp=4;ids=...;types=...;per_process=k"`` into Mesh keyword arguments."""
    if not isinstance(s, str):
        fail(f"Mesh.from_string() takes a str, got {short(s)} ({type(s).__name__})")
    head, *sections = s.split(";")
    if not head.strip():
        fail(f"mesh string {short(s)} names no axis; write it like {_FORM}")
    names: list[str] = []
    shape: list[int] = []
    for part in head.split(","):
        m = _AXIS_RE.match(part)
        if not m:
            fail(f"cannot read axis {short(part.strip())} in mesh string {short(s)}; each axis is "
                 f"name=size, like {_FORM}")
        names.append(m.group(1))
        shape.append(int(m.group(2)))
    out: dict[str, Any] = {"shape": tuple(shape), "axis_names": tuple(names)}
    seen: set[str] = set()
    for sec in sections:
        key, eq, value = sec.partition("=")
        key = key.strip()
        if not eq or key not in _SECTIONS:
            fail(f"unknown section {short(sec.strip())} in mesh string {short(s)}; sections are "
                 f"{', '.join(k + '=...' for k in _SECTIONS)}")
        if key in seen:
            fail(f"section {key!r} appears twice in mesh string {short(s)}")
        seen.add(key)
        if key == "ids":
            size = check_size(tuple(shape))
            items = value.split(",")
            if len(items) != size:
                fail(f"mesh string {short(s)} gives {len(items)} device ids for a mesh of "
                     f"{size} devices; list one id per device in row-major order")
            ids = []
            for item in items:
                m = _INT_RE.match(item)
                if not m:
                    fail(f"device id {short(item.strip())} in mesh string {short(s)} is not a "
                         "non-negative int")
                ids.append(int(m.group(1)))
            out["device_ids"] = _reshape(ids, tuple(shape))
        elif key == "types":
            out["axis_types"] = tuple(t.strip() for t in value.split(","))
        else:
            m = _INT_RE.match(value)
            if not m:
                fail(f"per_process={short(value.strip())} in mesh string {short(s)} must be a "
                     "positive int")
            out["devices_per_process"] = int(m.group(1))
    return out


def _reshape(flat: list[int], shape: tuple[int, ...]) -> Any:
    import numpy as np

    return np.asarray(flat, dtype=np.int64).reshape(shape)
