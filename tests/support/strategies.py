"""Hypothesis strategies for meshes and specs."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from unimesh import Mesh, P

NAMES = ["dp", "tp", "pp", "cp", "ep", "fsdp", "x", "y_1"]


@st.composite
def meshes(
    draw, max_ndim: int = 6, max_size: int = 256, permute: bool = True, allow_gaps: bool = True
) -> Mesh:
    ndim = draw(st.integers(1, max_ndim))
    shape: list[int] = []
    for _ in range(ndim):
        room = max_size // max(1, math.prod(shape))
        shape.append(draw(st.integers(1, max(1, min(4, room)))))
    names = draw(st.permutations(NAMES))[:ndim]
    size = math.prod(shape)
    ids = None
    kind = draw(st.sampled_from(["default", "perm", "gaps"] if allow_gaps else ["default", "perm"]))
    if permute and kind == "perm":
        ids = np.array(draw(st.permutations(range(size)))).reshape(shape)
    elif permute and kind == "gaps":
        pool = draw(st.permutations(range(2 * size)))
        ids = np.array(pool[:size]).reshape(shape)
    types = None
    if draw(st.booleans()):
        types = tuple(draw(st.sampled_from(["auto", "explicit", "manual"])) for _ in range(ndim))
    dpp = draw(st.sampled_from([None, 1, 2, 4]))
    return Mesh(tuple(shape), tuple(names), ids, axis_types=types, devices_per_process=dpp)


@st.composite
def axes_of(draw, mesh: Mesh, min_size: int = 1) -> tuple[str, ...]:
    k = draw(st.integers(min_size, mesh.ndim))
    return tuple(draw(st.permutations(mesh.axis_names))[:k])


@st.composite
def specs(draw, mesh: Mesh, max_dims: int = 3, partial: bool = True) -> P:
    ndim = draw(st.integers(0, max_dims))
    pool = list(draw(st.permutations(mesh.axis_names)))
    entries = []
    for _ in range(ndim):
        k = draw(st.integers(0, min(3, len(pool))))
        take, pool = pool[:k], pool[k:]
        entries.append(None if not take else take[0] if len(take) == 1 else tuple(take))
    pend = None
    if partial and pool and draw(st.booleans()):
        pend = {pool[0]: draw(st.sampled_from(["sum", "avg", "max", "min"]))}
    return P(*entries, partial=pend)
