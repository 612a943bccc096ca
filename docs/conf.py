"""Sphinx configuration. The docs are Markdown (MyST); the API reference comes from the
docstrings; the capability matrix, the benchmark table and the cross-framework API table are
generated at build time (``_generated/``) from ``_data/*.json`` (written by real runs:
``unimesh check --json`` and ``benchmarks/gather.py``) and from each backend's ``native_api``."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from _links import write_inventories

project = "unimesh"
author = "the unimesh developers"
copyright = "2026, the unimesh developers"
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx_copybutton",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_data", "_generated"]
napoleon_use_ivar = True
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True
nitpicky = False
# commands are copied from the page: no curly quotes or en-dashes for "--standalone"
smartquotes = False
html_theme = "furo"
html_title = "unimesh"
html_static_path = ["_static"]
html_css_files = ["unimesh.css"]
# the frameworks' inventories are written locally (docs/_links.py: CI builds offline)
(HERE / "_generated").mkdir(exist_ok=True)
intersphinx_mapping = write_inventories(HERE / "_generated")


def setup(app: object) -> None:
    from _gen import generate

    generate(HERE)
