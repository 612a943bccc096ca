"""The Keras backend (Keras 3 on JAX, 8 virtual CPU devices): objects, round trips, and a real
fit under a neutral dp=2,tp=4 distribution whose variable shardings are checked by JAX."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import unimesh
from unimesh import Layout, LayoutMap, Mesh, P, UnsupportedError

from .support.strategies import meshes, specs

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover - KERAS_BACKEND came too late
    pytest.skip("these tests run Keras on JAX", allow_module_level=True)
import jax
from keras import distribution as kd
from unimesh_jax import global_devices
from unimesh_keras import distribution

MESH = Mesh((2, 4), ("dp", "tp"), np.arange(8)[::-1].reshape(2, 4))


def test_mesh_layout_and_map_round_trips():
    dm = unimesh.to_native(MESH, "keras")
    assert isinstance(dm, kd.DeviceMesh)
    devices = kd.list_devices()
    assert np.asarray(dm.devices).tolist() == [
        [devices[i] for i in row] for row in MESH.device_ids.tolist()
    ]
    assert unimesh.from_native(dm) == MESH
    lay = Layout(MESH, P(None, "tp"))
    tl = unimesh.to_native(lay, "keras")
    assert isinstance(tl, kd.TensorLayout) and tuple(tl.axes) == (None, "tp")
    assert unimesh.from_native(tl) == lay
    lm = LayoutMap(
        MESH, {"dense.*kernel": (None, "tp"), "dense.*bias": ("tp",), ".*emb.*": ("dp",)}
    )
    klm = unimesh.to_native(lm, "keras")
    assert isinstance(klm, kd.LayoutMap)
    assert unimesh.from_native(klm) == lm
    # the same lookups, Keras's and ours
    for path in [
        "dense/kernel",
        "dense_3/bias",
        "model/emb/embeddings",
        "conv/kernel",
        "model/dense/kernel",
        "dense.*kernel",
    ]:
        ours, theirs = lm.get(path), klm[path]
        assert (ours is None) == (theirs is None), path
        if ours is not None:
            assert tuple(theirs.axes) == tuple(ours.spec), path


def test_tuple_entries_suggest_flatten():
    with pytest.raises(UnsupportedError, match=r"'tuple_axes'.*Mesh\.flatten"):
        unimesh.to_native(Layout(MESH, P(("dp", "tp"))), "keras")
    flat = MESH.flatten(("dp", "tp"), "dp_tp")
    assert tuple(unimesh.to_native(Layout(flat, P("dp_tp")), "keras").axes) == ("dp_tp",)


def test_distribution_helper_and_fit():
    mesh = Mesh((2, 4), ("dp", "tp"))
    rules = LayoutMap(
        mesh,
        {
            ".*up/kernel": (None, "tp"),
            ".*up/bias": ("tp",),
            ".*down/kernel": ("tp", None),
            ".*down/bias": (None,),
        },
    )
    dp_only = distribution(Mesh((8,), ("dp",)))
    assert isinstance(dp_only, kd.DataParallel)
    dist = distribution(mesh, rules, batch_dim_name="dp")
    assert isinstance(dist, kd.ModelParallel)
    kd.set_distribution(dist)
    try:
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, name="up"),
                keras.layers.Dense(4, name="down"),
            ]
        )
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32, 8)).astype("float32")
        y = rng.normal(size=(32, 4)).astype("float32")
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])
        devs = global_devices()
        checked = 0
        for v in model.weights:
            layout = rules.get(v.path)
            assert layout is not None, v.path
            sharding = v.value.sharding
            theirs = {
                devs.index(d): tuple(s.indices(n)[:2] for s, n in zip(idx, v.shape))
                for d, idx in sharding.devices_indices_map(tuple(v.shape)).items()
            }
            ours = {
                d: tuple((s.start, s.stop) for s in sl)
                for d, sl in layout.device_slices(tuple(v.shape)).items()
            }
            assert theirs == ours, v.path
            assert unimesh.from_native(sharding).spec == P(*layout.spec) or unimesh.from_native(
                sharding
            ).device_slices(tuple(v.shape)) == layout.device_slices(tuple(v.shape))
            checked += 1
        assert checked == 4
    finally:
        kd.set_distribution(None)


CONFIG = """
# one neutral file: the mesh, the variable layouts, the batch axis
mesh = "batch=2,model=4;ids=7,6,5,4,3,2,1,0"
batch_axis = "batch"

