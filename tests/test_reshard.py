"""``unimesh.reshard``: the planner's properties (pure numpy, any two layouts of any two meshes
over a job's devices, any processes), the move on JAX's 8 devices in this process (the same
cases torch and MLX run in the program launches of test_programs.py), and its refusals."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import unimesh
from unimesh import Layout, Mesh, P
from unimesh.moves import crosses, plan

sys.path.insert(0, str(Path(__file__).parent / "support"))
import reshard_cases

POOL = 8
Index = tuple[int, ...]


@st.composite
def meshes(draw: st.DrawFn) -> Mesh:
    """A mesh of 1-3 axes over some of the pool's devices, in any order."""
    size = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    shape: list[int] = []
    left = size
    while left > 1 and len(shape) < 3:
        f = draw(st.sampled_from([d for d in range(2, left + 1) if left % d == 0]))
        shape.append(f)
        left //= f
    shape = shape or [1]
    ids = draw(st.permutations(list(range(POOL))))[:size]
    names = tuple(f"a{draw(st.integers(0, 9))}{i}" for i in range(len(shape)))
    return Mesh(tuple(shape), names, device_ids=list(ids))


@st.composite
def layouts(draw: st.DrawFn, mesh: Mesh, ndim: int) -> Layout:
    axes = list(mesh.axis_names)
    spec: list[object] = []
    for _ in range(ndim):
        free = [a for a in axes if a not in {x for e in spec for x in (e or ())}]
        chosen = draw(st.lists(st.sampled_from(free), unique=True, max_size=2)) if free else []
        spec.append(tuple(chosen) if chosen else None)
    return Layout(mesh, P(*spec))


@st.composite
def problems(draw: st.DrawFn) -> tuple[Layout, Layout, tuple[int, ...], list[int]]:
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    source = draw(layouts(draw(meshes()), ndim))
    target = draw(layouts(draw(meshes()), ndim))
    processes = draw(st.integers(1, 4))
    where = draw(st.lists(st.integers(0, processes - 1), min_size=POOL, max_size=POOL))
    return source, target, shape, where


def _box(start: tuple[int, ...], stop: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(start, stop))


def _inside(piece: object, layout: Layout, shape: tuple[int, ...], device: int) -> bool:
    block = layout.shard_slices(shape, device)
    return all(
        s.start <= a and b <= s.stop
        for s, a, b in zip(block, piece.start, piece.stop)  # type: ignore[attr-defined]
    )


@given(problems())
def test_the_plan_tiles_every_target_block_and_moves_the_minimum(problem: tuple) -> None:
    source, target, shape, where = problem
    itemsize = 2
    plans = {p: plan(source, target, shape, itemsize, where, p) for p in sorted(set(where))}
    # whether anything moves between processes: one answer, the same as the plans'
    assert crosses(source, target, shape, where) == any(m.receive for m in plans.values())
    s_ids = source.mesh.device_ids.ravel().tolist()
    t_ids = target.mesh.device_ids.ravel().tolist()
    for p, mine in plans.items():
        devices = {d for d in range(POOL) if where[d] == p}
        # every target device of this process, each block tiled exactly once by its pieces
        assert set(mine.blocks) == {d for d in t_ids if d in devices}
        for t, (bounds, pieces) in mine.blocks.items():
            cover = np.zeros(shape, np.int64)
            for piece in pieces:
                cover[_box(piece.start, piece.stop)] += 1
                assert t in piece.devices
                # it comes from a device holding it: this process's own, or the sender's
                assert piece.source in s_ids and _inside(piece, source, shape, piece.source)
            want = np.zeros(shape, np.int64)
            want[target.shard_slices(shape, t)] = 1
            np.testing.assert_array_equal(cover, want)
            # the pieces come in the row-major order of the block's segment grid, which is
            # how the block is put back together (nested concatenation)
            grid = [len(b) - 1 for b in bounds]
            if pieces:
                assert len(pieces) == int(np.prod(grid))
                for piece, at in zip(pieces, np.ndindex(*grid)):
                    assert piece.start == tuple(b[i] for b, i in zip(bounds, at))
                    assert piece.stop == tuple(b[i + 1] for b, i in zip(bounds, at))
        for piece in mine.local:
            assert where[piece.source] == p
        # each received piece once, from a process holding it, never one this process holds
        need = np.zeros(shape, bool)
        held = np.zeros(shape, bool)
        for t in t_ids:
            if t in devices:
                need[target.shard_slices(shape, t)] = True
        for s in s_ids:
            if s in devices:
                held[source.shard_slices(shape, s)] = True
        got = np.zeros(shape, np.int64)
        for q, pieces in mine.receive.items():
            assert q != p
            for piece in pieces:
                assert where[piece.source] == q
                got[_box(piece.start, piece.stop)] += 1
        np.testing.assert_array_equal(got, (need & ~held).astype(np.int64))
        assert mine.bytes_received == int((need & ~held).sum()) * itemsize
        # what p sends to q is what q receives from p, in the same order
        for q, pieces in mine.send.items():
            theirs = plans[q].receive.get(p, [])
            assert [(x.start, x.stop) for x in pieces] == [(x.start, x.stop) for x in theirs]
        for q, other in plans.items():
            if q != p and p in other.receive:
                assert q in mine.send
    # every byte received was sent once, by one process
    assert sum(x.bytes_sent for x in plans.values()) == sum(
        x.bytes_received for x in plans.values()
    )


