"""Generates the docs' tables (``docs/_generated/*.md``) from real runs and declarations."""

from __future__ import annotations

import json
from pathlib import Path

from _links import linked


def _backends() -> dict[str, object]:
    """Every installed backend's plugin object, by name (entry points; no framework import):
    a backend installed from its own package appears in every table without an edit here."""
    from unimesh import UnimeshError, backends
    from unimesh.registry import load_backend

    out = {}
    for name in backends():
        try:
            out[name] = load_backend(name)
        except UnimeshError:
            continue
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def api_table() -> str:
    """concept -> unimesh API -> each backend's native API (from ``Backend.native_api``)."""
    import unimesh

    classes = {name: type(be) for name, be in _backends().items()}
    head = ["concept", "unimesh", *classes]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for concept, neutral in unimesh.CONCEPTS.items():
        cells = [concept, f"`{neutral}`"]
        for cls in classes.values():
            api = cls.native_api.get(concept)  # type: ignore[attr-defined]
            cells.append(linked(_cell(api)) if api else "—")
        lines.append(
            "| " + " | ".join(_cell(c) if i < 2 else c for i, c in enumerate(cells)) + " |"
        )
    return "\n".join(lines) + "\n"


def capability_table(data: dict) -> str:
    """The matrix of the last ``unimesh check --json`` run committed to ``_data``, drawn by the
    same renderer as ``unimesh check --markdown``."""
    from unimesh.conformance.matrix import Cell, markdown

    columns = {
        f"{b} ({r['processes']})": {c: Cell.from_json(cell) for c, cell in r["cells"].items()}
        for b, r in data["backends"].items()
    }
    meta = data.get("run", {})
    return (
        markdown(columns) + f"\nRun: `{meta.get('command', 'unimesh check')}` on "
        f"{meta.get('machine', '?')}, {meta.get('date', '?')}.\n"
    )


