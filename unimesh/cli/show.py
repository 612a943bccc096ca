"""``unimesh show``: a mesh as a grid of device ids (axis labels, process boundaries) and, with a
layout, the block of the tensor each device holds, drawn with rich or given as JSON."""

from __future__ import annotations

from typing import Any

from ..errors import LayoutError
from ..layout import Layout
from ..mesh import Mesh
from ..messages import short
from ..spec import PartitionSpec

__all__ = ["describe", "draw", "layout_from_args", "parse_shape", "parse_spec"]

#: colours for process boundaries (cycled)
_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red")


def parse_spec(text: str) -> PartitionSpec:
    """A spec from the command line (:meth:`unimesh.PartitionSpec.from_string`)."""
    return PartitionSpec.from_string(text)


def parse_shape(text: str) -> tuple[int, ...]:
    """``8,4`` -> (8, 4)."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise LayoutError(
            f"--shape must be sizes separated by commas, like 8,4; got {short(text)}"
        ) from None
    if any(n < 0 for n in shape):
        raise LayoutError(f"--shape sizes must be >= 0, got {short(text)}")
    return shape


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


def _tables(mesh: Mesh, layout: Layout | None, shape: tuple[int, ...] | None) -> list[Any]:
    from rich.table import Table

    ids = mesh.device_ids
    names = mesh.axis_names
    if mesh.ndim == 1:
        ids = ids.reshape(1, -1)
        row_name, col_name = None, names[0]
    else:
        row_name, col_name = names[-2], names[-1]
    lead = ids.shape[:-2] if ids.ndim > 2 else ()
    tables = []
    for index in list(_product(lead)) if lead else [()]:
        grid = ids[index] if index else ids
        title = ", ".join(f"{n}={i}" for n, i in zip(names, index)) or None
        table = Table(title=title, show_lines=True)
        table.add_column(f"{row_name} \\ {col_name}" if row_name else "", justify="right")
        for c in range(grid.shape[1]):
            table.add_column(f"{col_name}={c}", justify="center")
        for r in range(grid.shape[0]):
            label = f"{row_name}={r}" if row_name else ""
            table.add_row(label, *(_cell(mesh, int(d), layout, shape) for d in grid[r]))
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


def layout_from_args(
    mesh: Mesh, spec: str | None, shape: str | None
) -> tuple[Layout | None, tuple[int, ...] | None]:
    """The layout and shape from ``--layout`` / ``--shape`` (both or neither)."""
    if spec is None and shape is None:
        return None, None
    if spec is None:
        raise LayoutError("--shape needs --layout (a spec like dp,None)")
    layout = Layout(mesh, parse_spec(spec))
    if shape is None:
        raise LayoutError("--layout needs --shape (the tensor's sizes, like 8,4)")
    dims = parse_shape(shape)
    if len(dims) < len(layout.spec):
        raise LayoutError(
            f"--shape {shape} has {len(dims)} dims, but the layout "
            f"{layout.spec!r} names {len(layout.spec)}"
        )
    return layout, dims
