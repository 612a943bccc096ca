"""Keras's own distribution tests, ported to unimesh_keras (the regression net of the fidelity
issue). Source: keras-team/keras at commit 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60
(2026-08-21), keras/src/distribution/distribution_lib_test.py and
keras/src/backend/jax/distribution_lib_test.py. Each test runs Keras's own objects beside
unimesh's in the same run and compares their answers (no expected value copied from Keras's
tests). Keras's mocked process counts become real multi-process JAX runs here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import unimesh
from unimesh import Layout, LayoutMap, Mesh, P

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover - KERAS_BACKEND came too late
    pytest.skip("these tests run Keras on JAX", allow_module_level=True)
from jax.sharding import PartitionSpec as JP
from keras import distribution as kd
from keras import layers, models
from unimesh_keras import distribution

SOURCE = "keras-team/keras @ 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60"


def _native(mesh: Mesh) -> kd.DeviceMesh:
    return unimesh.to_native(mesh, "keras")


# -- DeviceMeshTest ---------------------------------------------------------------------------
def test_mesh_creation_flat_devices_read_row_major() -> None:
    """DeviceMeshTest.test_mesh_creation: a flat list of 8 devices for a (4, 2) mesh."""
    devices = kd.list_devices()
    theirs = kd.DeviceMesh((4, 2), ["batch", "model"], devices)
    ours = _native(Mesh((4, 2), ("batch", "model"), list(range(8))))
    assert ours.shape == theirs.shape
    assert list(ours.axis_names) == list(theirs.axis_names)
    assert np.asarray(ours.devices).tolist() == np.asarray(theirs.devices).tolist()
    permuted = [3, 2, 1, 0, 7, 6, 5, 4]
    theirs = kd.DeviceMesh((4, 2), ["batch", "model"], [devices[i] for i in permuted])
    ours = _native(Mesh((4, 2), ("batch", "model"), permuted))
    assert np.asarray(ours.devices).tolist() == np.asarray(theirs.devices).tolist()


@pytest.mark.parametrize(
    ("shape", "names", "count"),
    [((4,), "", 4), ((4, 2), ["batch"], 4), ((4, 2), ["batch", "model"], 4)],
)
def test_mesh_input_validation(shape: tuple[int, ...], names: object, count: int) -> None:
    """DeviceMeshTest.test_input_validation: what Keras refuses, unimesh refuses."""
    devices = kd.list_devices()[:count]
    with pytest.raises(ValueError):
        kd.DeviceMesh(shape, names, devices)
    with pytest.raises(unimesh.MeshSpecError):
        Mesh(shape, names, list(range(count)))  # type: ignore[arg-type]


# -- TensorLayoutTest -------------------------------------------------------------------------
def test_tensor_layout_creation_and_validation() -> None:
    mesh = Mesh((4, 2), ("data", "model"))
    layout = unimesh.to_native(Layout(mesh, P("data", None)), "keras")
    theirs = kd.TensorLayout(("data", None), _native(mesh))
    assert tuple(layout.axes) == tuple(theirs.axes)
    with pytest.raises(ValueError, match="Invalid axis names"):
        kd.TensorLayout(("data", "unknown", None), _native(mesh))
    with pytest.raises(unimesh.LayoutError, match="unknown"):
        Layout(mesh, P("data", "unknown", None))


# -- LayoutMapTest ----------------------------------------------------------------------------
@pytest.fixture
def maps() -> tuple[LayoutMap, kd.LayoutMap]:
    mesh = Mesh((4, 2), ("data", "model"))
    return LayoutMap(mesh), kd.LayoutMap(_native(mesh))


def _axes(layout: object) -> object:
    if layout is None:
        return None
    if isinstance(layout, Layout):
        return tuple(layout.spec)
    return tuple(layout.axes)  # type: ignore[attr-defined]


def test_layout_map_add(maps: tuple[LayoutMap, kd.LayoutMap]) -> None:
    ours, theirs = maps
    for key, axes in [("dense/kernel", (None, "model")), ("dense/bias", ("model",))]:
        ours[key] = P(*axes)
        theirs[key] = kd.TensorLayout(list(axes))
    ours["conv/bias"] = ("model",)
    theirs["conv/bias"] = ("model",)
    assert len(ours) == len(theirs) == 3
    for key in ("dense/kernel", "dense/bias", "conv/bias"):
        assert _axes(ours[key]) == _axes(theirs[key])
    with pytest.raises(ValueError, match="dense/kernel already exist"):
        theirs["dense/kernel"] = kd.TensorLayout([None, "model"])
    with pytest.raises(unimesh.LayoutError, match="'dense/kernel' is already set"):
        ours["dense/kernel"] = P(None, "model")
    assert _axes(ours["dense/kernel"]) == (None, "model")  # the first one stays
    with pytest.raises(unimesh.LayoutError, match="already set"):
        LayoutMap(Mesh((4, 2), ("data", "model")), [("k", P()), ("k", P("data"))])


def test_layout_map_get(maps: tuple[LayoutMap, kd.LayoutMap]) -> None:
    ours, theirs = maps
    rules = [
        ("dense/kernel", (None, "model")),
        ("dense/bias", ("model",)),
        (".*dense.*kernel", (None, None)),
        (".*dense.*bias", (None,)),
        (".*bias", ("model",)),
    ]
    for key, axes in rules:
        ours[key] = P(*axes)
        theirs[key] = kd.TensorLayout(list(axes))
    for path in ("dense/kernel", "dense/bias", "dense_2/kernel", "conv2d/kernel", "conv2d/bias"):
        assert _axes(ours[path]) == _axes(theirs[path]), path
    with pytest.raises(ValueError, match="matches multiple layout"):
        theirs["dense_2/bias"]
    with pytest.raises(unimesh.LayoutError, match="matches more than one LayoutMap key"):
        ours["dense_2/bias"]


def test_layout_map_delete_len_iter(maps: tuple[LayoutMap, kd.LayoutMap]) -> None:
    ours, theirs = maps
    for m, make in ((ours, lambda a: P(*a)), (theirs, lambda a: kd.TensorLayout(list(a)))):
        m["dense/kernel"] = make((None, "model"))
        m["dense/bias"] = make(("model",))
    assert list(ours.keys()) == list(theirs.keys()) == ["dense/kernel", "dense/bias"]
    assert [k for k, _ in ours.items()] == [k for k, _ in theirs.items()]
    assert _axes(ours.pop("dense/kernel")) == _axes(theirs.pop("dense/kernel"))
    with pytest.raises(KeyError):  # pop matches the key as written, not as a regex
        theirs.pop(".*bias")
    with pytest.raises(KeyError):
        ours.pop(".*bias")
    del theirs["dense/bias"]
    del ours["dense/bias"]
    assert len(ours) == len(theirs) == 0
    ours.update({"a/kernel": P("data")})
    assert ours.setdefault("a/kernel", P()) == Layout(ours.mesh, P("data"))
    ours.clear()
    assert len(ours) == 0


# -- ModelParallelDistributionTest ------------------------------------------------------------
def _model_parallel() -> tuple[object, object]:
    mesh = Mesh((2, 4), ("data", "model"))
    ours = distribution(
        mesh,
        LayoutMap(mesh, {".*kernel": P(None, "model"), ".*bias": P("model")}),
        batch_dim_name="data",
    )
    klm = kd.LayoutMap(_native(mesh))
    klm[".*kernel"] = kd.TensorLayout([None, "model"])
    klm[".*bias"] = kd.TensorLayout(["model"])
    theirs = kd.ModelParallel(layout_map=klm, batch_dim_name="data")
    return ours, theirs


def test_distribute_weights_and_data() -> None:
    ours, theirs = _model_parallel()
    kernel = keras.Variable(initializer=np.arange(8 * 4).reshape(8, 4), name="kernel")
    bias = keras.Variable(initializer=np.arange(4), name="bias")
    seed = keras.Variable(initializer=[0, 1], name="seed")
    for v in (kernel, bias, seed):
        assert _axes(ours.get_variable_layout(v)) == _axes(theirs.get_variable_layout(v))
    assert _axes(ours.get_data_layout((4, 2, 2))) == _axes(theirs.get_data_layout((4, 2, 2)))
    assert ours.num_model_replicas == theirs.num_model_replicas


def test_auto_shard_dataset_passes_through() -> None:
    mesh = Mesh((8,), ("batch",))
    for flag in (True, False):
        ours = distribution(mesh, auto_shard_dataset=flag)
        theirs = kd.DataParallel(device_mesh=_native(mesh), auto_shard_dataset=flag)
        assert ours.auto_shard_dataset is theirs.auto_shard_dataset is flag
        ours = distribution(Mesh((2, 4), ("data", "model")), auto_shard_dataset=flag)
        assert ours.auto_shard_dataset is flag
    with pytest.raises(unimesh.UnimeshError, match="auto_shard_dataset must be True or False"):
        distribution(mesh, auto_shard_dataset="yes")  # type: ignore[arg-type]


# -- JaxDistributionLibTest.test_variable_assignment_reuse_layout ----------------------------
def test_variable_assignment_reuse_layout() -> None:
    """A layer placed by shard_params keeps its sharding on assign(), as one built under the
    distribution's scope does (Keras's test builds it in the scope; both are run here)."""
    mesh = Mesh((2, 4), ("batch", "model"))
    lm = LayoutMap(mesh, {".*dense.*kernel": P(None, "model"), ".*dense.*bias": P("model")})
    with distribution(mesh, lm, batch_dim_name="batch").scope():
        scoped = layers.Dense(8, name="dense_scoped")
        scoped.build((16, 16))
    placed = layers.Dense(8, name="dense_placed")
    placed.build((16, 16))
    unimesh.shard_params(placed, lm, backend="keras")
    rng = np.random.default_rng(0)
    for layer in (scoped, placed):
        assert layer.kernel._value.sharding.spec == JP(None, "model")
        assert layer.bias._value.sharding.spec == JP("model")
        kernel, bias = rng.normal(size=(16, 8)), rng.normal(size=8)
        layer.kernel.assign(kernel)
        layer.bias.assign(bias)
        assert layer.kernel._value.sharding.spec == JP(None, "model")
        assert layer.bias._value.sharding.spec == JP("model")
        np.testing.assert_allclose(np.asarray(layer.kernel.value), kernel, rtol=1e-6)


def test_e2e_model_parallel_model() -> None:
    """JaxDistributionLibTest.test_e2e_model_parallel_model through unimesh_keras: the weights
    get the shardings Keras's own ModelParallel gives them, and fit runs (Keras's mesh:
    (devices // 2, 2))."""
    mesh = Mesh((4, 2), ("batch", "model"))
    lm = LayoutMap(mesh, {".*dense.*kernel": P(None, "model"), ".*dense.*bias": P("model")})

    def build(dist: object) -> models.Model:
        with dist.scope():  # type: ignore[attr-defined]
            inputs = layers.Input(shape=[28, 28, 1])
            y = layers.Flatten()(inputs)
            y = layers.Dense(units=200, use_bias=False, activation="relu")(y)
            y = layers.Dropout(0.4)(y)
            y = layers.Dense(units=10, activation="softmax")(y)
            return models.Model(inputs=inputs, outputs=y)

    ours = distribution(mesh, lm, batch_dim_name="batch")
    theirs = kd.ModelParallel(layout_map=unimesh.to_native(lm, "keras"), batch_dim_name="batch")
    a, b = build(ours), build(theirs)
    for wa, wb in zip(a.weights, b.weights):
        assert wa._value.sharding.spec == wb._value.sharding.spec, wa.path
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, 28, 28, 1)), rng.normal(size=(64, 10))
    with ours.scope():
        a.compile(loss="mse")
        history = a.fit(x, y, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][-1])


