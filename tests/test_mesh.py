"""Unit tests of the neutral Mesh and make_mesh against hand-worked answers and numpy."""

from __future__ import annotations

import asyncio
import pickle
import threading

import numpy as np
import pytest

import unimesh
from unimesh import Mesh, MeshSpecError, make_mesh

pytestmark = pytest.mark.quick  # framework-free and fast: in the quick tier

# torch's measured example: rank 0 sits at coordinate (0, 1)
PERM = Mesh((2, 2), ("dp", "tp"), [[1, 0], [3, 2]])


def test_defaults_and_properties():
    m = Mesh((2, 4), ("dp", "tp"))
    assert m.shape == (2, 4) and m.axis_names == ("dp", "tp")
    assert m.ndim == 2 and m.size == 8
    assert m.axis_sizes == {"dp": 2, "tp": 4}
    assert list(m.axis_sizes) == ["dp", "tp"]
    assert m.axis_types is None and m.devices_per_process is None
    assert m.num_processes == 1
    np.testing.assert_array_equal(m.device_ids, np.arange(8).reshape(2, 4))
    assert m.device_ids.dtype == np.int64
    assert m.strides == (4, 1)
    assert Mesh((2, 3, 4), ("a", "b", "c")).strides == (12, 4, 1)
    assert m.axis_size("tp") == 4
    assert m.is_default_order and not PERM.is_default_order


def test_device_ids_are_read_only_and_copied():
    src = np.array([[1, 0], [3, 2]])
    m = Mesh((2, 2), ("a", "b"), src)
    src[0, 0] = 99  # the mesh kept its own copy
    assert m.device_ids[0, 0] == 1
    with pytest.raises(ValueError):
        m.device_ids[0, 0] = 5
    with pytest.raises(ValueError):
        Mesh((4,), ("a",)).device_ids[0] = 5


def test_immutable():
    m = Mesh((2,), ("a",))
    with pytest.raises(AttributeError, match="immutable"):
        m._shape = (3,)  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del m._shape


def test_equality_and_hash():
    a = Mesh((2, 2), ("x", "y"))
    b = Mesh([2, 2], ["x", "y"], [[0, 1], [2, 3]])  # explicit default order equals implicit
    assert a == b and hash(a) == hash(b)
    assert a != PERM.rename({"dp": "x", "tp": "y"})
    assert a != Mesh((2, 2), ("x", "y"), axis_types=("auto", "auto"))
    assert a != Mesh((2, 2), ("x", "y"), devices_per_process=2)
    assert a != Mesh((2, 2), ("y", "x"))
    assert len({a, b, PERM}) == 2
    assert (a == "x") is False


def test_repr():
    assert repr(Mesh((2, 4), ("dp", "tp"))) == "Mesh(dp=2, tp=4)"
    assert repr(PERM) == "Mesh(dp=2, tp=2, device_ids=[[1, 0], [3, 2]])"
    m = Mesh((2,), ("a",), axis_types=("Explicit",), devices_per_process=1)
    assert repr(m) == "Mesh(a=2, axis_types=('explicit',), devices_per_process=1)"


def test_coords_device_at_unravel():
    m = Mesh((2, 3), ("a", "b"), np.arange(6)[::-1].reshape(2, 3))
    assert m.coords(5) == {"a": 0, "b": 0}
    assert m.coords(0) == {"a": 1, "b": 2}
    assert m.device_at(a=1, b=0) == 2
    ref = {int(m.device_ids[i, j]): {"a": i, "b": j} for i in range(2) for j in range(3)}
    assert m.unravel_index() == ref
    assert PERM.coords(0) == {"dp": 0, "tp": 1}
    np.testing.assert_array_equal(m.coords_array([5, 0]), [[0, 0], [1, 2]])


