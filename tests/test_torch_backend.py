"""The torch backend in one process, under torch's fake process group: every rank's view of the
DeviceMesh (coordinate, per-dim group ranks) against the neutral answers, round trips, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import unimesh
from unimesh import Layout, Mesh, MeshMismatchError, P, UnsupportedError

from .support.strategies import NAMES, meshes, specs

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.placement_types import (
    Partial as TPartial,
)
from torch.distributed.tensor.placement_types import (
    Replicate as TReplicate,
)
from torch.distributed.tensor.placement_types import (
    Shard as TShard,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore
from unimesh_torch import TorchLayout, axis_mesh


def fake_world(rank: int, world: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


@pytest.fixture(autouse=True)
def _no_world_left_behind():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def increasing(mesh: Mesh, axis: str) -> bool:
    g = mesh.groups_array(axis)
    return bool(np.all(np.diff(g, axis=1) > 0))


@st.composite
def big_meshes(draw) -> Mesh:
    ndim = draw(st.integers(1, 4))
    shape = []
    for _ in range(ndim):
        room = 4096 // max(1, math.prod(shape))
        shape.append(draw(st.sampled_from([s for s in (1, 2, 3, 4, 8, 16) if s <= room])))
    names = draw(st.permutations(NAMES))[:ndim]
    size = math.prod(shape)
    ids = None
    if draw(st.booleans()):
        ids = (
            np.array(draw(st.permutations(range(size)))).reshape(shape)
            if size <= 64
            else np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
            .permutation(size)
            .reshape(shape)
        )
    return Mesh(tuple(shape), tuple(names), ids)


@settings(max_examples=60)
@given(big_meshes(), st.data())
def test_every_rank_view_matches_neutral(mesh: Mesh, data: st.DataObject) -> None:
    extra = data.draw(st.integers(0, 3))
    world = mesh.size + extra
    rank = data.draw(st.integers(0, world - 1))
    fake_world(rank, world)
    dm = unimesh.to_native(mesh, "torch")
    assert isinstance(dm, DeviceMesh)
    assert unimesh.from_native(dm) == mesh
    assert dm.mesh_dim_names == mesh.axis_names
    if rank not in mesh.device_ids:
        assert dm.get_coordinate() is None
        return
    assert dm.get_coordinate() == tuple(mesh.coords(rank).values())
    for i, axis in enumerate(mesh.axis_names):
        ranks = dist.get_process_group_ranks(dm.get_group(i))
        (mine,) = [g for g in mesh.groups(axis) if rank in g]
        assert sorted(ranks) == sorted(mine)
        if increasing(mesh, axis):
            assert ranks == list(mine)
        sub = unimesh.to_native(mesh.submesh(axis, containing=rank), "torch")
        assert unimesh.from_native(sub) == mesh.submesh(axis, containing=rank)
        assert dist.get_process_group_ranks(sub.get_group()) == ranks


def test_submeshes_and_flattened_axes_are_sliced_from_the_root() -> None:
    fake_world(5, 8)
    mesh = Mesh((2, 2, 2), ("pp", "dp", "tp"))
    root = unimesh.to_native(mesh, "torch")
    assert unimesh.to_native(mesh, "torch") is root  # cached: no second set of groups
    for axes in ["tp", ("pp", "tp"), ("dp", "tp"), "pp"]:
        sub = unimesh.to_native(mesh.submesh(axes, containing=5), "torch")
        assert sub._get_root_mesh() is root  # sliced, not built anew
        want = mesh.submesh(axes, containing=5)
        assert unimesh.from_native(sub) == want
        for i, n in enumerate(want.axis_names):
            (g,) = [g for g in want.groups(n) if 5 in g]
            assert dist.get_process_group_ranks(sub.get_group(i)) == list(g)
    flat = mesh.flatten(("dp", "tp"), "dp_tp").submesh("dp_tp", containing=5)
    native = unimesh.to_native(flat, "torch")
    assert native._get_root_mesh() is root
    assert unimesh.from_native(native) == flat
    assert dist.get_process_group_ranks(native.get_group()) == list(flat.device_ids.ravel())
    # the whole mesh flattened (the same on every rank) is built directly
    whole = unimesh.to_native(mesh.flatten(("tp", "pp", "dp"), "world"), "torch")
    assert unimesh.from_native(whole) == mesh.flatten(("tp", "pp", "dp"), "world")
    # init_device_mesh's meshes read back too
    native_init = init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "b"))
    assert unimesh.from_native(native_init) == Mesh((4, 2), ("a", "b"))
    assert unimesh.from_native(native_init["b"]) == Mesh((2,), ("b",), [4, 5])


def test_axis_mesh_for_ddp() -> None:
    fake_world(6, 8)
    mesh = Mesh((4, 2), ("dp", "tp"))
    dp = axis_mesh(mesh, "dp")
    assert unimesh.from_native(dp) == Mesh((4,), ("dp",), [0, 2, 4, 6])
    assert dist.get_process_group_ranks(dp.get_group()) == [0, 2, 4, 6]


def test_layout_round_trips_and_placements() -> None:
    fake_world(0, 24)
    mesh = Mesh((2, 3, 4), ("a", "b", "c"))
    cases = {
        P("a", None): (TShard(0), TReplicate(), TReplicate()),
        P(("c", "a")): (_StridedShard(0, split_factor=4), TReplicate(), TShard(0)),
        P(("a", "c"), "b"): (TShard(0), TShard(1), TShard(0)),
        P(None, "c", partial={"b": "max"}): (TReplicate(), TPartial("max"), TShard(1)),
    }
    for spec, placements in cases.items():
        lay = Layout(mesh, spec)
        native = unimesh.to_native(lay, "torch")
        assert isinstance(native, TorchLayout)
        assert native.placements == placements
        assert native.device_mesh is unimesh.to_native(mesh, "torch")
        assert unimesh.from_native(native) == lay


def test_from_placements_takes_torch_own_objects() -> None:
    """Layout.from_placements reads torch's Shard/_StridedShard/Replicate/Partial as they are."""
    mesh = Mesh((2, 3, 4), ("a", "b", "c"))
    cases = {
        P("a", None): [TShard(0), TReplicate(), TReplicate()],
        P(("c", "a")): [_StridedShard(0, split_factor=4), TReplicate(), TShard(0)],
        P(("a", "c"), "b"): [TShard(0), TShard(1), TShard(0)],
        P(None, "c", partial={"b": "max"}): [TReplicate(), TPartial("max"), TShard(-1)],
    }
    for spec, placements in cases.items():
        assert Layout.from_placements(mesh, placements, 2) == Layout(mesh, spec)
    mixed = [TShard(0), unimesh.Replicate(), unimesh.Shard(1)]  # both kinds in one list
    assert Layout.from_placements(mesh, mixed, 2) == Layout(mesh, P("a", "c"))
    from torch.distributed.tensor.placement_types import _MaskPartial

    with pytest.raises(unimesh.LayoutError, match=r"torch placement .*_MaskPartial.* no Partition"):
        Layout.from_placements(mesh, [_MaskPartial(), TReplicate(), TReplicate()], 1)
    with pytest.raises(unimesh.LayoutError, match=r"Partial op 'bogus' on axis 'a'"):
        Layout.from_placements(mesh, [TPartial("bogus"), TReplicate(), TReplicate()], 1)
    with pytest.raises(unimesh.LayoutError, match=r"shards dim 5, out of range"):
        Layout.from_placements(mesh, [TShard(5), TReplicate(), TReplicate()], 2)


