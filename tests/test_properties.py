"""Property tests: the Mesh and Layout methods agree with each other and with plain numpy."""

from __future__ import annotations

import contextlib
import itertools
import json
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from unimesh import Layout, Mesh, MeshSpecError, UnimeshError

from .support.strategies import axes_of, meshes, specs


def ref_coords(mesh: Mesh) -> dict[int, dict[str, int]]:
    out = {}
    for idx in itertools.product(*(range(s) for s in mesh.shape)):
        out[int(mesh.device_ids[idx])] = dict(zip(mesh.axis_names, idx))
    return out


def ref_groups(mesh: Mesh, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    others = [n for n in mesh.axis_names if n not in axes]
    groups = []
    for fixed in itertools.product(*(range(mesh.axis_size(n)) for n in others)):
        coord = dict(zip(others, fixed))
        members = []
        for var in itertools.product(*(range(mesh.axis_size(n)) for n in axes)):
            coord.update(zip(axes, var))
            members.append(int(mesh.device_ids[tuple(coord[n] for n in mesh.axis_names)]))
        groups.append(tuple(members))
    return groups


@given(meshes())
def test_coords_device_at_unravel(mesh: Mesh) -> None:
    ref = ref_coords(mesh)
    assert mesh.unravel_index() == ref
    for d, c in ref.items():
        assert mesh.coords(d) == c
        assert mesh.device_at(**c) == d
    ids = list(ref)
    np.testing.assert_array_equal(
        mesh.coords_array(ids), [[ref[d][n] for n in mesh.axis_names] for d in ids]
    )


@given(st.data())
def test_groups_and_submeshes(data: st.DataObject) -> None:
    mesh = data.draw(meshes())
    axes = data.draw(axes_of(mesh))
    ref = ref_groups(mesh, axes)
    assert mesh.groups(axes) == ref
    assert sorted(d for g in ref for d in g) == sorted(mesh.device_ids.ravel().tolist())
    subs = mesh.submeshes(axes)
    assert [tuple(s.device_ids.ravel().tolist()) for s in subs] == ref
    d = data.draw(st.sampled_from(mesh.device_ids.ravel().tolist()))
    sub = mesh.submesh(axes, containing=d)
    assert sub.axis_names == axes and sub.shape == tuple(mesh.axis_size(n) for n in axes)
    assert d in sub.device_ids
    assert tuple(sub.device_ids.ravel().tolist()) in ref
    # within the submesh, d's coordinates are its coordinates in the mesh
    assert sub.coords(d) == {n: mesh.coords(d)[n] for n in axes}


@given(st.data())
def test_flatten_unflatten(data: st.DataObject) -> None:
    mesh = data.draw(meshes())
    axes = data.draw(axes_of(mesh))
    if (
        mesh.axis_types is not None
        and len({mesh.axis_types[mesh.axis_names.index(a)] for a in axes}) > 1
    ):
        mesh = Mesh(
            mesh.shape,
            mesh.axis_names,
            mesh.device_ids,
            devices_per_process=mesh.devices_per_process,
        )
    flat = mesh.flatten(axes, "merged")
    sizes = [mesh.axis_size(a) for a in axes]
    for d in mesh.device_ids.ravel().tolist():
        c = mesh.coords(d)
        want = {n: c[n] for n in mesh.axis_names if n not in axes}
        want["merged"] = int(np.ravel_multi_index([c[a] for a in axes], sizes))
        assert flat.coords(d) == want
    assert flat.groups("merged") == mesh.groups(axes)
    back = flat.unflatten("merged", {a: mesh.axis_size(a) for a in axes})
    order = [n for n in flat.axis_names if n != "merged"]
    at = flat.axis_names.index("merged")
    order[at:at] = list(axes)
    assert back == mesh.transpose(order)


@given(meshes())
def test_serial_round_trips(mesh: Mesh) -> None:
    assert Mesh.from_dict(mesh.to_dict()) == mesh
    assert Mesh.from_json(mesh.to_json()) == mesh
    assert Mesh.from_string(mesh.to_string()) == mesh
    assert Mesh.from_json(json.dumps(json.loads(mesh.to_json()))) == mesh


def ref_block(mesh: Mesh, spec, shape, d) -> list[tuple[int, int]]:
    c = mesh.coords(d)
    out = []
    for i, n in enumerate(shape):
        lo, hi = 0, n
        entry = spec[i] if i < len(spec) else None
        for ax in () if entry is None else (entry,) if isinstance(entry, str) else entry:
            parts = mesh.axis_size(ax)
            step = math.ceil((hi - lo) / parts) if hi > lo else 0
            lo, hi = min(lo + c[ax] * step, hi), min(lo + (c[ax] + 1) * step, hi)
        out.append((n, n) if lo == hi else (lo, hi))  # torch's offset for an empty shard
    return out


@given(st.data())
def test_device_slices_tile_the_array(data: st.DataObject) -> None:
    mesh = data.draw(meshes(max_size=64))
    spec = data.draw(specs(mesh))
    lay = Layout(mesh, spec)
    extra = data.draw(st.integers(0, 1))
    shape = tuple(data.draw(st.integers(0, 9)) for _ in range(len(spec) + extra))
    count = np.zeros(shape, dtype=np.int64)
    slices = lay.device_slices(shape)
    assert set(slices) == set(mesh.device_ids.ravel().tolist())
    for d, sl in slices.items():
        assert len(sl) == len(shape)
        for s, n in zip(sl, shape):
            assert 0 <= s.start <= s.stop <= n
        assert [(s.start, s.stop) for s in sl] == ref_block(mesh, spec, shape, d)
        assert lay.shard_shape(shape, d) == tuple(s.stop - s.start for s in sl)
        count[sl] += 1
    replicated = math.prod(mesh.axis_size(a) for a in mesh.axis_names if a not in spec.axes())
    assert (count == replicated).all()


@given(st.data())
def test_placements_round_trip(data: st.DataObject) -> None:
    mesh = data.draw(meshes(max_size=64))
    spec = data.draw(specs(mesh))
    lay = Layout(mesh, spec)
    back = Layout.from_placements(mesh, lay.placements(), len(spec))
    shape = (6,) * len(spec)
    assert back.device_slices(shape) == lay.device_slices(shape)
    assert back.spec.partial == spec.partial
    has_unit = any(mesh.axis_size(a) == 1 for e in spec if isinstance(e, tuple) for a in e)
    if not has_unit:
        assert back == lay


# -- parsers under random input ------------------------------------------------------------------
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-10, 10**20)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=12), kids, max_size=5)
    ),
    max_leaves=30,
)
mesh_dicts = st.fixed_dictionaries(
    {},
    optional={
        "shape": json_values | st.lists(st.integers(-2, 5), max_size=4),
        "axis_names": json_values | st.lists(st.sampled_from(["a", "b", "a", "", "1"]), max_size=4),
        "device_ids": json_values | st.lists(st.lists(st.integers(-1, 9), max_size=4), max_size=4),
        "axis_types": json_values | st.lists(st.sampled_from(["auto", "x"]), max_size=4),
        "devices_per_process": json_values,
    },
)


def _only_unimesh_errors(fn, arg) -> None:
    with contextlib.suppress(UnimeshError):
        fn(arg)


@given(
    st.text(max_size=60)
    | st.from_regex(
        r"[a-z]{1,3}=\d{1,3}(,[a-z]{1,3}=\d{1,3}){0,3}(;[a-z_]{2,11}=[\d,a-z]{0,12}){0,3}"
    )
)
def test_from_string_random_text(text: str) -> None:
    _only_unimesh_errors(Mesh.from_string, text)


@given(st.text(max_size=80) | json_values.map(json.dumps) | mesh_dicts.map(json.dumps))
def test_from_json_random_text(text: str) -> None:
    _only_unimesh_errors(Mesh.from_json, text)


@given(json_values | mesh_dicts)
def test_from_dict_random_values(value: object) -> None:
    _only_unimesh_errors(Mesh.from_dict, value)


def test_from_string_rejects_before_allocating() -> None:
    import pytest

    with pytest.raises(MeshSpecError, match="more than unimesh supports"):
        Mesh.from_string("a=1000000,b=1000000")
