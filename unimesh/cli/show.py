"""``unimesh show``: parsing the command's arguments; the drawing is :mod:`unimesh.visual`."""

from __future__ import annotations

from typing import Any

from ..errors import LayoutError
from ..layout import Layout
from ..mesh import Mesh
from ..messages import short
from ..spec import PartitionSpec
from ..visual import describe, draw, write_json

__all__ = [
    "describe",
    "draw",
    "layout_from_args",
    "parse_shape",
    "parse_spec",
    "reshard_table",
    "write_json",
]


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


def reshard_table(
    source: Layout, target: Layout, shape: tuple[int, ...], itemsize: int, console: Any = None
) -> dict[str, int]:
    """Print what each device keeps, receives and sends when an array of ``shape`` moves from
    ``source`` to ``target`` (one process per device, as torchrun and mpirun run), beside an
    all-gather-and-slice (the route through a replicated array, which DTensor's
    ``redistribute`` takes for many multi-axis moves); return the totals."""
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from ..moves import plan

    ids = sorted(
        set(source.mesh.device_ids.ravel().tolist()) | set(target.mesh.device_ids.ravel().tolist())
    )
    process_of = np.arange(max(ids) + 1)
    table = Table(title=f"reshard {shape}: {source!r} -> {target!r}")
    for name in ("device", "keeps", "receives", "from", "sends", "to", "gather+slice receives"):
        table.add_column(name, justify="right" if name not in ("from", "to") else "left")
    size = int(np.prod(shape)) * itemsize
    totals = {"received": 0, "sent": 0, "gather": 0}
    src_ids = set(source.mesh.device_ids.ravel().tolist())
    for rows, d in enumerate(ids, 1):
        p = plan(source, target, shape, itemsize, process_of, d)
        held = int(np.prod(source.shard_shape(shape, d))) * itemsize if d in src_ids else 0
        kept = sum(x.size for x in p.local) * itemsize
        needs = d in p.blocks
        gather = size - held if needs else 0
        totals["received"] += p.bytes_received
        totals["sent"] += p.bytes_sent
        totals["gather"] += gather
        if rows <= 64:
            table.add_row(
                str(d),
                f"{kept:,}",
                f"{p.bytes_received:,}",
                ", ".join(str(q) for q in sorted(p.receive)) or "-",
                f"{p.bytes_sent:,}",
                ", ".join(str(q) for q in sorted(p.send)) or "-",
                f"{gather:,}",
            )
    table.add_row(
        "all", "", f"{totals['received']:,}", "", f"{totals['sent']:,}", "", f"{totals['gather']:,}"
    )
    (console or Console()).print(table)
    return totals
