"""Pictures of meshes and layouts: the grid of device ids (axis labels, process boundaries) and
the block of a tensor each device holds, drawn with rich in a terminal (:func:`visualize`, the
``unimesh show`` command), as HTML in a notebook (``Mesh._repr_html_``, ``Layout._repr_html_``),
or as JSON (:func:`describe`)."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from .errors import LayoutError, UnimeshError
from .layout import Layout
from .mesh import Mesh
from .messages import short

__all__ = ["EDGE", "THRESHOLD", "describe", "draw", "html", "visualize", "write_json"]

#: colours for process boundaries (cycled)
_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red")


#: Above this many devices a drawing is a summary (numpy's print threshold is also 1000).
THRESHOLD = 1000
#: Rows and columns kept at each end of an axis in a summary (numpy's ``edgeitems``).
EDGE = 3


def _process(mesh: Mesh, device: int) -> int | None:
    dpp = mesh.devices_per_process
    return None if dpp is None else device // dpp


def _description(
    mesh: Mesh, layout: Layout | None, shape: tuple[int, ...] | None
) -> dict[str, Any]:
    """:func:`describe` with the per-device facts as numpy arrays of the mesh's shape."""

    if layout is not None and shape is None:
        raise LayoutError("a layout needs the tensor's shape too (--shape 8,4)")
    ids = mesh.device_ids
    dpp = mesh.devices_per_process
    as_dict = mesh.to_dict() if mesh.is_default_order else {**_no_ids(mesh), "device_ids": ids}
    out: dict[str, Any] = {
        "mesh": as_dict,
        "size": mesh.size,
        "device_ids": ids,
        "process": None if dpp is None else ids // dpp,
    }
    if layout is not None and shape is not None:
        out["spec"] = repr(layout.spec)
        out["shape"] = list(shape)
        out["blocks"] = _Blocks(layout, shape)
    return out


class _Blocks:
    """Every device's ``[start, stop]`` per tensor dim, an array of shape ``mesh.shape +
    (ndim, 2)`` computed one slice of the mesh's first axis at a time when iterated (so that
    :func:`write_json` never holds it whole)."""

    def __init__(self, layout: Layout, shape: tuple[int, ...]) -> None:
        self.layout, self.shape, self.ndim = layout, shape, layout.mesh.ndim + 2

    def __iter__(self) -> Any:
        import numpy as np

        mesh = self.layout.mesh
        for row in mesh.device_ids:
            lo, hi = self.layout.shard_bounds(self.shape, np.ravel(row))
            yield np.stack([lo, hi], axis=-1).reshape(*np.shape(row), len(self.shape), 2)

    def tolist(self) -> list[Any]:
        return [part.tolist() for part in self]


def _no_ids(mesh: Mesh) -> dict[str, Any]:
    """The mesh's dict form without the ids (they are written as an array, in a stream)."""
    copy = Mesh(mesh.shape, mesh.axis_names, axis_types=mesh.axis_types)
    out = copy.to_dict()
    if mesh.devices_per_process is not None:
        out["devices_per_process"] = mesh.devices_per_process
    return out


