"""One process running the README's Python blocks exactly as written, under a real launcher.
Started by tests/test_readme.py.

    python readme_worker.py KEEP_TORCH_LINE OUT_DIR

The example block and the "Under a launcher" block run in one namespace with no framework
imported first (unimesh finds the launcher itself); KEEP_TORCH_LINE "0" drops the one line that
names torch (``to_native(mesh, backend="torch")``) for the JAX and MLX launchers. Each process
writes what it saw to OUT_DIR/rank<i>.json.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
FRAMEWORKS = ("torch", "jax", "mlx")


def main() -> None:
    keep_torch, out_dir = sys.argv[1] == "1", Path(sys.argv[2])
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    example = blocks[0]
    (launched,) = [b for b in blocks if "unimesh.initialize()" in b]
    if not keep_torch:
        example = "\n".join(ln for ln in example.splitlines() if 'backend="torch"' not in ln)
    before = [m for m in FRAMEWORKS if m in sys.modules]
    ns: dict = {}
    exec(compile(example + "\n" + launched, "README.md", "exec"), ns)  # noqa: S102 - the README
    import unimesh

    rank, world = unimesh.initialize()  # a second call: the same answer
    result = {
        "rank": rank,
        "world": world,
        "imported_before": before,
        "launcher": unimesh.detect_launcher().name,
        "backend": unimesh.get_backend().name,
        "native": type(ns["native"]).__name__ if "native" in ns else None,
        "native_mesh": str(unimesh.from_native(ns["native"])) if "native" in ns else None,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
