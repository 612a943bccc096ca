"""unimesh.visualize and the notebook form (_repr_html_): the same facts as the core's answers."""

from __future__ import annotations

import io
from html.parser import HTMLParser

import numpy as np
import pytest
from rich.console import Console

import unimesh
from unimesh import Layout, LayoutError, Mesh, P


class _Cells(HTMLParser):
    """The tables of the HTML: per table, rows of (device id or None, cell text)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[tuple[int | None, str]]]] = []
        self._cell: list[str] | None = None
        self._device: int | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
            found = dict(attrs).get("data-device")
            self._device = None if found is None else int(found)
        elif tag == "br" and self._cell is not None:
            self._cell.append("\n")

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append((self._device, "".join(self._cell)))
            self._cell = None


def _grid(html: str) -> tuple[list[np.ndarray], list[list[list[str]]]]:
    parser = _Cells()
    parser.feed(html)
    ids, texts = [], []
    for table in parser.tables:
        rows = [[c for c in row if c[0] is not None] for row in table[1:]]
        ids.append(np.array([[d for d, _ in row] for row in rows]))
        texts.append([[t for _, t in row] for row in rows])
    return ids, texts


@pytest.mark.parametrize(
    "mesh",
    [
        Mesh((2, 3), ("dp", "tp"), [[5, 4, 3], [2, 1, 0]]),
        Mesh((4,), ("x",)),
        Mesh((2, 2, 2), ("pp", "dp", "tp"), np.arange(8)[::-1].reshape(2, 2, 2)),
    ],
)
def test_mesh_html_is_the_grid_of_device_ids(mesh):
    ids, _ = _grid(mesh._repr_html_())
    if mesh.ndim == 1:
        np.testing.assert_array_equal(ids[0], mesh.device_ids.reshape(1, -1))
    else:
        lead = mesh.device_ids.reshape(-1, *mesh.shape[-2:])
        assert len(ids) == len(lead)
        for got, want in zip(ids, lead):
            np.testing.assert_array_equal(got, want)


def test_layout_html_gives_each_device_its_block_index():
    mesh = Mesh((2, 2), ("dp", "tp"), [[1, 0], [3, 2]], devices_per_process=2)
    layout = Layout(mesh, P(("tp", "dp"), None))
    ids, texts = _grid(layout._repr_html_())
    shape = (8, 3)
    for row_ids, row_texts in zip(ids[0], texts[0]):
        for device, text in zip(row_ids.tolist(), row_texts):
            first, block = text.split("\n")
            assert first == f"{device} p{device // 2}"
            rows = layout.shard_slices(shape, device)[0]
            assert block == f"({rows.start // 2}, 0)", (device, text)


def test_visualize_draws_what_unimesh_show_draws():
    mesh = Mesh((2, 2), ("dp", "tp"), [[3, 2], [1, 0]])
    layout = Layout(mesh, P("dp", "tp"))
    out = io.StringIO()
    unimesh.visualize(layout, (4, 6), console=Console(file=out, width=100))
    text = out.getvalue()
    for device in range(4):
        block = ", ".join(f"{s.start}:{s.stop}" for s in layout.shard_slices((4, 6), device))
        assert f"[{block}]" in text, (device, text)
    plain = io.StringIO()
    unimesh.visualize(mesh, console=Console(file=plain, width=100))
    assert "dp=2, tp=2" in plain.getvalue() or "Mesh(" in plain.getvalue()


def test_visualize_bad_input():
    mesh = Mesh((2, 2), ("dp", "tp"))
    with pytest.raises(LayoutError, match="takes a unimesh Mesh or Layout, got 'dp=2'"):
        unimesh.visualize("dp=2")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="needs a Layout for the shape"):
        unimesh.visualize(mesh, (4, 4))
    with pytest.raises(LayoutError, match="shape must be a tuple of sizes"):
        unimesh.visualize(Layout(mesh, P("dp")), "8,4")
    from unimesh.visual import html

    with pytest.raises(LayoutError, match="html\\(\\) takes a unimesh Mesh, got 'dp=2'"):
        html("dp=2")  # type: ignore[arg-type]
    other = Layout(Mesh((4,), ("x",)), P("x"))
    with pytest.raises(LayoutError, match="needs a unimesh Layout on that mesh, got Layout"):
        html(mesh, other)