def _torch_placement(p: object) -> object:
    if isinstance(p, unimesh.StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, unimesh.Shard):
        return TShard(p.dim)
    if isinstance(p, unimesh.Partial):
        return TPartial(p.op)
    return TReplicate()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_torch_placements_read_back_to_the_same_layout(data: st.DataObject) -> None:
    mesh = data.draw(meshes(max_ndim=4, max_size=64))
    spec = data.draw(specs(mesh))
    ndim = len(spec.entries)
    ours = Layout(mesh, spec).placements()
    read = Layout.from_placements(mesh, [_torch_placement(p) for p in ours], ndim)
    # the same as reading the core's own placements (size-1 axes may reorder the spec)
    assert read == Layout.from_placements(mesh, ours, ndim)
    assert read.placements() == ours


def test_backend_override_bad_input() -> None:
    fake_world(0, 8)
    mesh = Mesh((2, 4), ("dp", "tp"))
    dm = unimesh.to_native(mesh, "torch", backend_override={"dp": "fake", 1: ("fake", None)})
    assert unimesh.from_native(dm) == mesh
    assert dm is not unimesh.to_native(mesh, "torch")  # its own groups, not the plain mesh's
    bad = [
        ("fake", r"backend_override must be a dict .* got 'fake'"),
        ({"pp": "fake"}, r"names 'pp', which is not an axis of Mesh\(dp=2, tp=4\)"),
        ({5: "fake"}, r"names 5, which is not an axis"),
        ({True: "fake"}, r"names True, which is not an axis"),
        ({"dp": "fake", 0: "fake"}, r"gives axis 'dp' twice"),
        ({"dp": 3}, r"backend_override for axis 'dp' is 3; give a backend name"),
        ({"dp": ("fake", "opts")}, r"for axis 'dp' is \('fake', 'opts'\)"),
        ({"dp": ""}, r"for axis 'dp' is ''"),
        ({"dp": "nosuch"}, r"backend 'nosuch', which is not available in this process"),
    ]
    for value, match in bad:
        with pytest.raises(UnsupportedError, match=match):
            unimesh.to_native(mesh, "torch", backend_override=value)


