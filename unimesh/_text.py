"""Parser of the mesh short text form (internal). Linear time, no evaluation."""

from __future__ import annotations

import re
from typing import Any

from ._validate import check_ndim, check_size, fail
from .errors import LayoutError
from .messages import short

# ASCII only: "dp=\u0662" (an Arabic-Indic two) or a full-width digit is refused, not read as 2,
# so that every accepted text is what to_string writes back.
#: a name written as it is; any other name is written as a JSON string ("mesh 0")
_BARE = r"[A-Za-z_][A-Za-z0-9_.\-]*"
_BARE_RE = re.compile(_BARE + r"\Z", re.ASCII)
_QUOTED = r'"(?:[^"\\]|\\.)*"'  # linear: each character is read by exactly one branch
_NAME = rf"(?:{_QUOTED}|{_BARE})"
_AXIS_RE = re.compile(rf"\s*({_NAME})\s*=\s*(\d{{1,12}})\s*\Z", re.ASCII)
#: one axis of the head, then what ends it (a comma, a semicolon or the end)
_HEAD_ITEM_RE = re.compile(rf"\s*({_NAME})\s*=\s*(\d{{1,12}})\s*(,|;|\Z)", re.ASCII)
_INT_RE = re.compile(r"\s*0*(\d{1,19})\s*\Z", re.ASCII)
_INT64_MAX = (1 << 63) - 1
_SECTIONS = ("ids", "types", "per_process")
_FORM = "'dp=2,tp=4' (optionally followed by ';ids=...', ';types=...', ';per_process=k')"


def quote_name(name: str, reserved: tuple[str, ...] = ()) -> str:
    """``name`` as the text forms write it: as it is when a plain word (``dp``, ``mesh-0``),
    else (and when ``reserved``) as a JSON string (``"data parallel"``)."""
    if _BARE_RE.match(name) and name not in reserved:
        return name
    import json

    return json.dumps(name, ensure_ascii=False)


def _name(token: str, s: str) -> str:
    """A name token of the text forms: a plain word, or a JSON string read back."""
    if not token.startswith('"'):
        return token
    import json

    try:
        out = json.loads(token)
    except ValueError:
        fail(f"cannot read the quoted axis name {short(token)} in {short(s)}: {token[:40]}")
    return str(out)


def _is_dtensor_form(s: str) -> bool:
    """TF DTensor's form starts with ``name|``; a quoted unimesh name may hold a ``|``."""
    head = s.partition("|")[0]
    return "|" in s and "=" not in head and '"' not in head


def parse_mesh_string(s: object) -> dict[str, Any]:
    """Split ``"dp=2,tp=4;ids=...;types=...;per_process=k"`` into Mesh keyword arguments."""
    if not isinstance(s, str):
        fail(f"Mesh.from_string() takes a str, got {short(s)} ({type(s).__name__})")
    if _is_dtensor_form(s):
        return parse_dtensor_string(s)
    names: list[str] = []
    shape: list[int] = []
    if '"' in s:  # quoted names may hold ',', ';' and '=': read the head item by item
        at = _read_head(s, names, shape)
        sections = s[at:].split(";") if at < len(s) else []
    else:
        head, *sections = s.split(";")
        if not head.strip():
            fail(f"mesh string {short(s)} names no axis; write it like {_FORM}")
        _parse_axes(head, s, names, shape)
    check_ndim(len(shape))  # before any ids are shaped into an array of that many dims
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
            fast = _canonical_ids(value, size)
            if fast is not None:
                out["device_ids"] = fast.reshape(tuple(shape))
                continue
            items = value.split(",")
            if len(items) != size:
                fail(
                    f"mesh string {short(s)} gives {len(items)} device ids for a mesh of "
                    f"{size} devices; list one id per device in row-major order"
                )
            ids = []
            for item in items:
                m = _INT_RE.match(item)
                if not m or int(m.group(1)) > _INT64_MAX:
                    fail(
                        f"device id {short(item.strip())} in mesh string {short(s)} is not a "
                        f"non-negative int64 (0 to {_INT64_MAX})"
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


def _canonical_ids(text: str, size: int) -> Any:
    """The ids of the form ``to_string`` writes (ASCII digits and commas, nothing else), read by
    numpy in one pass; None for anything else, which the careful per-item path then reads or
    refuses with a message."""
    import warnings

    import numpy as np

    if not text.isascii() or not text[:1].isdigit() or not text[-1:].isdigit():
        return None
    raw = text.encode("ascii")
    if raw.translate(None, b"0123456789,"):
        return None  # spaces, signs or other characters: the careful path
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            ids = np.fromstring(raw, dtype=np.int64, sep=",")
        except (ValueError, DeprecationWarning):
            return None  # an empty item (",,")
    if ids.size != size or (ids.size and int(ids.max()) == _INT64_MAX):
        return None  # a count to report, or an id numpy clipped at int64's top
    return ids


def _skeleton(shape: tuple[int, ...]) -> bytes:
    """The brackets and commas of a JSON array of ``shape`` with the numbers taken out:
    ``(2, 3)`` -> ``[[,,],[,,]]``."""
    inner = b""
    for n in reversed(shape):
        inner = b"[" + b",".join([inner] * n) + b"]"
    return inner


_JSON_IDS_KEY = '"device_ids":['


def json_ids_fast(text: str) -> dict[str, Any] | None:
    """A mesh dict from JSON of the compact form ``Mesh.to_json`` writes, its ``device_ids``
    read by numpy straight from the text (no million Python ints); None for any other form,
    which ``json.loads`` then reads. The array must have exactly the nesting of the mesh's
    shape, with one number in each place."""
    import json

    import numpy as np

    at = text.find(_JSON_IDS_KEY)
    if at < 0 or (at and text[at - 1] == "\\") or text.find(_JSON_IDS_KEY, at + 1) >= 0:
        return None
    start = at + len(_JSON_IDS_KEY) - 1
    stops = [i for i in (text.find('"', start), text.find("}", start)) if i >= 0]
    if not stops:
        return None
    array = text[start : min(stops)].rstrip(",")
    try:
        rest = json.loads(text[:start] + "null" + text[start + len(array) :])
    except (ValueError, RecursionError):
        return None
    shape = rest.get("shape") if isinstance(rest, dict) else None
    if (
        "device_ids" not in rest
        or rest["device_ids"] is not None
        or not isinstance(shape, list)
        or not shape
        or not all(type(n) is int and n > 0 for n in shape)
        or not array.isascii()
    ):
        return None
    raw = array.encode("ascii")
    if raw.translate(None, b"0123456789") != _skeleton(tuple(shape)):
        return None  # other characters, or another nesting: json.loads and the checks say what
    if any(gap in raw for gap in (b",,", b"[,", b",]", b"[]")):
        return None
    ids = np.fromstring(raw.translate(None, b"[]"), dtype=np.int64, sep=",")
    if ids.size != check_size(tuple(shape)) or int(ids.max()) == _INT64_MAX:
        return None
    out: dict[str, Any] = rest
    out["device_ids"] = ids.reshape(tuple(shape))
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
                f"name=size, like {_FORM} (a name other than a plain word in double quotes: "
                '"mesh 0"=2)'
            )
        names.append(_name(m.group(1), s))
        shape.append(int(m.group(2)))


