"""Small argument checks shared by the core modules (internal)."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable
from typing import NoReturn

from .errors import MeshSpecError
from .messages import short

#: Largest mesh unimesh builds: 2**26 devices (64x the biggest machines in use). Larger sizes are
#: rejected before any array is allocated.
MAX_DEVICES = 1 << 26
MAX_AXES = 64  # numpy's limit on array dimensions
_MOST_ENTRIES = 1 << 20  # longest per-axis sequence read before the axis-count check

AXIS_TYPES = ("auto", "explicit", "manual")

#: The longest axis name: far above any in use, short enough to print in every message.
MAX_NAME = 256


def fail(message: str, cls: type[Exception] = MeshSpecError) -> NoReturn:
    raise cls(message)


def check_int(
    value: object,
    what: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    cls: type[Exception] = MeshSpecError,
) -> int:
    """Return ``value`` as an int, refusing bools, floats and strings."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(f"{what} must be an int, got {short(value)} ({type(value).__name__})", cls)
    out = int(value)
    if minimum is not None and out < minimum:
        fail(f"{what} must be >= {minimum}, got {short(out)}", cls)
    if maximum is not None and out > maximum:
        fail(f"{what} must be <= {maximum}, got {short(out)}", cls)
    return out


def check_axis_name(
    name: object, what: str = "axis name", cls: type[Exception] = MeshSpecError
) -> str:
    """An axis name is any non-empty str of printable characters up to :data:`MAX_NAME` long:
    every name torch, JAX, Keras and TF DTensor take (``dp``, ``mesh-0``, ``data parallel``).
    The text forms quote a name that is not a plain word (``"mesh 0"=2``), so every serial
    form reads back exactly."""
    if not isinstance(name, str):
        fail(f"{what} must be a str, got {short(name)} ({type(name).__name__})", cls)
    if not name:
        fail(f"{what} must not be empty; name the axis, e.g. 'dp'", cls)
    if len(name) > MAX_NAME:
        fail(f"{what} {short(name)} is {len(name)} characters long; the limit is {MAX_NAME}", cls)
    if not name.isprintable():
        bad = next(c for c in name if not c.isprintable())
        fail(
            f"{what} {name!r} holds the unprintable character {bad!r}; an axis name is printable "
            "text (letters, digits, punctuation and spaces)",
            cls,
        )
    return name


def as_tuple(value: object, what: str, cls: type[Exception] = MeshSpecError) -> tuple[object, ...]:
    """A list/tuple argument as a tuple; a str or a non-iterable is an error."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        fail(f"{what} must be a tuple or list, got {short(value)} ({type(value).__name__})", cls)
    try:
        count = len(value)  # type: ignore[arg-type]
    except OverflowError:  # a range longer than sys.maxsize
        count = _MOST_ENTRIES + 1
    except TypeError:  # a generator, or a 0-d numpy array
        count = -1
    try:
        items = tuple(itertools.islice(value, _MOST_ENTRIES + 1)) if count <= _MOST_ENTRIES else ()
    except TypeError:  # iterable by type but not by value: a 0-d numpy array
        fail(f"{what} must be a tuple or list, got {short(value)} ({type(value).__name__})", cls)
    if count > _MOST_ENTRIES or len(items) > _MOST_ENTRIES:
        fail(
            f"{what} has more than {_MOST_ENTRIES} entries ({short(value)}); a mesh has at most "
            f"{MAX_AXES} axes",
            cls,
        )
    return items


def check_ndim(ndim: int) -> None:
    """Refuse a mesh of more axes than numpy arrays have dimensions."""
    if ndim > MAX_AXES:
        fail(
            f"a mesh of {ndim} axes is more than unimesh supports ({MAX_AXES}, numpy's limit on "
            "array dimensions); flatten axes together or drop size-1 axes"
        )


def check_size(shape: tuple[int, ...], what: str = "mesh") -> int:
    """The device count of ``shape``, refused above 2**26 before anything is allocated (and
    before a product of thousands of digits is ever written out)."""
    if sum(int(n).bit_length() - 1 for n in shape) > 200:  # each n >= 2**(bit_length - 1)
        fail(
            f"{what} of shape {short(shape)} has more than 10**60 devices, more than unimesh "
            f"supports ({MAX_DEVICES} = 2**26); use smaller axis sizes"
        )
    size = math.prod(shape)
    if size > MAX_DEVICES:
        fail(
            f"{what} of shape {short(shape)} has {size} devices, more than unimesh supports "
            f"({MAX_DEVICES} = 2**26); use smaller axis sizes"
        )
    return size


def check_axis_type(value: object, what: str) -> str:
    if isinstance(value, str) and value.lower() in AXIS_TYPES:
        return value.lower()
    fail(f"{what} must be one of {', '.join(map(repr, AXIS_TYPES))}, got {short(value)}")