def test_not_initialized_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(unimesh.LaunchError, match="not initialized and no torchrun launched"):
        unimesh.to_native(Mesh((2,), ("dp",)), "torch")


def test_refusals() -> None:
    fake_world(1, 4)
    with pytest.raises(MeshMismatchError, match=r"uses rank 7, but the torch world has 4 ranks"):
        unimesh.to_native(Mesh((8,), ("dp",)), "torch")
    perm = Mesh((2, 2), ("dp", "tp"), [[1, 0], [3, 2]])
    dm = unimesh.to_native(perm, "torch")  # the mesh itself is fine
    assert dm.get_coordinate() == (0, 0)
    assert unimesh.to_native(Layout(perm, P("dp")), "torch").placements[0] == TShard(0)
    with pytest.raises(
        UnsupportedError,
        match="shards over axis 'tp', along which the device order is not increasing",
    ):
        unimesh.to_native(Layout(perm, P(None, "tp")), "torch")
    with pytest.raises(UnsupportedError, match="distribute\\(\\) of a partial layout"):
        unimesh.distribute(
            torch.zeros(4),
            Layout(Mesh((2, 2), ("dp", "tp")), P("dp", partial={"tp": "sum"})),
            "torch",
        )
    with pytest.raises(UnsupportedError, match="_StridedShard does not give the reference"):
        unimesh.distribute(
            torch.zeros(6), Layout(Mesh((2, 2), ("dp", "tp")), P(("tp", "dp"))), "torch"
        )
    fake_world(1, 8)
    mesh3 = Mesh((2, 2, 2), ("a", "b", "c"))
    unimesh.to_native(mesh3, "torch")
    # a transpose holds every device: the same on every rank, so it is simply built
    assert unimesh.from_native(
        unimesh.to_native(mesh3.transpose(("c", "a", "b")), "torch")
    ) == mesh3.transpose(("c", "a", "b"))
    with pytest.raises(UnsupportedError, match="slices a DeviceMesh only with axes in mesh order"):
        unimesh.to_native(mesh3.submesh(("b", "a"), containing=1), "torch")
    with pytest.raises(MeshMismatchError, match="rank 1 is not in"):
        unimesh.to_native(mesh3.submesh("a", containing=2), "torch")
    with pytest.raises(MeshMismatchError, match="rank 1 is not in"):
        unimesh.to_native(mesh3.flatten(("a", "b"), "ab").submesh("ab", containing=0), "torch")
    with pytest.raises(UnsupportedError, match="device_type must be a str"):
        unimesh.to_native(Mesh((2,), ("x",)), "torch", device_type=3)
    with pytest.raises(UnsupportedError, match="unknown option"):
        unimesh.to_native(Mesh((2,), ("x",)), "torch", colour="red")
    with pytest.raises(unimesh.ConversionError, match="converts DeviceMesh, DTensor and"):
        unimesh.from_native(torch.zeros(2))


@pytest.mark.parametrize(
    ("local_rank", "local_world", "gpus", "want"),
    [
        ("0", "1", 1, 0),  # torchrun --nproc-per-node 1 on one GPU: NCCL on cuda:0
        ("3", "4", 4, 3),
        ("3", "4", 8, 3),
        ("0", "4", 1, None),  # four ranks, one GPU: NCCL refuses, so gloo on the CPU
        ("1", "2", 1, None),
        ("0", "1", 0, None),
        ("x", "1", 1, None),  # not torchrun's values
        ("-1", "1", 1, None),
        ("4", "4", 8, None),
    ],
)
def test_gpu_for_rank(local_rank: str, local_world: str, gpus: int, want: int | None) -> None:
    from unimesh_torch.runtime import gpu_for_rank

    assert gpu_for_rank(local_rank, local_world, gpus) == want