def test_unravel_index_matches_tf_strides_formula():
    # TF DTensor: coordinates are (device_id // strides) % shape for the default order
    m = Mesh((2, 3, 4), ("a", "b", "c"))
    for d, c in m.unravel_index().items():
        assert tuple(c.values()) == tuple((d // np.array(m.strides)) % np.array(m.shape))


def test_groups_one_axis_and_tuples():
    m = Mesh((2, 4), ("dp", "tp"))
    assert m.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert m.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert m.groups(("dp", "tp")) == [tuple(range(8))]
    assert m.groups(("tp", "dp")) == [(0, 4, 1, 5, 2, 6, 3, 7)]
    assert PERM.groups("tp") == [(1, 0), (3, 2)]
    assert PERM.groups("dp") == [(1, 3), (0, 2)]
    m3 = Mesh((2, 2, 2), ("pp", "dp", "tp"))
    assert m3.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert m3.groups(["pp", "tp"]) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert m3.groups_array("tp").shape == (4, 2)


def test_submesh_any_order():
    m3 = Mesh((2, 2, 2), ("pp", "dp", "tp"))
    sub = m3.submesh("tp", containing=6)
    assert sub == Mesh((2,), ("tp",), [6, 7])
    sub2 = m3.submesh(("tp", "pp"), containing=3)
    assert sub2.axis_names == ("tp", "pp")
    np.testing.assert_array_equal(sub2.device_ids, [[2, 6], [3, 7]])
    assert m3.submesh(("pp", "dp", "tp")) == m3
    assert m3.submeshes("dp") == [Mesh((2,), ("dp",), g) for g in m3.groups("dp")]
    typed = Mesh((2, 2), ("a", "b"), axis_types=("explicit", "auto"), devices_per_process=2)
    s = typed.submesh("b", containing=3)
    assert s.axis_types == ("auto",) and s.devices_per_process == 2


def test_flatten_and_unflatten():
    m = Mesh((2, 3, 4), ("dp", "cp", "tp"))
    f = m.flatten(("dp", "tp"), "dp_tp")
    assert f.axis_names == ("dp_tp", "cp") and f.shape == (8, 3)
    ref = m.device_ids.transpose(0, 2, 1).reshape(8, 3)
    np.testing.assert_array_equal(f.device_ids, ref)
    g = m.flatten(("tp", "dp"), "x")  # placed where tp stood
    assert g.axis_names == ("cp", "x")
    np.testing.assert_array_equal(g.device_ids, m.device_ids.transpose(1, 2, 0).reshape(3, 8))
    assert m.flatten(("dp", "cp"), "dp").axis_names == ("dp", "tp")  # reuse a merged name
    assert m.flatten(("cp",), "c") == m.rename({"cp": "c"})
    u = f.unflatten("dp_tp", {"dp": 2, "tp": -1})
    assert u.axis_names == ("dp", "tp", "cp")
    assert u == m.transpose(("dp", "tp", "cp"))
    back = m.flatten(("cp", "tp"), "ct").unflatten("ct", {"cp": 3, "tp": 4})
    assert back == m


def test_flatten_keeps_types_and_refuses_mixed():
    m = Mesh((2, 2, 2), ("a", "b", "c"), axis_types=("explicit", "explicit", "auto"))
    assert m.flatten(("a", "b"), "ab").axis_types == ("explicit", "auto")
    with pytest.raises(MeshSpecError, match="different axis types"):
        m.flatten(("a", "c"), "ac")
    assert m.unflatten("c", {"c1": 1, "c2": 2}).axis_types == (
        "explicit",
        "explicit",
        "auto",
        "auto",
    )


def test_rename_transpose():
    r = PERM.rename({"dp": "data"})
    assert r.axis_names == ("data", "tp")
    np.testing.assert_array_equal(r.device_ids, PERM.device_ids)
    t = PERM.transpose(("tp", "dp"))
    np.testing.assert_array_equal(t.device_ids, PERM.device_ids.T)
    assert r.rename({"data": "tp", "tp": "dp"}).axis_names == ("tp", "dp")  # a swap is fine


def test_processes_and_local_mesh():
    m = make_mesh({"dp": 2, "tp": 4}, devices_per_process=4)
    assert m.num_processes == 2
    assert m.local_device_ids(1) == [4, 5, 6, 7]
    assert m.local_mesh(1) == Mesh((1, 4), ("dp", "tp"), [[4, 5, 6, 7]], devices_per_process=4)
    m2 = make_mesh({"dp": 4, "tp": 2}, devices_per_process=2)
    assert m2.local_mesh(1).device_ids.tolist() == [[2, 3]]
    # two devices per process laid across dp: process 0 owns column 0 of rows 0-1
    col = Mesh((2, 2), ("dp", "tp"), [[0, 2], [1, 3]], devices_per_process=2)
    assert col.local_mesh(0).device_ids.tolist() == [[0], [1]]
    assert col.local_device_ids(1) == [2, 3]
    assert col.local_device_ids(7) == []
    bad = Mesh((2, 2), ("dp", "tp"), [[0, 2], [3, 1]], devices_per_process=2)
    with pytest.raises(MeshSpecError, match="do not form a block"):
        bad.local_mesh(0)
    one = Mesh((4,), ("a",))
    assert one.local_device_ids(0) == [0, 1, 2, 3] and one.local_mesh(0) == one
    with pytest.raises(MeshSpecError, match="holds no device"):
        m.local_mesh(5)


def test_make_mesh_inference_and_errors():
    assert make_mesh({"dp": -1, "tp": 4}, 8) == Mesh((2, 4), ("dp", "tp"))
    assert make_mesh({"dp": 2, "tp": 4}) == Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(MeshSpecError, match=r"dp=2 x tp=4 = 8 devices, but num_devices=6 has 6"):
        make_mesh({"dp": 2, "tp": 4}, 6)
    with pytest.raises(MeshSpecError, match="not a whole number"):
        make_mesh({"dp": -1, "tp": 3}, 8)
    with pytest.raises(MeshSpecError, match="only one axis size may be -1"):
        make_mesh({"dp": -1, "tp": -1}, 8)
    with pytest.raises(MeshSpecError, match="needs num_devices"):
        make_mesh({"dp": -1})


def test_make_mesh_hybrid_matches_process_blocks():
    # 2 processes x 4 devices: dp spans processes, each process fills a (1, 4) block
    m = make_mesh({"dp": 1, "tp": 4}, dcn_axes={"dp": 2})
    assert m.shape == (2, 4) and m.devices_per_process == 4
    np.testing.assert_array_equal(m.device_ids, np.arange(8).reshape(2, 4))
    # 4 processes tiling a 2x2 grid of (2, 2) blocks
    h = make_mesh({"a": 2, "b": 2}, dcn_axes={"a": 2, "b": 2})
    assert h.shape == (4, 4)
    for p in range(4):
        local = h.local_mesh(p)
        assert local.shape == (2, 2)
        assert sorted(local.device_ids.ravel().tolist()) == list(range(4 * p, 4 * p + 4))
    assert h.device_ids.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    inferred = make_mesh({"dp": -1, "tp": 2}, 16, dcn_axes={"dp": 2})
    assert inferred.shape == (8, 2) and inferred.devices_per_process == 8
    with pytest.raises(MeshSpecError, match="not one of the mesh axes"):
        make_mesh({"dp": 2}, dcn_axes={"pp": 2})


def test_make_mesh_infers_a_dcn_axis_of_minus_one():
    """MaxText's defaults: dcn_data_parallelism -1 (and often ici_fsdp_parallelism -1)."""
    explicit = make_mesh({"data": 1, "fsdp": 4}, dcn_axes={"data": 4})
    assert make_mesh({"data": 1, "fsdp": 4}, 16, dcn_axes={"data": -1}) == explicit
    both = make_mesh({"data": 1, "fsdp": -1}, 16, dcn_axes={"data": -1}, devices_per_process=4)
    assert both == explicit
    two = make_mesh({"data": 1, "fsdp": 2, "tp": 2}, 32, dcn_axes={"data": -1, "fsdp": 2})
    assert two == make_mesh({"data": 1, "fsdp": 2, "tp": 2}, dcn_axes={"data": 4, "fsdp": 2})
    assert two.shape == (4, 4, 2) and two.devices_per_process == 4
    with pytest.raises(MeshSpecError, match="inferred from num_devices; pass num_devices"):
        make_mesh({"data": 1, "fsdp": 4}, dcn_axes={"data": -1})
    with pytest.raises(MeshSpecError, match="pass devices_per_process"):
        make_mesh({"data": 1, "fsdp": -1}, 16, dcn_axes={"data": -1})
    with pytest.raises(MeshSpecError, match="num_devices=18 is not a multiple of the 4 devices"):
        make_mesh({"data": 1, "fsdp": 4}, 18, dcn_axes={"data": -1})
    with pytest.raises(
        MeshSpecError,
        match=r"cannot infer axis 'data': data=-1 x fsdp=3 leaves 8 / 3, which is not a whole",
    ):
        make_mesh({"data": 1, "fsdp": 2}, 16, dcn_axes={"data": -1, "fsdp": 3})
    with pytest.raises(MeshSpecError, match="only one axis size may be -1"):
        make_mesh({"a": 1, "b": 2}, 16, dcn_axes={"a": -1, "b": -1})
    with pytest.raises(MeshSpecError, match="dcn size of axis 'a'.*-2"):
        make_mesh({"a": 1, "b": 2}, 16, dcn_axes={"a": -2})
    with pytest.raises(MeshSpecError, match="devices_per_process=3"):
        make_mesh({"dp": 2}, dcn_axes={"dp": 2}, devices_per_process=3)


def test_serial_forms_round_trip():
    meshes = [
        Mesh((2, 4), ("dp", "tp")),
        PERM,
        Mesh(
            (2, 2),
            ("a", "b"),
            [[3, 9], [4, 1]],
            axis_types=("explicit", "manual"),
            devices_per_process=2,
        ),
    ]
    for m in meshes:
        assert Mesh.from_dict(m.to_dict()) == m
        assert Mesh.from_json(m.to_json()) == m
        assert Mesh.from_string(m.to_string()) == m
        assert pickle.loads(pickle.dumps(m)) == m
    assert Mesh((2, 4), ("dp", "tp")).to_string() == "dp=2,tp=4"
    assert PERM.to_string() == "dp=2,tp=2;ids=1,0,3,2"
    assert Mesh.from_string(" dp = 2 , tp=4 ") == Mesh((2, 4), ("dp", "tp"))
    assert meshes[2].to_dict() == {
        "axis_names": ["a", "b"],
        "shape": [2, 2],
        "device_ids": [[3, 9], [4, 1]],
        "axis_types": ["explicit", "manual"],
        "devices_per_process": 2,
    }


def test_context_manager_nests():
    a, b = Mesh((2,), ("a",)), Mesh((4,), ("b",))
    assert unimesh.current_mesh() is None
    with a as entered:
        assert entered is a and unimesh.current_mesh() is a
        with b:
            assert unimesh.current_mesh() is b
            with a:
                assert unimesh.current_mesh() is a
            assert unimesh.current_mesh() is b
        assert unimesh.current_mesh() is a
    assert unimesh.current_mesh() is None
    with pytest.raises(RuntimeError), a:
        raise RuntimeError("boom")
    assert unimesh.current_mesh() is None


def test_context_is_thread_and_task_local():
    a, b = Mesh((2,), ("a",)), Mesh((4,), ("b",))
    seen: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def worker(key: str, mesh: Mesh) -> None:
        with mesh:
            barrier.wait()
            seen[key] = unimesh.current_mesh()
            barrier.wait()

    ts = [threading.Thread(target=worker, args=(k, m)) for k, m in (("a", a), ("b", b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert seen == {"a": a, "b": b}

    async def task(mesh: Mesh) -> Mesh | None:
        with mesh:
            await asyncio.sleep(0.01)
            return unimesh.current_mesh()

    async def main() -> list[Mesh | None]:
        return list(await asyncio.gather(task(a), task(b)))

    assert asyncio.run(main()) == [a, b]
    assert unimesh.current_mesh() is None


def test_failed_constructor_leaves_no_state():
    with pytest.raises(MeshSpecError):
        Mesh((2, 2), ("a", "b"), [[0, 1], [1, 2]])
    assert unimesh.current_mesh() is None


# -- axis names: every name the frameworks take (issue 50, item 5) -----------------------------
from hypothesis import given
from hypothesis import strategies as st

from unimesh._text import parse_spec_text, spec_text

_printable = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp", "Cf", "Co", "Cn")),
    min_size=1,
    max_size=12,
).filter(str.isprintable)


@given(st.lists(_printable, min_size=1, max_size=4, unique=True), st.data())
def test_any_printable_axis_names_round_trip_through_every_text_form(names, data) -> None:
    shape = tuple(data.draw(st.integers(1, 3)) for _ in names)
    ids = np.random.default_rng(len(names)).permutation(int(np.prod(shape))).reshape(shape)
    mesh = Mesh(shape, tuple(names), ids)
    assert Mesh.from_string(mesh.to_string()) == mesh
    assert Mesh.from_json(mesh.to_json()) == mesh
    assert Mesh.from_dict(mesh.to_dict()) == mesh
    entries = [names[0], None, *([tuple(names[1:])] if len(names) > 2 else names[1:])]
    assert parse_spec_text(spec_text(entries)) == entries
    assert unimesh.PartitionSpec.from_string(spec_text(entries)) == unimesh.P(*entries)


def test_axis_names_torch_tests_use_are_taken() -> None:
    """torch's own tests name mesh dims "mesh-0", "mesh-1" (test/distributed/test_device_mesh.py);
    plain words like those are written bare, others quoted as JSON strings."""
    mesh = Mesh((2, 4), ("mesh-0", "mesh-1"))
    assert mesh.to_string() == "mesh-0=2,mesh-1=4"
    assert Mesh.from_string("mesh-0=2, mesh-1=4") == mesh
    odd = Mesh((2, 2), ("data parallel", 'a,b;c="d"|e'))
    assert odd.to_string() == '"data parallel"=2,"a,b;c=\\"d\\"|e"=2'
    assert Mesh.from_string(odd.to_string()) == odd
    assert repr(odd) == "Mesh('data parallel'=2, 'a,b;c=\"d\"|e'=2)"
    assert unimesh.P.from_string('"None",_,"data parallel"+tp') == unimesh.P(
        "None", None, ("data parallel", "tp")
    )
    with pytest.raises(MeshSpecError, match="cannot read axis"):
        Mesh.from_string('"dp=2')
    with pytest.raises(unimesh.LayoutError, match="cannot read the spec"):
        unimesh.P.from_string('"dp"x,tp')
