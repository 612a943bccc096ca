"""The TensorFlow DTensor backend against DTensor's own answers, on 8 logical CPU devices.

The devices are configured when this module is collected, before any test starts TF's runtime.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import unimesh
from unimesh import Layout, Mesh, MeshMismatchError, P, UnsupportedError

from .support.strategies import meshes, specs

tf = pytest.importorskip("tensorflow")
from tensorflow.experimental import dtensor
from unimesh_tensorflow import configure_cpu_devices

configure_cpu_devices(8)

small_meshes = (
    meshes(max_ndim=4, max_size=8)
    .filter(lambda m: int(m.device_ids.max()) < 8)
    .map(lambda m: Mesh(m.shape, m.axis_names, m.device_ids))
)


def plain_spec(spec: P) -> P:
    return P(*[e[0] if isinstance(e, tuple) else e for e in spec])


@given(small_meshes)
def test_mesh_matches_dtensor(mesh: Mesh) -> None:
    native = unimesh.to_native(mesh, "tensorflow")
    assert isinstance(native, dtensor.Mesh)
    assert list(native.dim_names) == list(mesh.axis_names)
    assert tuple(native.shape()) == mesh.shape
    # DTensor numbers positions row-major; its strides and coordinates are the default layout's
    assert tuple(native.strides) == mesh.strides
    positions = mesh.device_ids.ravel().tolist()
    for pos, device_id in enumerate(positions):
        assert native.unravel_index()[pos] == mesh.coords(device_id)
        assert native.local_devices()[pos].endswith(f"CPU:{device_id}")
    assert unimesh.from_native(native) == mesh
    assert Mesh.from_string(native.to_string()) == mesh  # DTensor's own text form, no TF needed


@given(st.data())
def test_layouts_and_components_match_reference(data: st.DataObject) -> None:
    mesh = data.draw(small_meshes)
    spec = plain_spec(data.draw(specs(mesh, partial=False)))
    lay = Layout(mesh, spec)
    native = unimesh.to_native(lay, "tensorflow")
    assert isinstance(native, dtensor.Layout)
    assert unimesh.from_native(native) == lay
    shape = tuple(2 * (mesh.axis_size(e) if e else 1) for e in spec) + (3,)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    d = unimesh.distribute(x, lay, "tensorflow")
    parts = dtensor.unpack(d)
    ids = mesh.device_ids.ravel().tolist()
    assert len(parts) == len(ids)
    for pos, part in enumerate(parts):
        np.testing.assert_array_equal(part.numpy(), x[lay.shard_slices(shape, ids[pos])])
    shards = unimesh.get_backend("tensorflow").local_shards(d)
    assert set(shards) == set(ids)


def test_refusals() -> None:
    mesh = Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(UnsupportedError, match=r"'tuple_axes'.*Mesh\.flatten"):
        unimesh.to_native(Layout(mesh, P(("dp", "tp"))), "tensorflow")
    with pytest.raises(UnsupportedError, match="'uneven_shards'"):
        unimesh.distribute(np.zeros((3, 4)), Layout(mesh, P("dp", "tp")), "tensorflow")
    with pytest.raises(UnsupportedError, match="'partial'"):
        unimesh.to_native(Layout(mesh, P("dp", partial={"tp": "sum"})), "tensorflow")
    with pytest.raises(MeshMismatchError, match="TensorFlow has 8 logical CPU devices"):
        unimesh.to_native(Mesh((16,), ("dp",)), "tensorflow")
    with pytest.raises(MeshMismatchError, match=r"already initialised with 8 logical CPU devices"):
        configure_cpu_devices(4)
    with pytest.raises(
        unimesh.ConversionError, match="converts dtensor.Mesh, dtensor.Layout and DTensors"
    ):
        unimesh.from_native(tf.constant(1.0))
    configure_cpu_devices(8)  # asking again for what it has is fine


def test_single_device_mesh_is_refused_by_name() -> None:
    """``dtensor.Mesh.from_device`` (TF's mesh_util_test / layout_test build one) has no axes:
    TF's own ``global_device_ids()`` fails on it with a numpy reshape error, unimesh names it
    and says what to write instead."""
    single = dtensor.Mesh.from_device("/job:localhost/replica:0/task:0/device:CPU:0")
    assert single.is_single_device() and single.dim_names == []
    with pytest.raises(ValueError, match="cannot reshape"):  # what leaked before
        single.global_device_ids()
    with pytest.raises(UnsupportedError, match=r"single-device DTensor mesh.*Mesh\(\(1,\)"):
        unimesh.from_native(single)
    one = dtensor.create_mesh([("x", 1)], devices=["CPU:0"])  # the one-axis spelling converts
    assert unimesh.from_native(one) == Mesh((1,), ("x",))


def test_a_permuted_mesh_by_hand() -> None:
    mesh = Mesh((2, 2), ("dp", "tp"), [[3, 2], [1, 0]])
    native = unimesh.to_native(mesh, "tensorflow")
    assert native.global_device_ids().tolist() == [[0, 1], [2, 3]]
    assert [d.rsplit("/", 1)[-1] for d in native.local_devices()] == [
        "device:CPU:3",
        "device:CPU:2",
        "device:CPU:1",
        "device:CPU:0",
    ]
    x = np.arange(8.0).reshape(4, 2)
    parts = dtensor.unpack(unimesh.distribute(x, Layout(mesh, P("dp")), "tensorflow"))
    # device 3 sits at (0, 0): it holds rows 0-1
    np.testing.assert_array_equal(parts[0].numpy(), x[0:2])
    np.testing.assert_array_equal(parts[3].numpy(), x[2:4])


def test_checkpoint_round_trip_and_reshard_onto_jax(tmp_path) -> None:
    """DTensors saved with unimesh.save load back onto another DTensor layout, and onto JAX,
    bit-exact; from_native of a DTensor gives its layout."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    values = {
        "w": rng.standard_normal((8, 6)).astype(np.float32),
        "b16": rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16),
        "n": np.arange(8, dtype=np.int64).reshape(2, 4),
        "m": rng.random(8) > 0.5,
    }
    mesh = Mesh((4, 2), ("dp", "tp"), np.arange(8)[::-1].reshape(4, 2))
    saved = {"w": P("dp", "tp"), "b16": P("tp", "dp"), "n": P(), "m": P("dp")}
    tree = {
        k: unimesh.distribute(v, Layout(mesh, saved[k]), "tensorflow") for k, v in values.items()
    }
    assert unimesh.from_native(tree["w"]) == Layout(mesh, saved["w"])
    unimesh.save(tmp_path / "ck", {"tf": tree})
    ck = unimesh.open_checkpoint(tmp_path / "ck")
    assert ck.layout("tf.b16") == Layout(mesh, saved["b16"])
    assert len(ck.tensor("tf.n").boxes) == 1  # replicated: written once
    other = Mesh((2, 4), ("a", "b"))
    target = {"w": P("b", "a"), "b16": P(None, "b"), "n": P("a", "b"), "m": P("b")}
    layouts = {"tf": {k: Layout(other, s) for k, s in target.items()}}
    back = unimesh.load(tmp_path / "ck", layouts, backend="tensorflow")
    for k, want in values.items():
        got = back["tf"][k]
        assert unimesh.from_native(dtensor.fetch_layout(got)) == layouts["tf"][k]
        for d, block in unimesh.local_shards(got, "tensorflow").items():
            assert block.tobytes() == want[layouts["tf"][k].shard_slices(want.shape, d)].tobytes()
    # a native DTensor target: its layout, shape and dtype
    again = unimesh.load(tmp_path / "ck", {"tf": {"w": back["tf"]["w"]}}, strict=False)
    assert unimesh.from_native(again["tf"]["w"]) == layouts["tf"]["w"]
    jax = pytest.importorskip("jax")
    if not jax.config.jax_enable_x64:  # JAX would make int64 int32: refused, never silent
        with pytest.raises(unimesh.CheckpointError, match="'tf.n' is int64, but the jax backend"):
            unimesh.load(tmp_path / "ck", layouts, backend="jax")
        del layouts["tf"]["n"], values["n"]
    onto = unimesh.load(tmp_path / "ck", layouts, backend="jax", strict=False)
    for k, want in values.items():
        assert isinstance(onto["tf"][k], jax.Array)
        assert np.asarray(onto["tf"][k]).tobytes() == want.tobytes(), k