def describe(
    mesh: Mesh, layout: Layout | None = None, shape: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """The JSON form, array-shaped like the mesh: ``mesh`` (its dict form), ``size``,
    ``device_ids`` (nested lists of the mesh's shape: a device's coordinates are its index),
    ``process`` (the same shape; None without ``devices_per_process``), and with a layout and a
    shape, ``spec``, ``shape`` and ``blocks``: for each device, ``[start, stop]`` per tensor dim
    (``blocks[i][j]`` is the block of the device at ``device_ids[i][j]``)."""
    return {k: _plain(v) for k, v in _description(mesh, layout, shape).items()}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value.tolist() if hasattr(value, "tolist") else value


def write_json(
    write: Any, mesh: Mesh, layout: Layout | None = None, shape: tuple[int, ...] | None = None
) -> None:
    """:func:`describe`'s JSON, written piece by piece through ``write`` (one slice of the
    mesh's first axis at a time), so memory stays bounded by a slice at any mesh size."""
    _write_value(write, _description(mesh, layout, shape))
    write("\n")


def _write_value(write: Any, value: Any) -> None:
    import json

    if isinstance(value, dict):
        write("{")
        for i, (key, item) in enumerate(value.items()):
            write(("," if i else "") + json.dumps(key) + ":")
            _write_value(write, item)
        write("}")
    elif isinstance(value, _Blocks) or (hasattr(value, "tolist") and value.ndim > 1):
        write("[")
        for j, part in enumerate(value):
            write(("," if j else "") + json.dumps(part.tolist(), separators=(",", ":")))
        write("]")
    else:
        write(json.dumps(_plain(value), separators=(",", ":")))


def _pick(n: int, edge: int | None) -> list[int | None]:
    """Indices 0..n-1, or with ``edge``, the first and last ``edge`` with None between."""
    if edge is None or n <= 2 * edge + 1:
        return list(range(n))
    return [*range(edge), None, *range(n - edge, n)]


def _grids(
    mesh: Mesh,
    edge: int | None = None,
    panels: int | None = None,
    col_edge: int | None = None,
) -> list[tuple[str, str, list[str], list[str], list[list[int | None]]]]:
    """The mesh as 2-D grids of device ids, one per index of its leading axes, each as (title,
    corner heading, column headings, row headings, ids): what the terminal and HTML drawings
    both show. ``edge``: keep that many rows and columns at each end (None marks the gap);
    ``panels``: keep only the first and last ``panels`` grids; ``col_edge``: columns kept at
    each end when fewer than ``edge`` fit."""
    import numpy as np

    names = mesh.axis_names
    ids = mesh.device_ids if mesh.ndim > 1 else mesh.device_ids.reshape(1, -1)
    row_name, col_name = (names[-2], names[-1]) if mesh.ndim > 1 else ("", names[0])
    corner = f"{row_name} \\ {col_name}" if row_name else ""
    rows_at = _pick(ids.shape[-2], edge)
    cols_at = _pick(ids.shape[-1], edge if col_edge is None else col_edge)
    cols = [f"{col_name}={c}" if c is not None else "\u2026" for c in cols_at]
    rows = [(f"{row_name}={r}" if row_name else "") if r is not None else "\u2026" for r in rows_at]
    lead = ids.shape[:-2]
    count = math.prod(lead)
    chosen = range(count)
    if panels is not None and count > 2 * panels:
        chosen = [*range(panels), *range(count - panels, count)]  # type: ignore[assignment]
    grids = []
    for flat in chosen:
        index = tuple(int(i) for i in np.unravel_index(flat, lead))
        grid = ids[index]
        title = ", ".join(f"{n}={i}" for n, i in zip(names, index))
        cells = [
            [None if r is None or c is None else int(grid[r, c]) for c in cols_at] for r in rows_at
        ]
        grids.append((title, corner, cols, rows, cells))
    return grids


def _cell(mesh: Mesh, device: int | None, layout: Layout | None, shape: Any) -> str:
    if device is None:
        return "\u2026"
    proc = _process(mesh, device)
    text = f"[bold]{device}[/bold]"
    if proc is not None:
        text = f"[{_COLOURS[proc % len(_COLOURS)]}]{text} p{proc}[/]"
    if layout is not None and shape is not None:
        block = ", ".join(f"{s.start}:{s.stop}" for s in layout.shard_slices(shape, device))
        text += f"\n[{block}]"
    return text


def _cell_width(mesh: Mesh, layout: Layout | None, shape: tuple[int, ...] | None) -> int:
    """The widest cell text a grid of this mesh can have (ids, process marks, blocks)."""
    width = len(str(int(mesh.device_ids.max())))
    if mesh.devices_per_process is not None:
        width += 2 + len(str(int(mesh.device_ids.max()) // mesh.devices_per_process))
    if layout is not None and shape is not None:
        width = max(width, 2 + sum(2 * len(str(n)) + 3 for n in shape))
    return width


def _fit(mesh: Mesh, width: int, cell: int, edge: int | None) -> int | None:
    """The ``edge`` that makes one grid fit ``width`` columns (never cutting a cell)."""
    cols = mesh.shape[-1]
    rows = mesh.shape[-2] if mesh.ndim > 1 else 1
    label = 4 + len(" \\ ".join(mesh.axis_names[-2:])) + len(str(rows))
    per = max(cell, len(mesh.axis_names[-1]) + 1 + len(str(cols - 1))) + 3
    return _fit_columns(cols, per, label, width, edge)


def _fit_columns(count: int, per: int, label: int, width: int, edge: int | None) -> int | None:
    """The ``edge`` (columns kept at each end) that fits ``count`` columns of ``per``
    characters beside a ``label``-wide heading into ``width``; ``edge`` when all it keeps fit."""
    room = max(3, (width - label) // per)
    shown = count if edge is None else min(count, 2 * edge + 1)
    if shown <= room:
        return edge
    return max(1, (room - 1) // 2)


def _tables(
    mesh: Mesh,
    layout: Layout | None,
    shape: tuple[int, ...] | None,
    edge: int | None = None,
    panels: int | None = None,
    col_edge: int | None = None,
) -> list[Any]:
    from rich.table import Table

    tables = []
    for title, corner, cols, rows, grid in _grids(mesh, edge, panels, col_edge):
        table = Table(title=title or None, show_lines=True)
        table.add_column(corner, justify="right", no_wrap=True)
        for col in cols:
            table.add_column(col, justify="center", no_wrap=True)
        for label, ids in zip(rows, grid):
            table.add_row(label, *(_cell(mesh, d, layout, shape) for d in ids))
        tables.append(table)
    return tables


def _tensor_table(
    layout: Layout, shape: tuple[int, ...], edge: int | None = None, width: int | None = None
) -> Any:
    """The tensor's blocks (first two dims) and the devices that hold each, like JAX's
    ``visualize_array_sharding``; with ``edge``, the first and last blocks of each dim and at
    most ``2 * edge`` device ids per block; with ``width``, as many columns as fit."""
    import numpy as np
    from rich.table import Table

    from .spec import entry_axes

    mesh = layout.mesh
    keep = min(len(shape), 2)
    # a device's block along dim d is fixed by its coordinates along the axes of spec entry d
    # (block k: those coordinates as the digits of k, the first axis major); the devices of
    # a cell are a slice of the id grid, so nothing is computed for all devices at once
    entries = [entry_axes(layout.spec[d]) if d < len(layout.spec) else () for d in range(keep)]
    counts = [math.prod(mesh.axis_size(a) for a in axes) for axes in entries]
    nrows = counts[0] if keep else 1
    ncols = counts[1] if keep > 1 else 1

    def holders(r: int, c: int) -> Any:
        index: list[Any] = [slice(None)] * mesh.ndim
        for axes, k in zip(entries, (r, c)):
            for a in reversed(axes):
                k, index[mesh.axis_names.index(a)] = divmod(k, mesh.axis_size(a))
        return np.sort(mesh.device_ids[tuple(index)].ravel())

    def bounds(d: int, k: int) -> tuple[int, int]:
        device = int(holders(k, 0)[0] if d == 0 else holders(0, k)[0])
        block = layout.shard_slices(shape, device)[d]
        return block.start, block.stop

    rows_at = _pick(nrows, edge)
    col_edge = edge
    if width is not None and ncols > 1:
        per = 2 * len(str(shape[1])) + 4  # the widest heading, "start:stop"
        per = max(per, min(len(_id_list(holders(0, 0), edge)), 24) + 3)
        col_edge = _fit_columns(ncols, per, 14, width, edge)
    cols_at = _pick(ncols, col_edge)
    table = Table(show_lines=True)
    table.add_column("rows \\ cols" if keep > 1 else "rows", justify="right", no_wrap=True)
    for c in cols_at:
        head = "\u2026" if c is None else "{}:{}".format(*bounds(1, c)) if keep > 1 else ""
        table.add_column(head, justify="center")
    for r in rows_at:
        if r is None:
            table.add_row("\u2026", *("\u2026" for _ in cols_at))
            continue
        cells = ["\u2026" if c is None else _id_list(holders(r, c), edge) for c in cols_at]
        label = "{}:{}".format(*bounds(0, r)) if keep else ""
        table.add_row(label, *cells)
    return table


def _id_list(devices: Any, edge: int | None) -> str:
    if not len(devices):
        return "-"
    if edge is not None and len(devices) > 4 * edge:
        head = " ".join(map(str, devices[: 2 * edge].tolist()))
        return f"{head} \u2026 {int(devices[-1])} ({len(devices)} devices)"
    return " ".join(map(str, devices.tolist()))


def draw(
    mesh: Mesh,
    layout: Layout | None = None,
    shape: tuple[int, ...] | None = None,
    console: Any = None,
    *,
    full: bool = False,
) -> None:
    """Print the mesh grid(s), and with a layout the tensor's blocks, with rich.

    A mesh of more than :data:`THRESHOLD` devices is summarised (like numpy's print): its
    axes, its processes, the first and last grid, and the first and last :data:`EDGE` rows and
    columns of each; a grid wider than the terminal keeps as many columns as fit, never cutting
    an id. ``full=True`` draws every device whatever the size."""
    from rich.console import Console

    if layout is not None and shape is None:
        raise LayoutError("a layout needs the tensor's shape too (--shape 8,4)")
    console = console or Console()
    summary = not full and mesh.size > THRESHOLD
    edge = EDGE if summary else None
    col_edge = edge
    if not full:
        col_edge = _fit(mesh, console.width, _cell_width(mesh, layout, shape), edge)
    dpp = mesh.devices_per_process
    if summary:
        axes = ", ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.shape))
        order = "default order" if mesh.is_default_order else "permuted ids"
        head = f"[bold]Mesh({axes})[/bold]  {mesh.size:,} devices, {order}"
        if dpp:
            head += f", {dpp:,} per process on {mesh.num_processes:,} processes"
    else:
        head = f"[bold]{_escape(repr(mesh))}[/bold]  ({mesh.size} devices"
        head += (f", {dpp} per process" if dpp else "") + ")"
    console.print(head)
    if summary and dpp:
        console.print(_process_blocks(mesh))
    panels = 1 if summary else None
    for table in _tables(mesh, layout, shape, edge, panels, col_edge):
        console.print(table)
    lead = mesh.size // (mesh.shape[-1] * (mesh.shape[-2] if mesh.ndim > 1 else 1))
    if col_edge is not None or (panels and lead > 2):
        shown = "the first and last grid of " + f"{lead:,}" if panels and lead > 2 else "every grid"
        console.print(
            f"[dim]\u2026 marks rows and columns left out; shown: {shown}. "
            "`unimesh show --full` (visualize(..., full=True)) draws every device.[/dim]"
        )
    if layout is not None and shape is not None:
        if len(shape) > 2:
            console.print(f"(the tensor view shows dims 0 and 1 of {len(shape)})")
        width = None if full else console.width
        console.print(f"[bold]tensor {shape}[/bold] as {_escape(repr(layout.spec))}")
        console.print(_tensor_table(layout, shape, EDGE if summary else None, width))
        note = uneven_note(layout, shape)
        if note:
            console.print(f"[yellow]uneven:[/yellow] {_escape(note)}")


def uneven_note(layout: Layout, shape: tuple[int, ...]) -> str | None:
    """None when ``shape`` divides evenly under ``layout``; else which dims do not, the rule
    the blocks follow, and which installed backends refuse such a layout (those that do not
    declare ``uneven_shards``)."""
    if layout.is_even(shape):
        return None
    from .registry import backends, load_backend

    dims = [
        f"dim {d} ({shape[d]}) does not cut into {n}"
        for d, n in enumerate(layout.shard_counts())
        if d < len(shape) and shape[d] % n
    ]
    take: list[str] = []
    refuse: list[str] = []
    for name in backends():
        with contextlib.suppress(UnimeshError):  # a broken plugin: `unimesh backends` names it
            features = load_backend(name).features
            (take if "uneven_shards" in features else refuse).append(name)
    text = (
        f"{' and '.join(dims)} blocks without remainder; the last blocks are smaller "
        "(torch.chunk's rule)."
    )
    if refuse:
        text += f" {', '.join(refuse)} refuse this layout"
        text += f"; {', '.join(take)} take it." if take else "."
    return text


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _process_blocks(mesh: Mesh) -> str:
    """One line on where process 0's devices sit: the block of the mesh they form."""
    from .errors import MeshSpecError

    try:
        block = mesh.local_mesh(0)
    except MeshSpecError:
        return "process 0's devices do not form a block of the mesh"
    dims = ", ".join(f"{n}={s}" for n, s in zip(block.axis_names, block.shape))
    return f"process 0 holds the block {dims} (devices {_id_list(block.device_ids.ravel(), EDGE)})"


def visualize(
    obj: Mesh | Layout, shape: Any = None, *, console: Any = None, full: bool = False
) -> None:
    """Draw a mesh, or a layout's blocks of a tensor of ``shape``, in the terminal (what
    ``unimesh show`` prints; a layout without a shape draws its mesh). ``console``: a rich
    ``Console`` (default: a new one on stdout); ``full``: every device even when the mesh is
    large or the terminal narrow (:func:`draw`)."""
    if isinstance(obj, Layout):
        dims = None if shape is None else _shape(shape)
        draw(obj.mesh, obj if dims is not None else None, dims, console, full=full)
    elif isinstance(obj, Mesh):
        if shape is not None:
            raise LayoutError("visualize(mesh, shape) needs a Layout for the shape to be cut by")
        draw(obj, None, None, console, full=full)
    else:
        raise LayoutError(f"visualize() takes a unimesh Mesh or Layout, got {short(obj)}")


def _shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise LayoutError(f"shape must be a tuple of sizes >= 0, like (8, 4); got {short(shape)}")
    return tuple(shape)


#: Cell colours of :func:`html`: one per tensor block (with a layout) or per process, cycled;
#: light enough for black text.
PALETTE = (
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
    "#f7b6d2", "#dbdb8d", "#9edae5", "#d9d9d9", "#fdd0a2", "#c7e9c0",
)  # fmt: skip


def html(mesh: Mesh, layout: Layout | None = None, *, full: bool = False) -> str:
    """The mesh as HTML tables (one per index of the leading axes), a cell per device with its
    id and process; with a layout, each cell also gives the device's block index along each
    tensor dim (``(i, j)``: the i-th block of dim 0, the j-th of dim 1), and cells share a
    colour when they hold the same block (or, without a layout, sit in the same process). Above
    :data:`THRESHOLD` devices, the first and last grid and :data:`EDGE` rows and columns at each
    end, unless ``full``."""
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
    summary = not full and mesh.size > THRESHOLD
    for caption, corner, cols, rows, grid in _grids(
        mesh, EDGE if summary else None, 1 if summary else None
    ):
        parts.append(f'<table style="{style}">')
        if caption:
            parts.append(f"<caption>{escape(caption)}</caption>")
        heads = [corner, *cols]
        parts.append("<tr>" + "".join(f'<th style="{cell}">{escape(h)}</th>' for h in heads))
        parts.append("</tr>")
        for label, ids in zip(rows, grid):
            parts.append(f'<tr><th style="{cell}">{escape(label)}</th>')
            for d in ids:
                if d is None:
                    parts.append(f'<td style="{cell}">\u2026</td>')
                    continue
                proc = _process(mesh, d)
                text = f"{d}" + ("" if proc is None else f" p{proc}")
                key = proc
                if layout is not None:
                    block = tuple(s.start for s in layout.shard_slices(counts, d))
                    text += f"<br>{block}"
                    key = sum(b * math.prod(counts[i + 1 :]) for i, b in enumerate(block))
                fill = "" if key is None else f";background:{PALETTE[key % len(PALETTE)]}"
                parts.append(
                    f'<td style="{cell}{fill}" data-device="{d}" data-key="{key}">{text}</td>'
                )
            parts.append("</tr>")
        parts.append("</table>")
    parts.append("</div>")
    return "".join(parts)