def test_more_axes_than_device_mesh_holds_is_refused_by_name() -> None:
    """33 to 64 axes (the core's bound is 64): DeviceMesh builds its groups with numpy, which
    stops at 32 dims; refused with the fix before torch is asked, for a mesh and a layout."""
    mesh = Mesh((1,) * 33, tuple(f"a{i}" for i in range(33)))
    for obj in (mesh, Layout(mesh, P("a0"))):
        with pytest.raises(UnsupportedError, match=r"33 axes is more than a torch mesh holds"):
            unimesh.to_native(obj, "torch")


def test_from_native_takes_the_dim_names_torchs_own_tests_use() -> None:
    """torch's test/distributed/tensor/test_utils.py (pytorch/pytorch
    4810e4611c779b8c7b1b90379c0f667bdbecafa8, test_strided_sharding_assumption_in_meta_compute)
    names mesh dims "mesh-0", "mesh-1": from_native refused them with MeshSpecError before
    (issue 50, item 5); now the neutral mesh round-trips them, and to_native gives torch the
    same names back."""
    fake_world(0, 8)
    native = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("mesh-0", "mesh-1"))
    mesh = unimesh.from_native(native)
    assert mesh == Mesh((2, 4), ("mesh-0", "mesh-1"))
    back = unimesh.to_native(mesh, "torch")
    assert back.mesh_dim_names == ("mesh-0", "mesh-1")
    assert torch.equal(back.mesh, native.mesh)
    assert Mesh.from_string(mesh.to_string()) == mesh


def test_compiled_value_and_grad_steps_compile_whole_and_raise_their_own_errors() -> None:
    """unimesh.compile of a value_and_grad step compiles it whole on this torch (dynamo
    traces its autograd.grad): ten steps in one process each get their own graph (they share
    unimesh's wrapper, and dynamo's recompile limit of 8 counts per code object), each with
    torch.func's gradient; a step that raises its own error (a bad batch) raises it as it
    is, and keeps compiling whole afterwards."""
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("torch before 2.13 refuses requires_grad_ under dynamo (the fallback)")
    w = torch.arange(1.0, 5.0)
    for k in range(10):

        def loss(v: object, k: int = k) -> object:
            return ((v * (k + 1.0)) ** 2).sum()

        step = unimesh.compile(
            unimesh.value_and_grad(loss, backend="torch"),
            backend="torch",
            compiler_options={"backend": "eager"},
        )
        value, grad = step(w)
        assert step.unimesh_whole(), k  # type: ignore[attr-defined]
        torch.testing.assert_close(value, loss(w))
        torch.testing.assert_close(grad, torch.func.grad(loss)(w))

    def picky(v: object) -> object:
        if v.shape[0] == 3:  # type: ignore[attr-defined]
            raise ValueError("a batch of 3 is refused")
        return (v**3).sum()  # type: ignore[operator]

    step = unimesh.compile(
        unimesh.value_and_grad(picky, backend="torch"),
        backend="torch",
        compiler_options={"backend": "eager"},
    )
    with pytest.raises(ValueError, match="a batch of 3 is refused"):
        step(torch.ones(3))
    value, grad = step(w)
    assert step.unimesh_whole()  # type: ignore[attr-defined]
    torch.testing.assert_close(grad, 3 * w**2)


