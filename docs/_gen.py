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
    from unimesh.backend import DERIVED, FEATURES, LAYERS

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


def generate(docs: Path) -> None:
    out = docs / "_generated"
    out.mkdir(exist_ok=True)
    tables = {
        "api-table.md": api_table(),
        "collectives-table.md": collectives_table(),
        "capability-names.md": capability_names(),
    }
    data = docs / "_data"
    tables["capabilities-table.md"] = capability_table(
        json.loads((data / "capabilities.json").read_text())
    )
    tables["benchmarks-table.md"] = benchmark_table(
        json.loads((data / "benchmarks.json").read_text())
    )
    for name, text in tables.items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
