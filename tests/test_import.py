"""`import unimesh` imports no ML framework, and neither does listing backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.quick  # framework-free and fast: in the quick tier

FRAMEWORKS = ("torch", "jax", "jaxlib", "keras", "tensorflow", "mlx")


def _run(code: str) -> dict:
    env = dict(os.environ)
    env.pop("UNIMESH_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_and_listing_import_no_framework():
    out = _run(
        "import json, sys\n"
        "import unimesh\n"
        "after_import = sorted(sys.modules)\n"
        "names = unimesh.backends()\n"
        "m = unimesh.Mesh.from_string('dp=2,tp=4')\n"
        "unimesh.Layout(m, unimesh.P('dp', 'tp')).device_slices((4, 8))\n"
        "print(json.dumps({'after_import': after_import, 'all': sorted(sys.modules),"
        " 'names': names}))\n"
    )
    roots = {name.split(".")[0] for name in out["all"]}
    assert not roots & set(FRAMEWORKS), roots & set(FRAMEWORKS)
    # pluggy and entry-point metadata are loaded lazily, not by `import unimesh`
    import_roots = {name.split(".")[0] for name in out["after_import"]}
    assert "pluggy" not in import_roots
    assert isinstance(out["names"], list)


def test_installed_backends_load_without_their_framework():
    # loading every installed plugin module (for detection) still imports no framework
    out = _run(
        "import json, sys\n"
        "import unimesh\n"
        "from unimesh.registry import REGISTRY\n"
        "loaded = [b.name for b in REGISTRY.all_loaded()]\n"
        "print(json.dumps({'loaded': loaded, 'all': sorted(sys.modules)}))\n"
    )
    roots = {name.split(".")[0] for name in out["all"]}
    assert not roots & set(FRAMEWORKS), roots & set(FRAMEWORKS)


def test_the_version_is_written_once():
    """The installed metadata's version is ``unimesh.__version__`` (pyproject reads it), and
    pyproject.toml writes no version of its own."""
    import importlib.metadata
    from pathlib import Path

    import tomllib

    import unimesh

    assert importlib.metadata.version("unimesh") == unimesh.__version__
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert (Path(__file__).parents[1] / "LICENSE").read_text().split()[:3] == [
        "Apache",
        "License",
        "Version",
    ]
    assert project["project"]["license"] == "Apache-2.0"
