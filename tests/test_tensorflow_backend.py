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

from .strategies import meshes, specs

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
    with pytest.raises(unimesh.ConversionError, match="converts dtensor.Mesh and dtensor.Layout"):
        unimesh.from_native(tf.constant(1.0))
    configure_cpu_devices(8)  # asking again for what it has is fine


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