@st.composite
def tilings(
    draw: st.DrawFn, shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes that tile ``shape``, made by cutting boxes in two along any dim (guillotine cuts):
    most such tilings are no grid (a cut splits one box, not the whole row of boxes)."""
    boxes = [((0,) * len(shape), tuple(shape))]
    for _ in range(draw(st.integers(0, 6))):
        i = draw(st.integers(0, len(boxes) - 1))
        lo, hi = boxes[i]
        dims = [d for d in range(len(shape)) if hi[d] - lo[d] > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        at = draw(st.integers(lo[d] + 1, hi[d] - 1))
        boxes[i : i + 1] = [
            (lo, hi[:d] + (at,) + hi[d + 1 :]),
            (lo[:d] + (at,) + lo[d + 1 :], hi),
        ]
    return boxes


def _read_part(image: bytes, part: object, dtype: np.dtype) -> np.ndarray:
    """A planned part read from a file image as the reader reads it: its byte runs, or a
    strided box whole, viewed with its strides and cut to the part."""
    from unimesh.checkpoint.runs import part as with_runs

    box, a, b = part  # type: ignore[misc]
    found = with_runs(box, a, b, dtype.itemsize)
    raw = b"".join(bytes(image[at : at + n]) for at, n in found.runs)
    if not box.strides:
        return np.frombuffer(raw, dtype).reshape(found.shape)
    whole = np.lib.stride_tricks.as_strided(
        np.frombuffer(raw, dtype), box.size, tuple(x * dtype.itemsize for x in box.strides)
    )
    return whole[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, box.offset))]


@given(st.data())
def test_a_load_plans_its_reads_with_the_reshard_planner(data: st.DataObject) -> None:
    """The checkpoint loader's reads come from ``moves.plan`` (the saved boxes as the source
    side, held by the storage): for any tiling of the saved boxes, grid or not, some stored
    column-major (a DCP chunk of a transposed tensor), empty dims included, and any target
    layout and process split, each device's parts tile its block exactly once, one part per
    box it touches, each inside its box; read from a file image, the block is the array's, and
    the bytes read are those of intersecting the block with the boxes directly."""
    from unimesh.checkpoint.format import Box, Tensor
    from unimesh.checkpoint.runs import pieces, planned

    ndim = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    target = data.draw(layouts(data.draw(meshes()), ndim))
    where = data.draw(st.lists(st.integers(0, 2), min_size=POOL, max_size=POOL))
    whole = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    image, boxes = bytearray(), []
    for lo, hi in data.draw(tilings(shape)):
        size = tuple(b - a for a, b in zip(lo, hi))
        strided = ndim >= 2 and data.draw(st.booleans())
        block = whole[_box(lo, hi)]
        chunk = np.asfortranarray(block) if strided else np.ascontiguousarray(block)
        raw = chunk.tobytes(order="F" if strided else "C")
        strides = tuple(int(np.prod(size[:d])) for d in range(ndim)) if strided else None
        boxes.append(Box(lo, size, "data", len(image), len(image) + len(raw), None, strides))
        image += raw
    t = Tensor("w", shape, "int32", None, boxes)
    for p in sorted(set(where)):
        mine = [d for d in target.mesh.device_ids.ravel().tolist() if where[d] == p]
        parts = planned(t, target, mine)
        assert parts is not None and sorted(parts) == sorted(mine)
        for device, found in parts.items():
            block = target.shard_slices(shape, device)
            start = tuple(s.start for s in block)
            out = np.full([s.stop - s.start for s in block], -1, np.int32)
            cover = np.zeros(out.shape, np.int64)
            assert len({id(box) for box, _, _ in found}) == len(found)  # a box read once
            for box, a, b in found:
                assert all(o <= x < y <= o + n for x, y, o, n in zip(a, b, box.offset, box.size))
                at = tuple(slice(x - s, y - s) for x, y, s in zip(a, b, start))
                cover[at] += 1
                out[at] = _read_part(image, (box, a, b), np.dtype(np.int32))
            assert (cover == 1).all()
            np.testing.assert_array_equal(out, whole[block])
            # the same bytes as intersecting the block with the boxes directly
            direct = pieces(boxes, start, tuple(s.stop for s in block), 4)
            from unimesh.checkpoint.runs import part as with_runs

            planned_bytes = sum(with_runs(*x, 4).nbytes for x in found)
            assert planned_bytes == sum(x.nbytes for x in direct)


def test_saved_boxes_that_would_make_too_many_cells_are_read_by_intersection() -> None:
    """A staircase of 2 x 2,100 boxes (each row cut at its own column) tiles the array, but its
    grid has 2,100 x 2,100 cells: the planner declines before building any (None), and the
    load reads each block by intersecting it with the boxes, as Checkpoint.read does."""
    from unimesh.checkpoint.format import Box, Tensor
    from unimesh.checkpoint.runs import planned

    n = 2100
    boxes = []
    for i in range(n):
        boxes.append(Box((i, 0), (1, i + 1), "data", 0, 4 * (i + 1)))
        if i + 1 < n:
            boxes.append(Box((i, i + 1), (1, n - i - 1), "data", 0, 4 * (n - i - 1)))
    t = Tensor("stairs", (n, n), "float32", None, boxes)
    assert planned(t, Layout(Mesh((2,), ("x",)), P("x")), [0]) is None


def test_blocks_that_are_no_grid_are_refused_by_name() -> None:
    from unimesh.moves import Boxes

    with pytest.raises(unimesh.LayoutError, match=r"2 ids, lo \(1, 2\)"):
        Boxes([1, 2], [[0, 0]], [[1, 1]])
    with pytest.raises(unimesh.LayoutError, match="each id once"):
        Boxes([1, 1], [[0], [2]], [[2], [4]])
    with pytest.raises(unimesh.LayoutError, match="along dim 1 two of their intervals overlap"):
        Boxes([0, 1], [[0, 0], [2, 1]], [[2, 4], [4, 3]])
    with pytest.raises(unimesh.LayoutError, match="along dim 1 two of their intervals overlap"):
        Boxes([0, 1, 2], [[0, 0], [0, 2], [2, 0]], [[2, 2], [2, 4], [4, 4]])  # a guillotine cut
    lo, hi = [[0, 0], [0, 2], [2, 0], [2, 2]], [[2, 2], [2, 4], [4, 2], [4, 4]]
    assert Boxes([0, 1, 2, 3], lo, hi) == Boxes([0, 1, 2, 3], lo, hi)


def test_cells_refuse_bad_boxes_and_too_many_cells_by_name() -> None:
    from unimesh.moves import cells

    with pytest.raises(unimesh.LayoutError, match=r"lo and hi of one shape.*\(3,\) and \(2,\)"):
        cells(np.zeros(3), np.zeros(2))
    # a guillotine cut: 3 boxes make 4 cells; with room for 3 only, refused naming both counts
    lo, hi = np.array([[0, 0], [0, 2], [2, 0]]), np.array([[2, 2], [2, 4], [4, 4]])
    with pytest.raises(
        unimesh.LayoutError, match=r"3 boxes make 4 cells of one grid \(at most 3\)"
    ):
        cells(lo, hi, limit=3)
    c_lo, c_hi, parent = cells(lo, hi)
    assert parent.tolist() == [0, 1, 2, 2]
    assert c_lo.tolist() == [[0, 0], [0, 2], [2, 0], [2, 2]]
    assert c_hi.tolist() == [[2, 2], [2, 4], [4, 2], [4, 4]]


@given(
    st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3), min_size=0, max_size=6),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 200),
)
def test_the_exchange_rounds_cover_each_piece_once_within_the_budget(
    shapes: list[list[int]], itemsize: int, budget: int
) -> None:
    """``units`` cuts a pair's pieces into runs of rows (in order, each row once) of at most
    ``budget`` bytes unless one row is larger, and a round carries at most ``budget`` bytes
    plus one run: what bounds the bytes in flight (``IN_FLIGHT``)."""
    from unimesh.moves import Piece, units

    pieces = [Piece((0,) * len(sh), tuple(sh), 0, (1,)) for sh in shapes]
    found = units(pieces, itemsize, budget)
    per_round: dict[int, int] = {}
    largest = 0
    for i, p in enumerate(pieces):
        mine = [(lo, hi, r) for j, lo, hi, r in found if j == i]
        rows = p.shape[0] if p.shape else 1
        row_bytes = int(np.prod(p.shape[1:], dtype=np.int64)) * itemsize if p.shape else itemsize
        assert [lo for lo, _, _ in mine] == [0] + [hi for _, hi, _ in mine[:-1]]
        assert mine[-1][1] == rows or (rows == 0 and mine == [(0, 0, mine[0][2])])
        for lo, hi, r in mine:
            size = (hi - lo) * row_bytes
            assert size <= max(budget, row_bytes)
            per_round[r] = per_round.get(r, 0) + size
            largest = max(largest, size)
    assert [r for *_, r in found] == sorted(r for *_, r in found)
    for total in per_round.values():
        assert total <= budget + largest


def test_the_plan_is_cached_and_keeps_blocks_in_place() -> None:
    mesh = Mesh((2, 4), ("dp", "tp"))
    a, b = Layout(mesh, P("dp")), Layout(mesh, P("dp", "tp"))
    where = [0] * 8
    first = plan(a, b, (8, 8), 4, where, 0)
    assert plan(a, b, (8, 8), 4, where, 0) is first
    same = plan(a, a, (8, 8), 4, where, 0)
    assert same.kept == tuple(range(8)) and same.bytes_copied == 0
    # each device keeps its own part of the rows it held: nothing crosses devices
    assert first.bytes_copied == 0 and first.bytes_received == 0


def test_spreading_the_sends_over_the_holders() -> None:
    """Replicated over 4 processes, sharded onto 4 others: each holder sends a share."""
    pool = Mesh((8,), ("x",))
    source = Layout(Mesh((4,), ("r",), device_ids=[0, 1, 2, 3]), P())
    target = Layout(Mesh((4,), ("s",), device_ids=[4, 5, 6, 7]), P("s"))
    del pool
    where = list(range(8))
    sent = [plan(source, target, (16, 4), 4, where, p).bytes_sent for p in range(4)]
    assert sum(sent) == 16 * 4 * 4 and max(sent) == min(sent)


@pytest.mark.parametrize("name", [c[0] for c in reshard_cases.cases(8, True, False)])
def test_jax_eight_devices(name: str) -> None:
    pytest.importorskip("jax")
    case = next(c for c in reshard_cases.cases(8, True, False) if c[0] == name)
    _, source, target, shape, dtype = case
    assert reshard_cases.check("jax", source, target, shape, dtype, set(range(POOL))) == 0.0


@pytest.mark.parametrize("name", [c[0] for c in reshard_cases.psum_gradient_cases(8, False)])
def test_jax_grad_of_a_reshard_then_a_psum_is_the_reference(name: str) -> None:
    """The reference the MLX launches check their gradients against: ``jax.grad`` (through
    ``unimesh.value_and_grad`` on JAX's 8 devices) of each loss of
    ``reshard_cases.psum_loss`` (a reshard, then a program ending in a psum over all, one or
    none of the target's axes) is ``cos(x)`` in float64, laid out like the source."""
    pytest.importorskip("jax")
    case = next(c for c in reshard_cases.psum_gradient_cases(8, False) if c[0] == name)
    _, source, target, shape, over = case
    got = reshard_cases.check_psum_gradient("jax", source, target, shape, over, set(range(POOL)))
    assert got == 0.0


def test_jax_a_tree_moves_whole_with_a_layout_per_leaf() -> None:
    pytest.importorskip("jax")
    import jax

    mesh = Mesh((2, 4), ("dp", "tp"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    tree = {"w": unimesh.distribute(x, Layout(mesh, P("dp")), "jax"), "b": [x[0]]}
    stats: dict[str, int] = {}
    out = unimesh.reshard(tree, {"w": Layout(mesh, P(None, "tp")), "b": Layout(mesh, P())},
                          stats=stats)  # fmt: skip
    assert isinstance(out["w"], jax.Array)
    assert out["w"].sharding.is_equivalent_to(
        unimesh.to_native(Layout(mesh, P(None, "tp")), "jax"), 2
    )
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    np.testing.assert_array_equal(np.asarray(out["b"][0]), x[0])  # a host array: distributed
    # each device's target block (8 rows, 2 columns) is half in its own rows; the other half
    # (4 x 2 float32) is copied from a device of the other dp row: 8 devices x 32 bytes
    assert stats == {"bytes_sent": 0, "bytes_received": 0, "bytes_copied": 8 * 32}


@pytest.mark.parametrize("where", ["same-devices", "reversed-devices"])
def test_jax_gradients_through_a_reshard_are_jax_grads(where: str) -> None:
    """Under ``jax.grad`` (eager and jitted) and ``unimesh.value_and_grad`` a reshard is JAX's
    own differentiable move: the gradient equals ``jax.grad`` of the same loss without the
    reshard, laid out like the argument outside ``jit``; the forward value is laid out as the
    target."""
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    mesh = Mesh((2, 4), ("dp", "tp"))
    x = unimesh.distribute(np.arange(32.0, dtype=np.float32).reshape(8, 4) / 7,
                           Layout(mesh, P("dp", "tp")), "jax")  # fmt: skip
    if where == "same-devices":
        target = Layout(mesh, P("tp", None))
    else:
        target = Layout(Mesh((8,), ("d",), device_ids=list(range(7, -1, -1))), P("d"))
    weight = jnp.arange(4.0, dtype=jnp.float32) - 1.5

    def loss(a: object) -> object:
        b = unimesh.reshard(a, target)
        return (jnp.sin(b) * b * weight).sum()

    def native(a: object) -> object:
        return (jnp.sin(a) * a * weight).sum()

    want = np.asarray(jax.grad(native)(x))
    runs = {
        "grad": jax.grad(loss),
        "value_and_grad": lambda a: unimesh.value_and_grad(loss, backend="jax")(a)[1],
    }
    if where == "same-devices":  # jit holds one device set (JAX refuses another inside jit)
        runs["jit(grad)"] = jax.jit(jax.grad(loss))
        moved = jax.jit(lambda a: unimesh.reshard(a, target))(x)
        assert moved.sharding.is_equivalent_to(unimesh.to_native(target, "jax"), 2)
    for name, run in runs.items():
        got = run(x)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, err_msg=name)
        if name != "jit(grad)":  # under jit the layout of a result is XLA's to choose
            assert got.sharding.is_equivalent_to(x.sharding, 2), (name, got.sharding)


def test_two_frameworks_in_one_process_jax_to_mlx_and_back() -> None:
    """A jax.Array handed to MLX (``backend="mlx"``) and back, on the one device both hold in
    this process; TensorFlow takes no other framework's arrays and says so."""
    pytest.importorskip("jax")
    mlx = pytest.importorskip("mlx.core")
    import jax

    one = Mesh((1,), ("x",))
    x = np.arange(12, dtype=np.float32).reshape(3, 4) * 1.5
    placed = unimesh.distribute(x, Layout(one, P()), "jax")
    stats: dict[str, int] = {}
    there = unimesh.reshard(placed, Layout(one, P("x")), backend="mlx", stats=stats)
    assert isinstance(there.local, mlx.array) and there.layout == Layout(one, P("x"))
    np.testing.assert_array_equal(np.asarray(there.local), x)
    assert stats == {"bytes_sent": 0, "bytes_received": 0, "bytes_copied": 0}
    back = unimesh.reshard(there, Layout(one, P()), backend="jax")
    assert isinstance(back, jax.Array)
    np.testing.assert_array_equal(np.asarray(back), x)
    if importlib.util.find_spec("tensorflow") is not None:  # TF takes no other's arrays
        imported = "tensorflow" in sys.modules
        with pytest.raises(unimesh.UnsupportedError, match="tensorflow backend takes no other"):
            unimesh.reshard(placed, Layout(one, P()), backend="tensorflow")
        # said before TF's runtime starts: a later test may still give it 8 devices
        assert ("tensorflow" in sys.modules) == imported


def test_refusals_name_the_array_and_the_fix() -> None:
    pytest.importorskip("jax")
    mesh = Mesh((2, 4), ("dp", "tp"))
    x = unimesh.distribute(np.zeros((8, 8), np.float32), Layout(mesh, P("dp")), "jax")
    with pytest.raises(unimesh.LayoutError, match=r"names 3 dims but the array has shape"):
        unimesh.reshard(x, Layout(mesh, P("dp", "tp", None)))
    with pytest.raises(unimesh.LayoutError, match=r"target .* is neither a Layout"):
        unimesh.reshard({"a": x}, {"b": Layout(mesh, P())})
    with pytest.raises(unimesh.LayoutError, match=r"cannot hold a pending reduction"):
        unimesh.reshard(x, Layout(mesh, P(partial={"tp": "sum"})))
    with pytest.raises(unimesh.LayoutError, match=r"takes a dict to fill"):
        unimesh.reshard(x, Layout(mesh, P()), stats=3)  # type: ignore[arg-type]
    with pytest.raises(unimesh.LayoutError, match="holds no arrays"):
        unimesh.reshard({}, Layout(mesh, P()))
    far = Mesh((4,), ("z",), device_ids=[8, 9, 10, 11])
    with pytest.raises(unimesh.MeshMismatchError, match="uses device 11, but JAX sees 8"):
        unimesh.reshard(x, Layout(far, P("z")))
    rows = unimesh.distribute(np.zeros((6, 8), np.float32), Layout(mesh, P("dp")), "jax")
    with pytest.raises(unimesh.UnsupportedError, match=r"uneven_shards.*\(6, 8\)"):
        unimesh.reshard(rows, Layout(mesh, P("tp")))
    rules = unimesh.LayoutMap(mesh)
    rules["nothing"] = P("dp")
    with pytest.raises(unimesh.LayoutError, match="nothing"):
        unimesh.reshard({"w": x}, rules)


def test_unimesh_show_prints_the_plan_beside_gather_and_slice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from unimesh.cli.main import main

    code = main(["show", "dp=2,tp=2", "--layout", "dp", "--shape", "8,8", "--reshard-to",
                 "None,v", "--to-mesh", "u=2,v=2;ids=0,2,1,3"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    # rows to columns: each device receives the half of its column block it lacks (8 rows x 2
    # columns x 4 bytes = 64) from one peer; gather-and-slice receives the other 128 bytes
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["0", "1", "2", "3", "all"]
    assert all(r.split("│")[3].strip() == "64" for r in rows[:4])
    assert rows[-1].split("│")[3].strip() == "256" and rows[-1].split("│")[7].strip() == "512"
    assert main(["show", "dp=2,tp=2", "--reshard-to", "dp"]) == 2
    assert "--reshard-to needs --layout and --shape" in capsys.readouterr().err


def test_layout_of_names_the_owner_and_layout_of_a_distributed_array_and_nothing_else():
    """``unimesh.layout_of`` (which reshard and load read every array through): a jax.Array
    laid out on a mesh gives JAX's backend and the Layout ``from_native`` reads off its
    sharding; a host array, a Layout, a mesh, None, other objects and a jax.Array on one
    device (no mesh sharding) give None, never an error."""
    jax = pytest.importorskip("jax")
    lay = Layout(Mesh.from_string("x=4,y=2"), P("x", "y"))
    arr = unimesh.distribute(np.zeros((8, 4), np.float32), lay, "jax")
    be, got = unimesh.layout_of(arr)
    assert be.name == "jax" and got == lay == unimesh.from_native(arr.sharding)
    for other in (np.zeros(3), lay, lay.mesh, None, "x", 3, [arr], jax.numpy.zeros(2)):
        assert unimesh.layout_of(other) is None, other
