"""Pictures of meshes and layouts: the grid of device ids (axis labels, process boundaries) and
the block of a tensor each device holds, drawn with rich in a terminal (:func:`visualize`, the
``unimesh show`` command), as HTML in a notebook (``Mesh._repr_html_``, ``Layout._repr_html_``),
or as JSON (:func:`describe`)."""

from __future__ import annotations

from typing import Any

from .errors import LayoutError
from .layout import Layout
from .mesh import Mesh
from .messages import short

__all__ = ["describe", "draw", "html", "visualize"]

#: colours for process boundaries (cycled)
_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red")


def _process(mesh: Mesh, device: int) -> int | None:
    dpp = mesh.devices_per_process
    return None if dpp is None else device // dpp


def describe(
    mesh: Mesh, layout: Layout | None = None, shape: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """The JSON form: the mesh (its dict form), each device's coordinate and process, and with a
    layout and a shape, each device's block as ``[start, stop]`` pairs."""
    if layout is not None and shape is None:
        raise LayoutError("a layout needs the tensor's shape too (--shape 8,4)")
    devices = []
    for device in mesh.device_ids.ravel().tolist():
        entry: dict[str, Any] = {
            "id": device,
            "coords": mesh.coords(device),
            "process": _process(mesh, device),
        }
        if layout is not None and shape is not None:
            entry["block"] = [[s.start, s.stop] for s in layout.shard_slices(shape, device)]
        devices.append(entry)
    out: dict[str, Any] = {"mesh": mesh.to_dict(), "devices": devices}
    if layout is not None:
        out["spec"] = repr(layout.spec)
        out["shape"] = list(shape or ())
    return out


def _cell(mesh: Mesh, device: int, layout: Layout | None, shape: tuple[int, ...] | None) -> str:
    proc = _process(mesh, device)
    text = f"[bold]{device}[/bold]"
    if proc is not None:
        text = f"[{_COLOURS[proc % len(_COLOURS)]}]{text} p{proc}[/]"
    if layout is not None and shape is not None:
        block = ", ".join(f"{s.start}:{s.stop}" for s in layout.shard_slices(shape, device))
        text += f"\n[{block}]"
    return text


def _grids(mesh: Mesh) -> list[tuple[str, str, list[str], list[str], Any]]:
    """The mesh as 2-D grids of device ids, one per index of its leading axes, each as (title,
    corner heading, column headings, row headings, ids): what the terminal and HTML drawings
    both show."""
    names = mesh.axis_names
    ids = mesh.device_ids if mesh.ndim > 1 else mesh.device_ids.reshape(1, -1)
    row_name, col_name = (names[-2], names[-1]) if mesh.ndim > 1 else ("", names[0])
    corner = f"{row_name} \\ {col_name}" if row_name else ""
    grids = []
    for index in _product(ids.shape[:-2]):  # one empty index for a 1-D or 2-D mesh
        grid = ids[index]
        title = ", ".join(f"{n}={i}" for n, i in zip(names, index))
        cols = [f"{col_name}={c}" for c in range(grid.shape[1])]
        rows = [f"{row_name}={r}" if row_name else "" for r in range(grid.shape[0])]
        grids.append((title, corner, cols, rows, grid))
    return grids


def _tables(mesh: Mesh, layout: Layout | None, shape: tuple[int, ...] | None) -> list[Any]:
    from rich.table import Table

    tables = []
    for title, corner, cols, rows, grid in _grids(mesh):
        table = Table(title=title or None, show_lines=True)
        table.add_column(corner, justify="right")
        for col in cols:
            table.add_column(col, justify="center")
        for label, ids in zip(rows, grid.tolist()):
            table.add_row(label, *(_cell(mesh, d, layout, shape) for d in ids))
        tables.append(table)
    return tables


def _product(dims: tuple[int, ...]) -> Any:
    import itertools

    return itertools.product(*(range(n) for n in dims))


def _tensor_table(layout: Layout, shape: tuple[int, ...]) -> Any:
    """The tensor's blocks (first two dims) and the devices that hold each, like JAX's
    ``visualize_array_sharding``."""
    from rich.table import Table

    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for device in layout.mesh.device_ids.ravel().tolist():
        key = tuple((s.start, s.stop) for s in layout.shard_slices(shape, device)[:2])
        holders.setdefault(key, []).append(device)
    rows = sorted({k[0] for k in holders}) if shape else [(0, 0)]
    cols = sorted({k[1] for k in holders}) if len(shape) > 1 else [None]
    table = Table(title=f"tensor {shape} as {layout.spec!r}", show_lines=True)
    table.add_column("rows", justify="right")
    for c in cols:
        table.add_column("" if c is None else f"cols {c[0]}:{c[1]}", justify="center")
    for r in rows:
        cells = []
        for c in cols:
            key = (r,) if c is None else (r, c)
            devices = holders.get(key if shape else (), [])
            cells.append(" ".join(map(str, sorted(devices))) or "-")
        table.add_row(f"{r[0]}:{r[1]}" if shape else "", *cells)
    return table


def draw(
    mesh: Mesh,
    layout: Layout | None = None,
    shape: tuple[int, ...] | None = None,
    console: Any = None,
) -> None:
    """Print the mesh grid(s), and with a layout the tensor's blocks, with rich."""
    from rich.console import Console

    if layout is not None and shape is None:
        raise LayoutError("a layout needs the tensor's shape too (--shape 8,4)")
    console = console or Console()
    console.print(
        f"[bold]{mesh!r}[/bold]  ({mesh.size} devices"
        + (f", {mesh.devices_per_process} per process" if mesh.devices_per_process else "")
        + ")"
    )
    for table in _tables(mesh, layout, shape):
        console.print(table)
    if layout is not None and shape is not None:
        if len(shape) > 2:
            console.print(f"(the tensor view shows dims 0 and 1 of {len(shape)})")
        console.print(_tensor_table(layout, shape))


def visualize(obj: Mesh | Layout, shape: Any = None, *, console: Any = None) -> None:
    """Draw a mesh, or a layout's blocks of a tensor of ``shape``, in the terminal (what
    ``unimesh show`` prints; a layout without a shape draws its mesh). ``console``: a rich
    ``Console`` (default: a new one on stdout)."""
    if isinstance(obj, Layout):
        dims = None if shape is None else _shape(shape)
        draw(obj.mesh, obj if dims is not None else None, dims, console)
    elif isinstance(obj, Mesh):
        if shape is not None:
            raise LayoutError("visualize(mesh, shape) needs a Layout for the shape to be cut by")
        draw(obj, None, None, console)
    else:
        raise LayoutError(f"visualize() takes a unimesh Mesh or Layout, got {short(obj)}")


def _shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise LayoutError(f"shape must be a tuple of sizes >= 0, like (8, 4); got {short(shape)}")
    return tuple(shape)


def html(mesh: Mesh, layout: Layout | None = None) -> str:
    """The mesh as HTML tables (one per index of the leading axes), a cell per device with its
    id and process; with a layout, each cell also gives the device's block index along each
    tensor dim (``(i, j)``: the i-th block of dim 0, the j-th of dim 1)."""
    from html import escape  # here, not at import: html.entities is a large table

    if not isinstance(mesh, Mesh):
        raise LayoutError(f"html() takes a unimesh Mesh, got {short(mesh)}")
    if layout is not None and (not isinstance(layout, Layout) or layout.mesh != mesh):
        raise LayoutError(
            f"html(mesh, layout) needs a unimesh Layout on that mesh, got {short(layout)}"
        )
    counts = layout.shard_counts() if layout is not None else ()
    style = "border-collapse:collapse;font-family:monospace;margin:4px 0"
    cell = "border:1px solid #999;padding:2px 8px;text-align:center"
    title = escape(repr(mesh) if layout is None else f"{layout!r}")
    parts = [f'<div class="unimesh"><div><b>{title}</b></div>']
    for caption, corner, cols, rows, grid in _grids(mesh):
        parts.append(f'<table style="{style}">')
        if caption:
            parts.append(f"<caption>{escape(caption)}</caption>")
        heads = [corner, *cols]
        parts.append("<tr>" + "".join(f'<th style="{cell}">{escape(h)}</th>' for h in heads))
        parts.append("</tr>")
        for label, ids in zip(rows, grid.tolist()):
            parts.append(f'<tr><th style="{cell}">{escape(label)}</th>')
            for d in ids:
                proc = _process(mesh, d)
                text = f"{d}" + ("" if proc is None else f" p{proc}")
                if layout is not None:
                    block = tuple(s.start for s in layout.shard_slices(counts, d))
                    text += f"<br>{block}"
                parts.append(f'<td style="{cell}" data-device="{d}">{text}</td>')
            parts.append("</tr>")
        parts.append("</table>")
    parts.append("</div>")
    return "".join(parts)
