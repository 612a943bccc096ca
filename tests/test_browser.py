"""What a person sees in a browser: the docs site's pages in headless Chromium (screenshots;
no table or code block runs past the page's column) and the notebook view of a mesh and a
layout (``_repr_html_``), read back pixel by pixel."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

import unimesh
from unimesh import Layout, P
from unimesh.visual import PALETTE

from .support.browser import chromium, measure, screenshot

#: For every table and code block in the page's content column: its right edge, or that of
#: the box it scrolls in, against the column's.
OVERFLOW = """(() => {
  const col = document.querySelector('.content') || document.body;
  const limit = col.getBoundingClientRect().right;
  const items = [];
  for (const el of col.querySelectorAll('table, pre')) {
    let box = el;
    for (let a = el.parentElement; a && a !== col; a = a.parentElement) {
      const o = getComputedStyle(a).overflowX;
      if (o === 'auto' || o === 'scroll') { box = a; break; }
    }
    items.push({what: el.tagName + ' ' + el.textContent.trim().slice(0, 60),
                right: box.getBoundingClientRect().right,
                cut: el.tagName === 'PRE' && el.scrollWidth > el.clientWidth + 1});
  }
  const broken = [];  // inline code split over lines
  for (const el of col.querySelectorAll('code.literal')) {
    if (el.getClientRects().length > 1) broken.push(el.textContent);
  }
  return {limit: limit, items: items, broken: broken};
})()"""


@pytest.mark.parametrize(
    "page", ["index", "quickstart", "programs", "porting", "capabilities", "api-mapping"]
)
def test_docs_page_fits_its_column(docs_html, page, tmp_path):
    """At 1400 px and at a phone's 420 px, every table and code block ends inside the content
    column or scrolls inside its own box (the API table used to run off-screen), and no code
    block hides the end of a line behind a sideways scroll (issue 40: `parallelize_modul`);
    at 1400 px no inline code breaks over two lines (`XLA_FLAGS=--` did); the page's
    screenshot has content (not one colour)."""
    from PIL import Image

    for width in (1400, 420):
        found = measure(docs_html / f"{page}.html", OVERFLOW, width=width)
        assert found["items"], f"{page}: no table or code block found"
        over = [i for i in found["items"] if i["right"] > found["limit"] + 0.5]
        assert not over, (page, width, found["limit"], over)
        cut = [i["what"] for i in found["items"] if i["cut"]]
        assert not cut, (page, width, cut)
        if width == 1400:
            assert not found["broken"], (page, found["broken"])
    shot = screenshot(docs_html / f"{page}.html", tmp_path / f"{page}.png")
    with Image.open(shot) as image:
        assert image.size == (1400, 1000)
        assert len(image.convert("RGB").getcolors(1 << 20) or ()) > 50, "a blank page"


def _cells(html: str, tmp_path: Path, name: str) -> tuple[list[dict[str, Any]], Any]:
    """The page of ``html`` rendered: each device cell's box and data, and the screenshot."""
    from PIL import Image

    page = tmp_path / f"{name}.html"
    page.write_text(f"<html><body style='margin:8px;background:#fff'>{html}</body></html>")
    script = (
        "Array.from(document.querySelectorAll('td[data-device]')).map(td => { "
        "const r = td.getBoundingClientRect(); return {device: +td.dataset.device, "
        "key: td.dataset.key, x: r.left, y: r.top, w: r.width, h: r.height}; })"
    )
    cells = measure(page, script, width=800, height=600)
    shot = screenshot(page, tmp_path / f"{name}.png", width=800, height=600)
    return cells, Image.open(shot).convert("RGB")


def _colour(hexcode: str) -> tuple[int, int, int]:
    return tuple(int(hexcode[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("spec", "ids", "blocks"),
    [
        (P("dp", "tp"), None, 8),
        (P("dp"), None, 2),
        (P(("tp", "dp")), "dp=2,tp=4;ids=7,6,5,4,3,2,1,0", 8),
        (P(None, "tp"), "dp=2,tp=4;ids=3,1,2,0,7,5,6,4", 4),
    ],
)
def test_notebook_view_draws_each_block_in_its_colour(spec, ids, blocks, tmp_path):
    """Layout._repr_html_ in Chromium: one cell per device on the mesh's grid (rows along dp,
    columns along tp), and the pixels inside each cell are the colour of the block the core
    says that device holds: devices with the same block share a colour, others differ."""
    chromium()
    mesh = unimesh.Mesh.from_string(ids or "dp=2,tp=4")
    layout = Layout(mesh, spec)
    cells, image = _cells(layout._repr_html_(), tmp_path, "layout")
    assert sorted(c["device"] for c in cells) == list(range(8))
    grid = mesh.device_ids
    rows = sorted({round(c["y"]) for c in cells})
    cols = sorted({round(c["x"]) for c in cells})
    assert (len(rows), len(cols)) == grid.shape  # drawn as the mesh's grid
    counts = layout.shard_counts()
    colour_of_block: dict[tuple[int, ...], tuple[int, int, int]] = {}
    for c in cells:
        r, k = rows.index(round(c["y"])), cols.index(round(c["x"]))
        assert grid[r, k] == c["device"], (r, k, c)
        pixel = image.getpixel((int(c["x"]) + 3, int(c["y"]) + 3))  # inside the border
        block = tuple(s.start for s in layout.shard_slices(counts, c["device"]))
        index = sum(b * math.prod(counts[i + 1 :]) for i, b in enumerate(block))
        assert pixel == _colour(PALETTE[index % len(PALETTE)]), (c, pixel)
        assert colour_of_block.setdefault(block, pixel) == pixel
    assert len(colour_of_block) == blocks
    assert len(set(colour_of_block.values())) == blocks  # different blocks, different colours


def test_notebook_view_of_a_mesh_colours_processes(tmp_path):
    """Mesh._repr_html_ with devices_per_process: cells of one process share a colour."""
    chromium()
    mesh = unimesh.Mesh((2, 4), ("dp", "tp"), devices_per_process=2)
    cells, image = _cells(mesh._repr_html_(), tmp_path, "mesh")
    seen: dict[int, tuple[int, int, int]] = {}
    for c in cells:
        pixel = image.getpixel((int(c["x"]) + 3, int(c["y"]) + 3))
        process = c["device"] // 2
        assert pixel == _colour(PALETTE[process % len(PALETTE)]), (c, pixel)
        seen.setdefault(process, pixel)
    assert len(set(seen.values())) == 4