def test_a_gone_peer_is_named_without_a_straggler_beside_it() -> None:
    """When a peer dies its connections close, so the others fail at once, possibly before a
    slow but live rank has arrived: the missing ranks are read from the (real) TCPStore again
    for a moment, so only the one that never comes is named."""
    import threading
    import time

    from unimesh_torch.runtime import _KEY, _missing, _settle

    from .support.launch import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    for rank in (0, 3):
        store.set(f"{_KEY}/s/{rank}", "1")
    assert _missing(store, "s", 4) == "ranks 1, 2 did not arrive"  # no settling: both
    late = threading.Timer(0.3, lambda: store.set(f"{_KEY}/s/2", "1"))
    late.start()
    t0 = time.monotonic()
    assert _missing(store, "s", 4, settle=30.0) == "rank 1 did not arrive"
    assert time.monotonic() - t0 < 20  # it stops once one rank is left, not at 30 s
    late.join()
    store.set(f"{_KEY}/s/1", "1")
    assert _missing(store, "s", 4, settle=30.0) == "every rank arrived; a peer may have left since"
    assert _missing(None, "s", 4) == "a peer process may be gone"
    # how long it may wait: a quarter of the call's timeout, 5 s at most, never past the timeout
    now = time.monotonic()
    assert _settle(20.0, now) == pytest.approx(5.0, abs=0.5)
    assert _settle(8.0, now) == pytest.approx(2.0, abs=0.5)
    assert _settle(8.0, now - 7.0) == pytest.approx(1.0, abs=0.5)
    assert _settle(20.0, now - 30.0) == 0.0  # the timeout ran out: whoever is missing is gone