def _read_head(s: str, names: list[str], shape: list[int]) -> int:
    """The axes of ``s`` up to its first section, one ``name=size`` at a time (names may be
    quoted); returns where the sections start."""
    at = 0
    while True:
        m = _HEAD_ITEM_RE.match(s, at)
        if not m:
            rest = s[at:].split(",", 1)[0]
            fail(
                f"cannot read axis {short(rest.strip())} in mesh string {short(s)}; each axis is "
                f"name=size, like {_FORM} (a name other than a plain word in double quotes: "
                '"mesh 0"=2)'
            )
        names.append(_name(m.group(1), s))
        shape.append(int(m.group(2)))
        at = m.end()
        if m.group(3) != ",":
            return at


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
        where = {g: i for i, g in enumerate(global_ids)}  # one pass, not .index() per device
        for pos, dev in zip(local_ids, devices):
            index = dev.rsplit(":", 1)[-1]
            if not (index.isascii() and index.isdigit()) or len(index) > 12:
                fail(
                    f"device {short(dev)} in DTensor mesh string {short(s)} does not end in "
                    "':<index>'"
                )
            ids[where[pos]] = int(index)
        out["device_ids"] = _reshape(ids, tuple(shape))
    else:
        out["device_ids"] = _reshape(global_ids, tuple(shape))
        out["devices_per_process"] = len(local_ids)
    return out


#: How text spells a replicated dim (the command line's specs, config files).
REPLICATED = ("", "_", "None", "none")


_SPEC_TOKEN_RE = re.compile(rf'\s*({_QUOTED})\s*(,|\+|\Z)|([^,+"]*)(,|\+|\Z)')


def parse_spec_text(text: str) -> list[Any]:
    """Spec entries from text: split by ``,``; an entry is an axis name, ``a+b`` for several
    axes on one dim, or ``None`` / ``_`` / nothing for a replicated dim (names are checked
    later, against the mesh). A name in double quotes is read as a JSON string (``"mesh 0"``,
    ``"None"``: an axis of that name)."""
    if '"' in text:
        return _parse_quoted_spec(text)
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


def spec_text(entries: Any) -> str:
    """The text form of spec entries, read back by :func:`parse_spec_text`."""
    out = []
    for entry in entries:
        if entry is None:
            out.append("_")
        elif isinstance(entry, str):
            out.append(quote_name(entry, REPLICATED))
        else:
            out.append("+".join(quote_name(a, REPLICATED) for a in entry))
    return ",".join(out)


def _parse_quoted_spec(text: str) -> list[Any]:
    """:func:`parse_spec_text` for text holding quoted names, one token at a time."""
    entries: list[Any] = []
    parts: list[tuple[str, bool]] = []  # the names of one entry, each with: was it quoted
    at = 0
    while True:
        m = _SPEC_TOKEN_RE.match(text, at)
        if m is None:
            fail(
                f"cannot read the spec {short(text)} at {short(text[at:])}: a quoted name is a "
                'JSON string standing alone between commas or pluses, like "mesh 0",tp',
                LayoutError,
            )
        if m.group(1) is not None:
            parts.append((_name(m.group(1), text), True))
            sep = m.group(2)
        else:
            parts.append((m.group(3).strip(), False))
            sep = m.group(4)
        at = m.end()
        if sep != "+":
            if len(parts) > 1:
                entries.append(tuple(name for name, _ in parts))
            elif not parts[0][1] and parts[0][0] in REPLICATED:
                entries.append(None)
            else:
                entries.append(parts[0][0])
            parts = []
        if not sep:
            return entries