# -- MultiProcessInitializeTest and test_num_processes_validation, as real processes ----------
_WORKER = textwrap.dedent(
    """
    import os, sys, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
    os.environ["KERAS_BACKEND"] = "jax"
    import unimesh
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "args":
        pid = int(os.environ.pop("WORKER_ID"))
        rank, count = unimesh.initialize(
            "jax", job_addresses=os.environ.pop("WORKER_ADDRESSES"), num_processes=4,
            process_id=pid, timeout=120)
    else:  # Keras's variables, and no backend named: the launcher detection finds Keras's
        rank, count = unimesh.initialize(timeout=120)
    import jax
    from keras import distribution as kd
    from unimesh_keras import distribution
    report = {"rank": rank, "count": count, "jax": [jax.process_index(), jax.process_count()]}
    mesh = unimesh.Mesh((3, 4), ("data", "model"))
    try:
        kd.ModelParallel(layout_map=kd.LayoutMap(unimesh.to_native(mesh, "keras")),
                         batch_dim_name="data")
        report["keras"] = "accepted"
    except ValueError as exc:
        report["keras"] = str(exc)
    try:
        distribution(mesh, unimesh.LayoutMap(mesh), batch_dim_name="data")
        report["unimesh"] = "accepted"
    except unimesh.MeshMismatchError as exc:
        report["unimesh"] = str(exc)
    ok = unimesh.Mesh((4, 3), ("data", "model"))
    report["replicas"] = distribution(ok, unimesh.LayoutMap(ok)).num_model_replicas
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["args", "env"])
def test_initialize_and_process_count_validation(tmp_path: Path, mode: str) -> None:
    """unimesh.initialize with Keras's parameters (job_addresses, num_processes, process_id)
    or Keras's KERAS_DISTRIBUTION_* variables starts a real 4-process JAX job (3 CPU devices
    each); there Keras refuses a (3, 4) mesh with 3 batch replicas for 4 processes, and
    unimesh_keras.distribution refuses it too, with a MeshMismatchError."""
    import json

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    addresses = ",".join(f"127.0.0.1:{_free_port()}" for _ in range(4))  # one per process
    procs = []
    for pid in range(4):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        if mode == "args":
            env.update(WORKER_ID=str(pid), WORKER_ADDRESSES=addresses)
        else:
            env.update(
                KERAS_DISTRIBUTION_JOB_ADDRESSES=addresses,
                KERAS_DISTRIBUTION_NUM_PROCESSES="4",
                KERAS_DISTRIBUTION_PROCESS_ID=str(pid),
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), mode, str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    for rank in range(4):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert report["rank"] == rank and report["count"] == 4
        assert report["jax"] == [rank, 4]
        assert "must be divisible by `num_model_replicas`" in report["keras"]
        assert "4 processes do not divide into its 3 batch replicas" in report["unimesh"]
        assert report["replicas"] == 4


def test_job_list_and_process_count_that_disagree_are_refused_at_once(monkeypatch) -> None:
    """Two job addresses and num_processes=3: keras.distribution.initialize refuses at once
    (its own words, checked here in the same run); unimesh.initialize did wait for a third
    process until its timeout, and now refuses with Keras's words, before starting anything."""
    import time

    two = "127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(ValueError, match="has 2 jobs, but num_processes is 3") as keras_says:
        kd.initialize(job_addresses=two, num_processes=3, process_id=0)
    for how in ("args", "env"):
        kwargs = {}
        if how == "args":
            kwargs = {"job_addresses": two, "num_processes": 3, "process_id": 0}
        else:
            monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", two)
            monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "3")
            monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "0")
        start = time.perf_counter()
        with pytest.raises(unimesh.LaunchError) as ours:
            unimesh.initialize("jax", timeout=600, **kwargs)
        assert time.perf_counter() - start < 60  # at once, not at the timeout
        assert "has 2 jobs, but num_processes is 3" in str(ours.value)
        assert str(keras_says.value).split(":")[0] in str(ours.value) or "2 jobs" in str(ours.value)


def test_initialize_with_nothing_is_one_process() -> None:
    """MultiProcessInitializeTest.test_init_with_nones: nothing given and no cluster around
    (JAX's own detection finds none here): one process."""
    assert unimesh.initialize("jax") == (0, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_processes": 0}, "num_processes (KERAS_DISTRIBUTION_NUM_PROCESSES) must be an int"),
        ({"num_processes": 2, "process_id": 2}, "process_id=2 must be in 0..num_processes-1"),
        ({"coordinator_address": "a:1", "job_addresses": "a:1"}, "not both"),
        ({"job_addresses": " , "}, "must be 'host:port'"),
        ({"process_id": True}, "process_id (KERAS_DISTRIBUTION_PROCESS_ID) must be an int"),
    ],
)
def test_initialize_refuses_bad_launch_parameters(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(unimesh.LaunchError) as info:
        unimesh.initialize("jax", **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_backends_without_launch_parameters_say_so() -> None:
    with pytest.raises(unimesh.UnsupportedError, match="takes no launch parameters"):
        unimesh.initialize("tensorflow", num_processes=1, process_id=0)