def test_a_save_spreads_dtensor_replicas_over_the_processes_holding_them() -> None:
    """DCP's own setup scaled down (dp=2 x tp=2; 4 float32 DTensors at [Shard(0), Shard(1)],
    4 at [Replicate(), Shard(0)], 2 bfloat16 at [Shard(0), Shard(1)]), each rank's view under
    torch's fake process group: the blocks each rank offers to a save, then who writes each
    (the decision every rank makes from the same lists). Every block is written once, by a
    rank that holds it, and each rank writes a quarter of the bytes (the first holder of each
    replica would make ranks 0 and 1 write 13 / 36 of them each)."""
    import json

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from unimesh.checkpoint.saving import _blocks, writers
    from unimesh.convert import layout_of

    n = 64
    kinds = [(torch.float32, [TShard(0), TShard(1)] if i % 2 == 0 else [Replicate(), Shard(0)])
             for i in range(8)] + [(torch.bfloat16, [TShard(0), TShard(1)])] * 2  # fmt: skip
    values = [torch.arange(n * n, dtype=torch.float32).reshape(n, n).to(d) + i
              for i, (d, _) in enumerate(kinds)]  # fmt: skip
    offered: list[list[tuple[str, int]]] = []
    blocks: list[dict[str, np.ndarray]] = []
    for rank in range(4):
        fake_world(rank, 4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mine: dict[str, np.ndarray] = {}
        for i, ((_, places), value) in enumerate(zip(kinds, values)):
            tensor = distribute_tensor(value, mesh, places)
            be, layout = layout_of(tensor)
            found, _, _ = _blocks(f"w{i}", tensor, layout, be, rank)
            for offset, block in found:
                key = json.dumps([f"w{i}", list(offset), list(block.shape)])
                mine[key] = block.copy()  # the fake world is rebuilt per rank
        offered.append([(key, block.nbytes) for key, block in mine.items()])
        blocks.append(mine)
    writer = writers(offered)
    total = sum(v.numel() * v.element_size() for v in values)
    keys = {key for part in offered for key, _ in part}
    assert set(writer) == keys
    assert all(writer[key] in [r for r in range(4) if key in blocks[r]] for key in keys)
    written = [sum(b.nbytes for key, b in blocks[r].items() if writer[key] == r) for r in range(4)]
    assert written == [total // 4] * 4, written
    # the blocks written cover every element of every tensor exactly once
    for i in range(len(values)):
        count = np.zeros((n, n), np.int64)
        for key in keys:
            name, offset, shape = json.loads(key)
            if name == f"w{i}":
                count[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]] += 1
        assert (count == 1).all(), (i, np.unique(count))


def test_value_and_grad_takes_numpy_arguments_as_jax_does() -> None:
    """A floating numpy argument is differentiated as a tensor made from it (jax.grad takes
    numpy too; torch's autograd.grad raised "inputs cannot be empty"): the value and gradient
    are torch.func's of the same tensor, 3 a^2. A Python float is torch's default float
    dtype; an integer numpy leaf beside it stays numpy (no gradient, as before); arguments
    with no floating-point leaf are refused by name before the function runs."""

    def loss(v: object) -> object:
        return (v**3).sum()  # type: ignore[operator]

    a = np.array([1.0, -2.0, 0.5], np.float32)
    value, grad = unimesh.value_and_grad(loss, backend="torch")(a)
    torch.testing.assert_close(grad, torch.func.grad(loss)(torch.from_numpy(a)))
    np.testing.assert_allclose(grad.numpy(), 3 * a**2)
    assert float(value) == pytest.approx(float((a**3).sum()))
    _, g = unimesh.value_and_grad(lambda v: v * v, backend="torch")(1.5)
    assert g.dtype == torch.get_default_dtype() and float(g) == 3.0
    seen: list[type] = []

    def mixed(tree: dict[str, object]) -> object:
        seen.append(type(tree["i"]))
        return (tree["w"] ** 2).sum() * float(tree["i"].sum())  # type: ignore[attr-defined]

    _, g = unimesh.value_and_grad(mixed, backend="torch")({"w": a, "i": np.arange(3)})
    assert seen == [np.ndarray] and g["i"] is None
    np.testing.assert_allclose(g["w"].numpy(), 2 * a * 3)
    ran: list[int] = []

    def counted(v: object) -> object:
        ran.append(1)
        return (v * 2.0).sum()  # type: ignore[operator]

    with pytest.raises(unimesh.ConversionError, match=r"argument\(s\) \[0\]: none of their"):
        unimesh.value_and_grad(counted, backend="torch")(np.arange(3))
    assert not ran  # refused before the function ran


def test_check_vma_tags_name_only_axes_of_size_above_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Along an axis of size 1 nothing differs, so the check_vma tags (what the engine's
    TorchFunctionMode compares for every operation) leave such axes out: an operand that
    varies only there is not lifted through a pvary (it summed nothing), and a result that
    varies only there is not refused by its out_spec (the check looked at axes of size > 1
    already). Axes of size > 1 keep JAX's rules: the weight (varying along "pp", needing a
    gradient) meeting the activation (varying along "dp" too) is lifted along "dp" where dp
    has 2 devices, and along nothing where it has 1; axis_index is tagged with its axes of
    size > 1 and gives this rank's coordinate (rank 6: pp 3 of a pp=4 x dp=2 mesh, pp 6 of
    pp=8 x dp=1). The weight's gradient comes back (the fake group's collectives do nothing,
    so it is the local one: x, all ones)."""
    from unimesh_torch.autograd import VMA

    from unimesh.grad_rules import CheckVmaEnv

    lifted: list[frozenset[str]] = []
    pvary = CheckVmaEnv.pvary

    def spy(self: CheckVmaEnv, x: object, axes: frozenset[str] | set[str]) -> object:
        lifted.append(frozenset(axes))
        return pvary(self, x, axes)

    monkeypatch.setattr(CheckVmaEnv, "pvary", spy)
    fake_world(6, 8)
    seen: dict[str, object] = {}
    for axes in ({"pp": 4, "dp": 2, "sp": 1}, {"pp": 8, "dp": 1, "sp": 1}):
        mesh = unimesh.make_mesh(axes)
        lifted.clear()

        def body(x: object, w: object) -> object:
            seen["x"], seen["w"] = getattr(x, VMA), getattr(w, VMA)
            h = x * w  # type: ignore[operator]
            seen["h"] = getattr(h, VMA)
            seen["pp"] = int(unimesh.axis_index("pp"))
            seen["pp,sp"] = getattr(unimesh.axis_index(("pp", "sp")), VMA)
            return unimesh.psum(h.sum(), ("pp", "dp"))  # type: ignore[attr-defined]

        program = unimesh.shard_map(
            body, mesh, in_specs=(P("dp", "sp"), P("pp")), out_specs=P(), backend="torch"
        )
        x = torch.ones(axes["dp"] * 2, 3)
        w = torch.ones(axes["pp"] * 2, 3, requires_grad=True)
        (grad,) = torch.autograd.grad(program(x, w).to_local(), [w])
        dp = {"dp"} if axes["dp"] > 1 else set()
        assert seen["x"] == frozenset(dp)  # "sp" (size 1) is left out
        assert seen["w"] == frozenset({"pp"})
        assert seen["h"] == frozenset({"pp"} | dp)
        assert lifted == ([frozenset({"dp"})] if dp else [])  # never along "sp"
        assert seen["pp"] == 6 // axes["dp"]
        assert seen["pp,sp"] == frozenset({"pp"})
        mine = slice(seen["pp"] * 2, seen["pp"] * 2 + 2)
        assert torch.equal(grad[mine], torch.ones(2, 3))
    dist.destroy_process_group()