[layout]
".*up/kernel" = "_,model"
".*up/bias" = ["model"]
".*down/kernel" = ["model", "_"]
".*down/bias" = "_"
"""


def test_distribution_from_a_toml_config(tmp_path):
    """A TOML config file -> Keras ModelParallel: the same objects Keras builds by hand, and a
    fit whose variables JAX places on the config's blocks."""
    path = tmp_path / "dist.toml"
    path.write_text(CONFIG)
    config = unimesh.load_config(path)
    dist = distribution(config)
    assert isinstance(dist, kd.ModelParallel)
    assert dist.batch_dim_name == "batch"
    native = dist._layout_map
    devs = np.array(keras.distribution.list_devices(), dtype=object)[::-1].reshape(2, 4)
    by_hand = kd.DeviceMesh((2, 4), ["batch", "model"], devices=devs)
    assert np.array_equal(native.device_mesh.devices, by_hand.devices)
    assert native[".*up/kernel"].axes == (None, "model")
    assert native[".*down/kernel"].axes == ("model", None)
    assert native[".*down/bias"].axes == (None,)
    kd.set_distribution(dist)
    try:
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, name="up"),
                keras.layers.Dense(4, name="down"),
            ]
        )
        model.compile(optimizer="sgd", loss="mse")
        x = np.ones((16, 8), "float32")
        model.fit(x, np.zeros((16, 4), "float32"), batch_size=8, epochs=1, verbose=0)
        devices = global_devices()
        for v in model.weights:
            layout = config.layout_map.get(v.path)
            theirs = {
                devices.index(d): tuple(s.indices(n)[:2] for s, n in zip(idx, v.shape))
                for d, idx in v.value.sharding.devices_indices_map(tuple(v.shape)).items()
            }
            ours = {
                d: tuple((s.start, s.stop) for s in sl)
                for d, sl in layout.device_slices(tuple(v.shape)).items()
            }
            assert theirs == ours, v.path
    finally:
        kd.set_distribution(None)
    with pytest.raises(unimesh.ConversionError, match="from the config"):
        distribution(config, batch_dim_name="batch")


def test_bad_helper_inputs():
    with pytest.raises(unimesh.LayoutError, match="batch_dim_name 'batch' is not an axis"):
        distribution(MESH, batch_dim_name="batch")
    with pytest.raises(unimesh.LayoutError, match="the layout map is on"):
        distribution(MESH, LayoutMap(Mesh((8,), ("dp",)), {}))
    with pytest.raises(unimesh.ConversionError, match="needs a unimesh.Mesh"):
        distribution("dp=2,tp=4")


def test_keras_on_torch_builds_objects_but_refuses_distribution():
    pytest.importorskip("torch")
    code = (
        "import json, unimesh\n"
        "from unimesh import Mesh, Layout, P\n"
        "from unimesh_keras import distribution\n"
        "m = Mesh((1,), ('dp',))\n"
        "out = {'mesh': type(unimesh.to_native(m, 'keras')).__name__,\n"
        "       'layout': type(unimesh.to_native(Layout(m, P('dp')), 'keras')).__name__}\n"
        "try:\n"
        "    distribution(m)\n"
        "except unimesh.UnsupportedError as exc:\n"
        "    out['error'] = str(exc)\n"
        "print(json.dumps(out))\n"
    )
    env = dict(os.environ, KERAS_BACKEND="torch")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mesh"] == "DeviceMesh" and out["layout"] == "TensorLayout"
    assert "Keras's 'torch' backend has none" in out["error"]


def test_jax_devices_are_what_keras_lists():
    assert [str(d).lower() for d in kd.list_devices()] == [
        f"{d.platform}:{d.id}" for d in jax.devices()
    ]


def _keras_spec(spec: P) -> P:
    """The spec without tuple entries (Keras has none) and without pending reductions."""
    return P(*[e[0] if isinstance(e, tuple) else e for e in spec])


@given(st.data())
def test_random_round_trips(data: st.DataObject) -> None:
    mesh = data.draw(
        meshes(max_ndim=4, max_size=8)
        .filter(lambda m: int(m.device_ids.max()) < 8)
        .map(lambda m: Mesh(m.shape, m.axis_names, m.device_ids))
    )
    lay = Layout(mesh, _keras_spec(data.draw(specs(mesh, partial=False))))
    assert unimesh.from_native(unimesh.to_native(mesh, "keras")) == mesh
    assert unimesh.from_native(unimesh.to_native(lay, "keras")) == lay
    lm = LayoutMap(mesh, {"a/.*": lay.spec, ".*/b": P()})
    assert unimesh.from_native(unimesh.to_native(lm, "keras")) == lm


def test_reshard_of_a_keras_variable_moves_on_jax():
    """A Keras variable laid out by a distribution reshards through JAX's transport (its
    compiled reshard on one device list, device-to-device pieces onto other devices): the
    result is JAX's array, laid out as the target, with the variable's values; the bytes
    copied between devices are the plan's."""
    from unimesh.moves import plan

    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    source = Layout(MESH, P("dp", "tp"))
    rules = LayoutMap(MESH)
    rules["w"] = P("dp", "tp")
    with distribution(MESH, layout_map=rules).scope():
        variable = keras.Variable(x, name="w")
    assert unimesh.from_native(variable.value.sharding) == source
    for target in (
        Layout(MESH, P("tp", None)),  # the same devices: XLA's reshard
        Layout(Mesh((8,), ("x",)), P(None, "x")),  # another order: the plan's pieces
    ):
        stats: dict[str, int] = {}
        moved = unimesh.reshard(variable, target, stats=stats)
        assert isinstance(moved, jax.Array)
        assert moved.sharding.is_equivalent_to(unimesh.to_native(target, "jax"), 2)
        np.testing.assert_array_equal(np.asarray(moved), x)
        want = plan(source, target, (8, 8), 4, np.zeros(8, np.int64), 0).stats()
        assert stats == want and stats["bytes_copied"] > 0
