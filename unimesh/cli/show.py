"""``unimesh show``: parsing the command's arguments; the drawing is :mod:`unimesh.visual`."""

from __future__ import annotations

from ..errors import LayoutError
from ..layout import Layout
from ..mesh import Mesh
from ..messages import short
from ..spec import PartitionSpec
from ..visual import describe, draw, write_json

__all__ = ["describe", "draw", "layout_from_args", "parse_shape", "parse_spec", "write_json"]


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
