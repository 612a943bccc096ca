"""The core's reference blocks and placements rule, checked against torch DTensor's own
local-shape computation (no process group needed). Runs where torch is installed (CI installs
it)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from unimesh import Layout, Mesh, Shard, StridedShard

from .support.strategies import meshes, specs

torch_utils = pytest.importorskip("torch.distributed.tensor._utils")
placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
local_shape_and_offset = getattr(torch_utils, "_compute_local_shape_and_global_offset", None)
if local_shape_and_offset is None:  # pragma: no cover - private API moved in another torch
    pytest.skip("this torch has no _compute_local_shape_and_global_offset", allow_module_level=True)


def to_torch(p: object) -> object:
    if isinstance(p, StridedShard):
        return placement_types._StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return placement_types.Shard(p.dim)
    return placement_types.Replicate()  # Partial holds full-shape data, as Replicate does


@given(st.data())
def test_blocks_match_dtensor(data: st.DataObject) -> None:
    mesh = data.draw(meshes(max_ndim=4, max_size=48, permute=False))
    spec = data.draw(specs(mesh, partial=False))
    ndim = max(len(spec), 1)
    shape = tuple(data.draw(st.integers(0, 13)) for _ in range(ndim))
    lay = Layout(mesh, spec)
    # torch's _StridedShard only matches the reference on even dims (see the test below)
    strided = {p.dim for p in lay.placements() if isinstance(p, StridedShard)}
    shape = tuple(
        n if i not in strided else (n % 3 + 1) * int(np.prod([mesh.axis_size(a) for a in spec[i]]))
        for i, n in enumerate(shape)
    )
    placements = [to_torch(p) for p in lay.placements()]
    for d in range(mesh.size):
        coord = [int(c) for c in np.unravel_index(d, mesh.shape)]
        t_shape, t_offset = local_shape_and_offset(shape, mesh.shape, coord, placements)
        sl = lay.shard_slices(shape, d)
        assert tuple(t_shape) == tuple(s.stop - s.start for s in sl), (spec, shape, coord)
        # empty shards included: both start them at the dim's size (issue 50, item 6)
        assert tuple(t_offset) == tuple(s.start for s in sl), (spec, shape, coord)


def test_empty_blocks_start_where_torch_says() -> None:
    """torch's test/distributed/tensor/test_utils.py (pytorch/pytorch
    4810e4611c779b8c7b1b90379c0f667bdbecafa8), test_compute_local_shape_and_global_offset_uneven:
    4096 rows on a 30 x 8 mesh under [_StridedShard(0, sf=8), Shard(0)]; its expected values
    (18 rows at tp * 512 + 18 * dp, 8 rows at dp 28, an empty block at dp 29 whose offset is
    the dim's size, "because DCP uses offset to deduplicate shards") are the reference's now,
    and torch's own function agrees in the same run."""
    mesh = Mesh((30, 8), ("dp", "tp"))
    placements = [StridedShard(0, 8), Shard(0)]
    lay = Layout.from_placements(mesh, placements, 2)
    native = [to_torch(p) for p in placements]
    for d in range(mesh.size):
        dp, tp = (int(c) for c in np.unravel_index(d, mesh.shape))
        size, offset = {28: (8, tp * 512 + 18 * 28), 29: (0, 4096)}.get(
            dp, (18, tp * 512 + 18 * dp)
        )
        sl = lay.shard_slices((4096, 4096), d)
        assert (sl[0].stop - sl[0].start, sl[0].start) == (size, offset), (dp, tp)
        assert sl[1] == slice(0, 4096)
        t_shape, t_offset = local_shape_and_offset((4096, 4096), mesh.shape, [dp, tp], native)
        assert tuple(t_shape) == (size, 4096) and tuple(t_offset) == (offset, 0), (dp, tp)


def test_uneven_strided_shard_is_not_the_reference() -> None:
    """Known divergence, for the torch backend to handle: with an uneven dim under a tuple entry
    whose order is not ascending, torch's _StridedShard blocks are not the nested torch.chunk
    blocks (its offsets even overlap), so such layouts cannot be expressed with placements."""
    mesh = Mesh((3, 2), ("dp", "tp"))
    lay = Layout(mesh, (("tp", "dp"),))
    placements = [to_torch(p) for p in lay.placements()]
    blocks_torch, blocks_ref = [], []
    for d in range(6):
        coord = [int(c) for c in np.unravel_index(d, mesh.shape)]
        t_shape, t_offset = local_shape_and_offset((13,), mesh.shape, coord, placements)
        blocks_torch.append((t_offset[0], t_offset[0] + t_shape[0]))
        sl = lay.shard_slices((13,), d)[0]
        blocks_ref.append((sl.start, sl.stop))
    assert blocks_ref == [(0, 3), (7, 9), (3, 6), (9, 11), (6, 7), (11, 13)]
    assert blocks_torch != blocks_ref
    assert lay.is_even((12,)) and not lay.is_even((13,))


def test_a_strided_case_by_hand() -> None:
    mesh = Mesh((2, 4), ("dp", "tp"))
    lay = Layout(mesh, (("tp", "dp"),))
    placements = [to_torch(p) for p in lay.placements()]
    assert repr(placements[0]).startswith("_StridedShard")
    for d in range(8):
        coord = [int(c) for c in np.unravel_index(d, mesh.shape)]
        _, offset = local_shape_and_offset((16,), mesh.shape, coord, placements)
        assert offset[0] == lay.shard_slices((16,), d)[0].start == coord[1] * 4 + coord[0] * 2
