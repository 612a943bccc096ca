"""The README's example runs, and each value its comments show is what the call returns."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_comments_hold():
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    lines = [ln for ln in block.splitlines() if "backend=" not in ln]  # needs a plugin installed
    ns: dict = {}
    exec(compile("\n".join(lines), "README.md", "exec"), ns)  # noqa: S102 - the README runs
    checked = 0
    for line in lines:
        code, _, comment = line.partition("#")
        code, comment = code.strip(), comment.strip()
        if not comment.startswith(("(", "[", "{", "Mesh(")) or "=" in code.split("(")[0]:
            continue
        if code.startswith("mesh ="):
            continue
        assert comment.startswith(repr(eval(code, ns))), (code, comment)
        checked += 1
    mesh_line = next(ln for ln in lines if ln.startswith("mesh = "))
    assert mesh_line.split("#")[1].strip() == repr(ns["mesh"])
    assert checked >= 5
