"""The folder layout keeps its promises: the core's modules import each other without cycles at
import time, and no backend (nor the command line) imports a private module of the core."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"unimesh": ROOT / "unimesh"} | {
    p.name: p for p in (ROOT / "backends").iterdir() if (p / "__init__.py").exists()
}


def _module_name(path: Path) -> str:
    for pkg, root in PACKAGES.items():
        if path.is_relative_to(root):
            rel = path.relative_to(root).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise AssertionError(path)


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported: module-level statements only, outside
    ``if TYPE_CHECKING:`` (imports inside functions run later, on use)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - sub.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                out.add(base)
                out.update(f"{base}.{a.name}" for a in sub.names)
    return out


def _graph() -> dict[str, set[str]]:
    files = [f for root in PACKAGES.values() for f in root.rglob("*.py")]
    names = {_module_name(f): f for f in files}
    graph: dict[str, set[str]] = {}
    for mod, f in names.items():
        graph[mod] = {m for m in _top_level_imports(f) if m in names and m != mod}
    return graph


def test_the_core_and_backends_have_no_import_cycles():
    graph = _graph()
    assert "unimesh.layout" in graph and "unimesh_torch.programs" in graph
    # a package imports its submodules from __init__: that edge is not a cycle by itself
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph[mod]):
            if mod.startswith(dep + ".") or dep.startswith(mod + "."):
                continue  # package <-> its own submodule
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_backends_and_the_command_line_use_only_the_public_core():
    """What they take from ``unimesh`` (absolute imports in a backend, ``..`` imports in the
    command line) is neither a private module nor a private name."""
    private = []
    for f in [
        *ROOT.joinpath("backends").rglob("*.py"),
        *ROOT.joinpath("unimesh/cli").rglob("*.py"),
    ]:
        in_cli = "cli" in f.relative_to(ROOT).parts
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                core = node.level == 2 if in_cli else (node.module or "").startswith("unimesh")
                if node.level == 0 and (node.module or "").split(".")[0] != "unimesh":
                    core = False
                parts = (node.module or "").split(".")
                names = [a.name for a in node.names]
                if core and any(_private(p) for p in parts + names):
                    private.append(f"{f.relative_to(ROOT)}: from {node.module} import {names}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("unimesh.") and any(map(_private, a.name.split("."))):
                        private.append(f"{f.relative_to(ROOT)}: import {a.name}")
    assert not private, private