def test_reserved_dim_names_are_refused_by_name() -> None:
    """DTensor gives 'unsharded', 'any' and 'match' a meaning of their own: a mesh axis named
    so is an UnsupportedError naming the fix, not TF's ValueError from mesh parsing."""
    for name in ("unsharded", "any", "match"):
        with pytest.raises(UnsupportedError, match=rf"uses \['{name}'\]: rename those axes"):
            unimesh.to_native(Mesh((2, 4), (name, "tp")), "tensorflow")


def test_reshard_on_one_mesh_is_dtensor_relayout() -> None:
    """unimesh.reshard of a TF DTensor on its own mesh is ``dtensor.relayout``: the target's
    layout, each component the target block, the plan's bytes copied between devices; onto
    another mesh it goes block by block (the plan), to the same values. (Gradients: inside
    ``tf.function`` only, below; TF's eager tape fails on DTensors before any reshard, ``Mul
    got a regular tensor``.)"""
    mesh = Mesh((2, 4), ("dp", "tp"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 8
    source, target = Layout(mesh, P("dp", "tp")), Layout(mesh, P("tp", None))
    d = unimesh.distribute(x, source, "tensorflow")
    stats: dict[str, int] = {}
    moved = unimesh.reshard(d, target, stats=stats)
    assert unimesh.from_native(dtensor.fetch_layout(moved)) == target
    ids = mesh.device_ids.ravel().tolist()
    for pos, part in enumerate(dtensor.unpack(moved)):
        np.testing.assert_array_equal(part.numpy(), x[target.shard_slices((8, 8), ids[pos])])
    # every element of a device's target block that its own source block lacks comes from
    # another device (counted with numpy masks)
    lacking = 0
    for dev in ids:
        need, held = np.zeros((8, 8), bool), np.zeros((8, 8), bool)
        need[target.shard_slices((8, 8), dev)] = True
        held[source.shard_slices((8, 8), dev)] = True
        lacking += int((need & ~held).sum())
    assert stats == {"bytes_sent": 0, "bytes_received": 0, "bytes_copied": lacking * 4}
    other = Layout(Mesh((8,), ("x",), device_ids=list(range(7, -1, -1))), P("x"))
    there = unimesh.reshard(d, other)
    other_ids = other.mesh.device_ids.ravel().tolist()
    for pos, part in enumerate(dtensor.unpack(there)):
        np.testing.assert_array_equal(part.numpy(), x[other.shard_slices((8, 8), other_ids[pos])])


@pytest.mark.parametrize(
    ("source_spec", "target_spec", "variable"),
    [
        (P("dp", "tp"), P("tp", None), False),
        (P(), P("dp", "tp"), False),
        (P("dp", "tp"), P(None, "dp"), True),
    ],
)
def test_reshard_inside_tf_function_is_relayout_and_differentiable(
    source_spec: P, target_spec: P, variable: bool
) -> None:
    """Inside ``tf.function`` (where TF's DTensor gradients work) reshard is
    ``dtensor.relayout`` of the symbolic tensor, TF's own differentiable move: for
    L(x) = sum(reshard(x) * w), L is numpy's and dL/dx is w laid out as x (a replicated x's
    every replica gets the whole w, as jax.grad and DTensor give), each block bit for bit;
    the same for a ``DVariable`` (a model's weight); AutoGraph leaves unimesh's Python as
    written (no conversion warnings)."""
    import io
    import logging

    mesh = Mesh((2, 4), ("dp", "tp"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 8
    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    source, target = Layout(mesh, source_spec), Layout(mesh, target_spec)
    d = unimesh.distribute(x, source, "tensorflow")
    if variable:  # a model's weight: DTensor's variable
        d = dtensor.DVariable(d)
    wd = unimesh.distribute(w, target, "tensorflow")

    @tf.function
    def step(a: object) -> object:
        with tf.GradientTape() as tape:
            tape.watch(a)
            moved = unimesh.reshard(a, target)
            loss = tf.reduce_sum(moved * wd)
        return loss, tape.gradient(loss, a)

    caught = io.StringIO()
    handler = logging.StreamHandler(caught)
    logging.getLogger("tensorflow").addHandler(handler)
    try:
        loss, grad = step(d)
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert "AutoGraph" not in caught.getvalue(), caught.getvalue()
    assert float(dtensor.unpack(loss)[0]) == pytest.approx(float((x * w).sum()), rel=1e-6)
    assert unimesh.from_native(dtensor.fetch_layout(grad)) == source
    ids = mesh.device_ids.ravel().tolist()
    for pos, part in enumerate(dtensor.unpack(grad)):
        np.testing.assert_array_equal(part.numpy(), w[source.shard_slices((8, 8), ids[pos])])
    if variable:  # its layout is read inside tf.function; another mesh is refused by name
        other = Layout(Mesh((8,), ("x",), device_ids=list(range(7, -1, -1))), P("x"))

        # (autograph=False: AutoGraph re-raises an exception whose constructor takes more
        # than a message as its own StagingError, carrying the same message)
        @tf.function(autograph=False)
        def elsewhere(a: object) -> object:
            found = unimesh.layout_of(a)
            assert found is not None and found[1] == source
            return unimesh.reshard(a, other)

        with pytest.raises(UnsupportedError, match="inside tf.function.*changes mesh"):
            elsewhere(d)