def capability_names() -> str:
    """Each capability's name, its layer (or the capability a feature refines) and what it
    promises (``unimesh.CAPABILITIES``), so the matrix's rows read without the source."""
    from unimesh.contract import DERIVED, FEATURES, LAYERS

    lines = ["| capability | part of | what a backend that declares it does |"]
    lines.append("| --- | --- | --- |")
    for layer in LAYERS:
        for cap, text in layer.promises.items():
            lines.append(f"| `{cap}` | {layer.name} layer | {_cell(text)} |")
    for name, (text, needs) in FEATURES.items():
        lines.append(f"| `{name}` | feature of `{needs}` | {_cell(text)} |")
    for name, (text, caps) in DERIVED.items():
        lines.append(f"| `{name}` | follows from {', '.join(f'`{c}`' for c in caps)} | "
                     f"{_cell(text)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def hooks_table() -> str:
    """The contract, one row per hook (``unimesh.backend.HOOKS``): its layer, whether it is
    required, the capability it gives and what it promises."""
    from unimesh.contract import HOOKS

    lines = ["| hook | layer | required | gives | promise |", "| --- | --- | --- | --- | --- |"]
    for h in HOOKS:
        gives = f"`{h.capability}`" if h.capability else ""
        lines.append(f"| `{h.name}` | {h.layer} | {h.required} | {gives} | {_cell(h.promise)} |")
    return "\n".join(lines) + "\n"


def transport_table() -> str:
    """A reshard transport's operations (``unimesh.transport.TRANSPORT_OPS``), each with what
    it promises."""
    from unimesh.transport import TRANSPORT_OPS

    lines = ["| operation | promise |", "| --- | --- |"]
    for op, promise in TRANSPORT_OPS.items():
        lines.append(f"| `{op}` | {_cell(promise)} |")
    return "\n".join(lines) + "\n"


def collectives_table() -> str:
    """Per backend, which primitives of the per-process engine are the framework's own and
    which the engine builds (from ``ProcessBackend.native_primitives``)."""
    from unimesh.spmd import PRIMITIVES, ProcessBackend

    classes = {name: type(be) for name, be in _backends().items()}
    lines = ["| primitive | " + " | ".join(classes) + " |", "|" + " --- |" * (len(classes) + 1)]
    for primitive in PRIMITIVES:
        cells = []
        for cls in classes.values():
            if "shard_map" not in cls.capabilities:  # type: ignore[attr-defined]
                cells.append("—")
            elif issubclass(cls, ProcessBackend):
                cells.append("native" if primitive in cls.native_primitives else "built")
            else:
                cells.append("XLA (jax.lax)")
        lines.append(f"| {primitive} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def benchmark_table(data: dict) -> str:
    """The figures of the last ``benchmarks/gather.py`` run committed to ``_data``."""
    out: list[str] = []
    for section in data["sections"]:
        out.append(f"## {section['title']}\n")
        if section.get("note"):
            out.append(section["note"] + "\n")
        if section.get("date"):
            out.append(f"Measured {section['date']}.\n")
        cols = section["columns"]
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + " --- |" * len(cols))
        for row in section["rows"]:
            out.append("| " + " | ".join(_cell(str(row.get(c, ""))) for c in cols) + " |")
        out.append("")
    meta = data.get("run", {})
    out.append(
        f"Run: `{meta.get('command', 'python benchmarks/gather.py')}` on "
        f"{meta.get('machine', '?')}, {meta.get('date', '?')}."
    )
    return "\n".join(out) + "\n"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def checkpoint_chart(data: dict) -> str:
    """An SVG bar chart of the checkpoint sections of ``benchmarks.json``: each system's GB/s
    per operation (of the whole state), and beside it the fraction of the limit measured in
    the same run (the limits are bars of their own, in grey)."""
    bars: list[tuple[str, str, str, float, str]] = []  # group, system, label, GB/s, fraction
    for section in data["sections"]:
        if section.get("label") not in ("checkpoints", "checkpoints 4 processes"):
            continue
        group = "1 process" if section["label"] == "checkpoints" else "4 processes"
        for row in section["rows"]:
            gbs, system = row.get("GB/s"), str(row.get("system", ""))
            if not isinstance(gbs, (int, float)) or "s3" in system:
                continue
            launch = f"{row['launch']}: " if row.get("launch") else ""
            frac = row.get("of limit")
            text = f"{frac:.2f} of {row['limit']}" if isinstance(frac, (int, float)) else ""
            bars.append((group, system, f"{launch}{system} · {row['operation']}", gbs, text))
    if not bars:
        return ""
    colours = {"limit": "#9e9e9e", "unimesh": "#1f77b4"}
    width, label_w, bar_w, row_h, top = 980, 430, 330, 16, 30
    scale = bar_w / max(b[3] for b in bars)
    height = top + row_h * (len(bars) + 2 * len({b[0] for b in bars})) + 30
    title = (
        "Checkpoint GB/s per system (bars) and the fraction of the limit measured in the "
        "same run (right)"
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        + 'font-family="sans-serif" font-size="11">',
        f'<text x="4" y="16" font-size="13" font-weight="bold">{title}</text>',
    ]
    y, group = top, None
    for g, system, label, gbs, text in bars:
        if g != group:
            y += row_h
            out.append(f'<text x="4" y="{y}" font-weight="bold">{_escape(g)}</text>')
            y += 4
            group = g
        colour = colours.get(system, "#ff7f0e")
        end = label_w + gbs * scale
        out += [
            f'<text x="{label_w - 6}" y="{y + 11}" text-anchor="end">{_escape(label)}</text>',
            f'<rect x="{label_w}" y="{y + 2}" width="{max(gbs * scale, 1):.1f}" '
            + f'height="{row_h - 4}" fill="{colour}"/>',
            f'<text x="{end + 4:.1f}" y="{y + 11}">{gbs:.2f} GB/s  {_escape(text)}</text>',
        ]
        y += row_h
    out.append(
        f'<text x="4" y="{height - 8}" fill="#555">blue: unimesh; orange: the incumbents '
        + "(DCP, Orbax, safetensors, mx); grey: the limit (pwrite+fsync, pread, memcpy)</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def generate(docs: Path) -> None:
    out = docs / "_generated"
    out.mkdir(exist_ok=True)
    tables = {
        "api-table.md": api_table(),
        "collectives-table.md": collectives_table(),
        "capability-names.md": capability_names(),
        "hooks-table.md": hooks_table(),
        "transport-table.md": transport_table(),
    }
    data = docs / "_data"
    tables["capabilities-table.md"] = capability_table(
        json.loads((data / "capabilities.json").read_text())
    )
    tables["benchmarks-table.md"] = benchmark_table(
        json.loads((data / "benchmarks.json").read_text())
    )
    tables["checkpoint-chart.svg"] = checkpoint_chart(
        json.loads((data / "benchmarks.json").read_text())
    )
    for name, text in tables.items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
