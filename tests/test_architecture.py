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
            out.update(_named(sub, package, names=True))
    return out


def _named(node: ast.AST, package: str, names: bool) -> set[str]:
    """The modules an import statement names (``names``: with each ``module.name`` it takes,
    which may be a submodule); nothing for another node."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return {base} | ({f"{base}.{a.name}" for a in node.names} if names else set())


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
    own = {
        m: {d for d in deps if not (m.startswith(d + ".") or d.startswith(m + "."))}
        for m, deps in graph.items()
    }
    cycle = _cycle(own)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (module -> modules it imports), as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state:
            found = visit(mod)
            if found:
                return found
    return None


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


def test_no_module_imports_a_private_name_of_another():
    """A name one module takes from another of ours (core, backend, or a benchmark taking it
    from either) is public in its home:
    private names stay inside their module (imports from the standard library or a framework,
    as ``re._parser``, are theirs to name)."""
    ours = set(PACKAGES)
    found = []
    files = [p for root in PACKAGES.values() for p in root.rglob("*.py")]
    for f in [*files, *ROOT.joinpath("benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                continue
            if node.level == 0 and (node.module or "").split(".")[0] not in ours:
                continue
            names = [a.name for a in node.names if _private(a.name)]
            if names:
                found.append(
                    f"{f.relative_to(ROOT)}: from {'.' * node.level}{node.module} import {names}"
                )
    assert not found, found


def _all_imports(path: Path) -> list[tuple[str, ast.stmt]]:
    """Every import in ``path`` that runs at some point, function-level ones included
    (``if TYPE_CHECKING:`` blocks never run), as (module, statement)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skipped = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    out: list[tuple[str, ast.stmt]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.extend((a.name, node) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.append((base, node))
            out.extend((f"{base}.{a.name}", node) for a in node.names)
    return out


#: the one lazy edge allowed to point up: a Mesh's and a Layout's notebook view
#: (``_repr_html_``) draws with unimesh.visual, which sits above both
LAZY_UP = {("unimesh.mesh", "unimesh.visual"), ("unimesh.layout", "unimesh.visual")}


def test_no_import_cycle_even_through_function_level_imports():
    """A lazy import is for a framework or an optional library, never to hide a cycle among
    our own modules: with every import counted (function-level ones too), the core's modules
    form a hierarchy, and so do each backend's (a backend's modules and the core's together).
    The notebook view is the one exception, marked where it is."""
    files = {_module_name(f): f for root in PACKAGES.values() for f in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        deps = set()
        for dep, node in _all_imports(f):
            if dep not in files or dep == mod:
                continue
            if mod.startswith(dep + ".") or dep.startswith(mod + "."):
                continue  # a package and its own submodules
            if (mod, dep) in LAZY_UP:
                line = f.read_text().splitlines()[node.lineno - 1]
                assert "# lazy: the notebook view" in line, (mod, dep, line)
                continue
            deps.add(dep)
        graph[mod] = deps
    assert {"unimesh.registry", "unimesh.runtime", "unimesh.parallel"} <= set(graph)
    assert {"unimesh_mlx.compiled", "unimesh_mlx.programs", "unimesh_torch.programs"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle (function-level imports counted): " + " -> ".join(
        cycle or []
    )


def _backend_names() -> set[str]:
    """The backends this repository ships, from pyproject's entry points."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["entry-points"]["unimesh.backends"])


#: modules that read files a framework writes: the strings there are that file format's
#: names (the Python module paths inside torch DCP's pickles), not a backend chosen by name
FILE_FORMATS = {"unimesh/checkpoint/dcp.py", "unimesh/checkpoint/pickles.py"}


def test_the_core_names_no_backend():
    """No string in the core's code (docstrings aside) is a backend's name, its plugin
    package, or its launcher: what the core knows of a backend comes from the backend's own
    declarations (launcher_signs, features, native_api ...)."""
    names = _backend_names()
    assert {"torch", "jax", "mlx"} <= names
    launchers = {"torchrun", "jax.distributed", "mlx.launch", "mpirun", "keras.distribution"}
    packages = {f"unimesh_{n}" for n in names}
    found = []
    for f in sorted((ROOT / "unimesh").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        tree = ast.parse(f.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            if id(node) in docs:
                continue
            value = node.value
            hit = value in names | launchers | packages or value.split(".")[0] in packages
            if hit and rel not in FILE_FORMATS:
                found.append(f"{rel}:{node.lineno}: {value!r}")
    assert not found, found


def test_tests_import_no_other_test_module_and_keep_their_helpers_in_support():
    """The tests' floor plan: ``test_*.py`` files at the top of ``tests/``, the scripts they
    launch in ``tests/workers/``, what both share in ``tests/support/``; no test module imports
    another (a helper two tests need lives in support), and no worker or helper sits beside
    the tests."""
    tests = ROOT / "tests"
    loose = sorted(
        p.name
        for p in tests.glob("*.py")
        if not p.name.startswith("test_") and p.name not in ("__init__.py", "conftest.py")
    )
    assert not loose, (
        f"helpers or workers beside the tests (move them to support/ or workers/): {loose}"
    )
    found = []
    for f in sorted([*tests.glob("*.py"), *(tests / "support").glob("*.py"),
                     *(tests / "workers").glob("*.py")]):  # fmt: skip
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.split(".")[-1].startswith("test_"):
                    found.append(f"{f.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not found, found
    assert sorted(p.name for p in (tests / "workers").glob("*_worker.py"))


def _every_import(path: Path) -> set[str]:
    """Every module ``path`` names in an import, anywhere: at the top, in functions and under
    ``if TYPE_CHECKING:`` alike."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return {m for sub in ast.walk(ast.parse(path.read_text())) for m in _named(sub, package, False)}


def test_the_engine_rooms_form_a_tree():
    """The per-process engine's rooms, lowest first: none names a room above it, not even for
    typing (issue 69): they see a backend as ``unimesh.primitives.Primitives``, and only
    ``spmd`` (the top: the contract a backend derives from, and a program's run) names them
    all."""
    rooms = ["primitives", "groups", "checked", "vmaplan", "process_env", "grad_rules", "spmd"]
    for i, room in enumerate(rooms):
        named = _every_import(ROOT / "unimesh" / f"{room}.py")
        above = sorted(r for r in rooms[i + 1 :] if f"unimesh.{r}" in named)
        assert not above, f"unimesh/{room}.py names {above}, above it"
