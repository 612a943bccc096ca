"""The conformance tests. Every check goes through the backend (to_native, from_native,
distribute, local_shards) and compares with the core's reference answers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import Layout, LayoutMap, Mesh, P, UnsupportedError

WANTED_DEVICES = 8


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def backend(backend_name: str) -> unimesh.Backend:
    try:
        return unimesh.get_backend(backend_name)
    except unimesh.UnimeshError as exc:
        pytest.skip(f"backend {backend_name!r} is not usable here: {exc}")


@pytest.fixture(scope="session")
def devices(backend: unimesh.Backend) -> int:
    try:
        return backend.request_devices(WANTED_DEVICES)
    except unimesh.UnimeshError as exc:
        pytest.skip(f"backend {backend.name!r} has no devices here: {exc}")


@pytest.fixture(autouse=True)
def _capability_gate(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("unimesh_capability")
    if marker is None or "backend_name" not in request.fixturenames:
        return
    be = request.getfixturevalue("backend")
    needed = marker.args
    refusal = marker.kwargs.get("refusal", False)
    missing = [c for c in needed if c not in be.capabilities]
    if refusal and not missing:
        pytest.skip(f"capability {needed[0]!r} is declared by {be.name!r}: its own tests check it")
    if not refusal and missing:
        pytest.skip(f"capability {missing[0]!r} not declared by backend {be.name!r}")


def capability(*names: str, refusal: bool = False) -> Any:
    return pytest.mark.unimesh_capability(*names, refusal=refusal)


# -- the catalogue: meshes and specs built for the device count --------------------------------
def _mesh(key: str, n: int) -> Mesh:
    def need(ok: bool) -> None:
        if not ok:
            pytest.skip(f"mesh {key!r} cannot be built on {n} devices")

    if key == "1d":
        return Mesh((n,), ("x",))
    if key == "1d-reversed":
        need(n > 1)
        return Mesh((n,), ("x",), list(range(n))[::-1])
    if key == "2d":
        need(n % 2 == 0)
        return Mesh((2, n // 2), ("dp", "tp"))
    if key == "2d-permuted":
        need(n % 2 == 0 and n > 2)
        return Mesh((2, n // 2), ("dp", "tp"), np.arange(n)[::-1].reshape(2, n // 2))
    if key == "3d":
        need(n % 4 == 0)
        return Mesh((2, 2, n // 4), ("pp", "dp", "tp"))
    if key == "4d":
        need(n % 8 == 0)
        return Mesh((2, 2, 2, n // 8), ("pp", "dp", "cp", "tp"))
    if key == "transposed":
        need(n % 2 == 0)
        return Mesh((2, n // 2), ("dp", "tp")).transpose(("tp", "dp"))
    if key == "flattened":
        need(n % 4 == 0)
        return Mesh((2, 2, n // 4), ("pp", "dp", "tp")).flatten(("tp", "pp"), "tp_pp")
    if key == "part-of-world":
        need(n % 2 == 0)
        return Mesh((n // 2,), ("half",), np.arange(n // 2)[::-1] + n // 2)
    raise AssertionError(key)


MESHES = [
    "1d",
    "1d-reversed",
    "2d",
    "2d-permuted",
    "3d",
    "4d",
    "transposed",
    "flattened",
    "part-of-world",
]

# spec key -> (builder from axis names, extra capabilities it needs)
SPECS: dict[str, tuple[Callable[[tuple[str, ...]], P | None], tuple[str, ...]]] = {
    "replicated": (lambda a: P(), ()),
    "one-axis": (lambda a: P(a[0]), ()),
    "two-dims": (lambda a: P(a[0], a[1]) if len(a) > 1 else None, ()),
    "second-dim": (lambda a: P(None, a[-1]), ()),
    "tuple-ascending": (lambda a: P((a[0], a[1])) if len(a) > 1 else None, ("tuple_axes",)),
    "tuple-descending": (lambda a: P((a[-1], a[0])) if len(a) > 1 else None, ("tuple_axes",)),
}


def _spec_params(base: str) -> list[Any]:
    """The spec keys as parameters, each marked with the capabilities it exercises."""
    return [
        pytest.param(k, marks=capability(base, *extra), id=k) for k, (_, extra) in SPECS.items()
    ]


def _spec(key: str, mesh: Mesh) -> P:
    spec = SPECS[key][0](mesh.axis_names)
    if spec is None:
        pytest.skip(f"spec {key!r} needs more axes than {mesh!r} has")
    return spec


def _even_shape(mesh: Mesh, spec: P) -> tuple[int, ...]:
    dims = [
        2 * math.prod(mesh.axis_size(a) for a in ((e,) if isinstance(e, str) else e or ()))
        for e in spec
    ]
    return tuple(dims) + (3,)


def _refused(call: Callable[[], Any]) -> Any:
    """Run a request the backend may legitimately refuse; a refusal must be UnsupportedError
    and turns the test into a skip that says why."""
    try:
        return call()
    except UnsupportedError as exc:
        pytest.skip(f"refused: {exc}")


# -- the tests ---------------------------------------------------------------------------------
@capability("mesh")
@pytest.mark.parametrize("mesh_key", MESHES)
def test_mesh_round_trip(backend: unimesh.Backend, devices: int, mesh_key: str) -> None:
    mesh = _mesh(mesh_key, devices)
    native = _refused(lambda: unimesh.to_native(mesh, backend))
    back = unimesh.from_native(native)
    assert isinstance(back, Mesh)
    assert (back.shape, back.axis_names) == (mesh.shape, mesh.axis_names)
    np.testing.assert_array_equal(back.device_ids, mesh.device_ids)


@capability("mesh", "axis_groups")
@pytest.mark.parametrize("mesh_key", MESHES)
def test_axis_groups_are_the_neutral_groups(
    backend: unimesh.Backend, devices: int, mesh_key: str
) -> None:
    mesh = _mesh(mesh_key, devices)
    native = _refused(lambda: unimesh.to_native(mesh, backend))
    for axis in mesh.axis_names:
        groups = backend.axis_groups(native, axis)
        assert set(groups) <= set(mesh.device_ids.ravel().tolist())
        for device_id, members in groups.items():
            (want,) = [g for g in mesh.groups(axis) if device_id in g]
            assert sorted(members) == sorted(want), (axis, device_id)
            if list(want) == sorted(want):  # an increasing order: the very same order
                assert tuple(members) == want, (axis, device_id)


@pytest.mark.parametrize("spec_key", _spec_params("layout"))
@pytest.mark.parametrize("mesh_key", ["1d", "2d", "2d-permuted", "3d", "flattened"])
def test_layout_round_trip(
    backend: unimesh.Backend, devices: int, mesh_key: str, spec_key: str
) -> None:
    mesh = _mesh(mesh_key, devices)
    lay = Layout(mesh, _spec(spec_key, mesh))
    back = unimesh.from_native(_refused(lambda: unimesh.to_native(lay, backend)))
    assert isinstance(back, Layout)
    np.testing.assert_array_equal(back.mesh.device_ids, mesh.device_ids)
    shape = _even_shape(mesh, lay.spec)
    assert back.device_slices(shape) == lay.device_slices(shape)
    # size-1 axes in a tuple entry make several orders mean the same: then only blocks count
    if not any(mesh.axis_size(a) == 1 for e in lay.spec if isinstance(e, tuple) for a in e):
        assert back.spec == lay.spec


@capability("layout", "partial")
def test_partial_round_trip(backend: unimesh.Backend, devices: int) -> None:
    mesh = _mesh("2d", devices)
    mesh = Mesh(mesh.shape, mesh.axis_names, axis_types=("explicit",) * mesh.ndim)
    lay = Layout(mesh, P(mesh.axis_names[0], partial={mesh.axis_names[1]: "sum"}))
    back = unimesh.from_native(_refused(lambda: unimesh.to_native(lay, backend)))
    assert back.spec == lay.spec


@pytest.mark.parametrize("spec_key", _spec_params("distribute"))
@pytest.mark.parametrize(
    "mesh_key",
    [
        "1d",
        "1d-reversed",
        "2d",
        "2d-permuted",
        "3d",
        "4d",
        "transposed",
        "flattened",
        "part-of-world",
    ],
)
def test_distribute_gives_reference_shards(
    backend: unimesh.Backend, devices: int, mesh_key: str, spec_key: str
) -> None:
    mesh = _mesh(mesh_key, devices)
    lay = Layout(mesh, _spec(spec_key, mesh))
    shape = _even_shape(mesh, lay.spec)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    shards = backend.local_shards(_refused(lambda: unimesh.distribute(x, lay, backend)))
    assert set(shards) <= set(mesh.device_ids.ravel().tolist())
    for device_id, block in shards.items():
        np.testing.assert_array_equal(
            np.asarray(block), x[lay.shard_slices(shape, device_id)], err_msg=f"device {device_id}"
        )


@capability("distribute", "from_local")
@pytest.mark.parametrize("mesh_key", ["1d", "2d-permuted", "3d", "part-of-world"])
def test_from_local_inverts_local_shards(
    backend: unimesh.Backend, devices: int, mesh_key: str
) -> None:
    mesh = _mesh(mesh_key, devices)
    lay = Layout(mesh, P(mesh.axis_names[-1], mesh.axis_names[0] if mesh.ndim > 1 else None))
    shape = _even_shape(mesh, lay.spec)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    shards = backend.local_shards(_refused(lambda: unimesh.distribute(x, lay, backend)))
    again = unimesh.from_local(shards, lay, shape, backend=backend, dtype=x.dtype)
    back = backend.local_shards(again)
    assert sorted(back) == sorted(shards)
    for device_id, block in back.items():
        np.testing.assert_array_equal(
            np.asarray(block), x[lay.shard_slices(shape, device_id)], err_msg=f"device {device_id}"
        )


@capability("shard_params")
@pytest.mark.parametrize("mesh_key", ["1d", "2d-permuted"])
def test_shard_params_of_a_dict_of_arrays(
    backend: unimesh.Backend, devices: int, mesh_key: str
) -> None:
    """The neutral model, nested dicts and lists of arrays, laid out by a LayoutMap: each
    leaf is the backend's array holding the reference blocks; unmatched leaves replicated."""
    mesh = _mesh(mesh_key, devices)
    a = mesh.axis_names
    n = devices
    rng = np.random.default_rng(11)
    params: dict[str, Any] = {
        "embed": rng.standard_normal((2 * n, n)).astype(np.float32),
        "block": {"w": rng.standard_normal((n, 2 * n)).astype(np.float32),
                  "norm": [np.arange(n, dtype=np.float32)]},
    }  # fmt: skip
    specs = {"embed": P(a[0], a[-1] if len(a) > 1 else None), "block/w": P(None, a[0]),
             "block/norm/0": P()}  # fmt: skip
    rules = unimesh.LayoutMap(mesh, {"embed": specs["embed"], "block/w": specs["block/w"]})
    placed = _refused(lambda: unimesh.shard_params(params, rules, backend=backend))
    leaves = {"embed": (placed["embed"], params["embed"]),
              "block/w": (placed["block"]["w"], params["block"]["w"]),
              "block/norm/0": (placed["block"]["norm"][0], params["block"]["norm"][0])}  # fmt: skip
    for path, (got, x) in leaves.items():
        lay = Layout(mesh, specs[path])
        for device_id, block in backend.local_shards(got).items():
            np.testing.assert_array_equal(
                np.asarray(block), x[lay.shard_slices(x.shape, device_id)], err_msg=path
            )
    with pytest.raises(unimesh.LayoutError, match="match no parameter"):
        unimesh.shard_params(params, unimesh.LayoutMap(mesh, {"nope": P()}), backend=backend)


@capability("multi_process")
def test_processes_meet_and_exchange(backend: unimesh.Backend, devices: int) -> None:
    """The runtime hooks: this process's index and the count agree with every peer, and an
    exchange gives every process's payload in process order (one process outside a
    launcher)."""
    rank, size = backend.initialize(300.0)
    assert 0 <= rank < size
    got = backend.exchange(f"process {rank} of {size}".encode(), 300.0)
    assert got == [f"process {r} of {size}".encode() for r in range(size)]


@capability("distribute", "uneven_shards")
@pytest.mark.parametrize("mesh_key", ["1d", "2d"])
def test_uneven_shards_follow_torch_chunk(
    backend: unimesh.Backend, devices: int, mesh_key: str
) -> None:
    mesh = _mesh(mesh_key, devices)
    if mesh.size == 1:
        pytest.skip("one device cannot hold uneven shards")
    lay = Layout(mesh, P(mesh.axis_names[-1]))
    shape = (mesh.axis_size(mesh.axis_names[-1]) + 1, 2)
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    shards = backend.local_shards(_refused(lambda: unimesh.distribute(x, lay, backend)))
    for device_id, block in shards.items():
        np.testing.assert_array_equal(np.asarray(block), x[lay.shard_slices(shape, device_id)])


@capability("layout_map")
def test_layout_map_round_trip(backend: unimesh.Backend, devices: int) -> None:
    mesh = _mesh("1d", devices)
    lm = LayoutMap(mesh, {".*kernel": P(None, "x"), ".*bias": P("x")})
    back = unimesh.from_native(unimesh.to_native(lm, backend))
    assert isinstance(back, LayoutMap)
    assert [(k, v.spec) for k, v in back.items()] == [(k, v.spec) for k, v in lm.items()]


# -- programs: shard_map and the axis collectives ---------------------------------------------
def _assemble(mesh: Mesh, spec: P, block_of: Callable[[int], np.ndarray]) -> np.ndarray:
    """The global array whose block on each device (under ``spec``) is ``block_of(device)``."""
    first = block_of(int(mesh.device_ids.flat[0]))
    lay = Layout(mesh, spec)
    shape = lay.global_shape(first.shape)
    out = np.zeros(shape, dtype=first.dtype)
    for device in mesh.device_ids.ravel().tolist():
        out[lay.shard_slices(shape, device)] = block_of(device)
    return out


def _axis_sets(mesh: Mesh) -> list[tuple[str, ...]]:
    names = mesh.axis_names
    sets: list[tuple[str, ...]] = [(a,) for a in names]
    if len(names) > 1:
        sets += [(names[0], names[-1]), (names[-1], names[0])]
    return sets


@capability("shard_map")
@pytest.mark.parametrize("mesh_key", ["1d", "1d-reversed", "2d", "2d-permuted", "3d"])
def test_shard_map_collectives(backend: unimesh.Backend, devices: int, mesh_key: str) -> None:
    """psum / pmean / pmax / pmin / axis_index / all_gather over every axis and over pairs of
    axes in both orders, against the core's groups (members in row-major order of the axes)."""
    mesh = _mesh(mesh_key, devices)
    spec = P(*mesh.axis_names)
    shape = tuple(2 * n for n in mesh.shape) + (3,)
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    lay = Layout(mesh, spec)
    placed = _refused(lambda: unimesh.distribute(x, lay, backend))

    def block(device: int) -> np.ndarray:
        return x[lay.shard_slices(shape, device)]

    stacked = P(None, *spec)
    for axes in _axis_sets(mesh):

        def body(b: Any, axes: tuple[str, ...] = axes) -> tuple[Any, ...]:
            return (
                unimesh.psum(b, axes),
                unimesh.pmean(b, axes),
                unimesh.pmax(b, axes),
                unimesh.pmin(b, axes),
                b * 0 + unimesh.axis_index(axes),
                b * 0 + unimesh.axis_size(axes),
                unimesh.all_gather(b, axes),
                unimesh.all_gather(b, axes, dim=1),
                unimesh.all_gather(b, axes, tiled=False),
            )

        program = _refused(
            lambda: unimesh.shard_map(body, mesh, spec, (spec,) * 8 + (stacked,), backend=backend)
        )
        got = [np.asarray(unimesh.full_array(a, backend=backend)) for a in program(placed)]

        def members(device: int, axes: tuple[str, ...] = axes) -> list[np.ndarray]:
            rows = mesh.groups_array(axes)
            row = rows[(rows == device).any(axis=1)][0]
            return [block(int(m)) for m in row]

        def index(device: int, axes: tuple[str, ...] = axes) -> int:
            rows = mesh.groups_array(axes)
            return int(np.flatnonzero(rows[(rows == device).any(axis=1)][0] == device)[0])

        size = math.prod(mesh.axis_size(a) for a in axes)
        want = [
            _assemble(mesh, spec, lambda d: np.sum(members(d), axis=0)),
            _assemble(mesh, spec, lambda d: np.sum(members(d), axis=0) / size),  # noqa: B023
            _assemble(mesh, spec, lambda d: np.max(members(d), axis=0)),
            _assemble(mesh, spec, lambda d: np.min(members(d), axis=0)),
            _assemble(mesh, spec, lambda d: np.full_like(block(d), index(d))),
            _assemble(mesh, spec, lambda d: np.full_like(block(d), size)),  # noqa: B023
            _assemble(mesh, spec, lambda d: np.concatenate(members(d), axis=0)),
            _assemble(mesh, spec, lambda d: np.concatenate(members(d), axis=1)),
            _assemble(mesh, stacked, lambda d: np.stack(members(d), axis=0)),
        ]
        names = [
            "psum",
            "pmean",
            "pmax",
            "pmin",
            "axis_index",
            "axis_size",
            "all_gather",
            "all_gather(dim=1)",
            "all_gather(tiled=False)",
        ]
        for name, g, w in zip(names, got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{name} over {axes}")


@capability("shard_map")
@pytest.mark.parametrize("mesh_key", ["1d-reversed", "2d-permuted", "transposed"])
def test_all_gather_follows_the_axis_index(
    backend: unimesh.Backend, devices: int, mesh_key: str
) -> None:
    """On meshes whose device order is not increasing, the k-th piece of an all_gather comes
    from the device at index k along the axes (not from the k-th lowest device id)."""
    mesh = _mesh(mesh_key, devices)
    for axes in _axis_sets(mesh):
        others = tuple(a for a in mesh.axis_names if a not in axes)

        def body(b: Any, axes: tuple[str, ...] = axes, others: tuple[str, ...] = others) -> Any:
            pieces = unimesh.all_gather(b * 0 + unimesh.axis_index(axes), axes, to="invarying")
            return unimesh.pmean(pieces, others) if others else pieces

        program = _refused(lambda: unimesh.shard_map(body, mesh, P(), P(), backend=backend))
        got = np.asarray(unimesh.full_array(program(np.zeros(1, np.float32)), backend=backend))
        np.testing.assert_array_equal(
            got,
            np.arange(math.prod(mesh.axis_size(a) for a in axes)),
            err_msg=f"all_gather over {axes}",
        )


@capability("shard_map")
def test_collectives_over_axes_where_the_value_is_equal(
    backend: unimesh.Backend, devices: int
) -> None:
    """A value equal along an axis still counts once per device there: psum gives size times
    the value, all_gather repeats it (the classic shard_map meaning, on every backend)."""
    mesh = _mesh("2d", devices)
    a, b = mesh.axis_names
    x = np.arange(2.0 * mesh.axis_size(a), dtype=np.float32)

    def body(xb: Any) -> tuple[Any, Any]:
        return unimesh.psum(xb, (a, b)), unimesh.all_gather(xb, b, to="invarying")

    program = _refused(lambda: unimesh.shard_map(body, mesh, P(a), (P(), P(a)), backend=backend))
    total, gathered = (np.asarray(unimesh.full_array(r, backend=backend)) for r in program(x))
    np.testing.assert_allclose(total, x.reshape(mesh.axis_size(a), 2).sum(0) * mesh.axis_size(b))
    np.testing.assert_allclose(
        gathered,
        np.concatenate(
            [np.tile(block, mesh.axis_size(b)) for block in x.reshape(mesh.axis_size(a), 2)]
        ),
    )


@capability("shard_map")
def test_shard_map_takes_global_arrays(backend: unimesh.Backend, devices: int) -> None:
    """Global (host) arguments are cut into the in_specs' blocks; results are whole again."""
    mesh = _mesh("2d", devices)
    a, b = mesh.axis_names
    x = np.arange(4.0 * mesh.size, dtype=np.float32).reshape(2 * mesh.shape[0], -1)
    w = np.arange(x.shape[1] * 3.0, dtype=np.float32).reshape(x.shape[1], 3)

    def matmul(xb: Any, wb: Any) -> Any:  # x split by rows over a, contraction over b
        return unimesh.psum(xb @ wb, b)

    program = _refused(
        lambda: unimesh.shard_map(matmul, mesh, (P(a, b), P(b, None)), P(a, None), backend=backend)
    )
    got = np.asarray(unimesh.full_array(program(x, w), backend=backend))
    np.testing.assert_allclose(got, x @ w, rtol=1e-5)


@capability("shard_map")
def test_shard_map_moves_arguments_laid_out_otherwise(
    backend: unimesh.Backend, devices: int
) -> None:
    """Distributed arguments whose layout differs from the in_specs are moved to them first;
    with "grad", their gradients come back through the move, laid out like the arguments."""
    mesh = _mesh("2d", devices)
    a, b = mesh.axis_names
    x = np.arange(4.0 * mesh.size, dtype=np.float32).reshape(2 * mesh.shape[0], -1) / 10
    w = np.linspace(-1, 1, x.shape[1] * 2 * mesh.shape[1], dtype=np.float32).reshape(x.shape[1], -1)

    def loss(xb: Any, wb: Any) -> Any:  # sum((x @ w) ** 2), x split (a, b), w split (b, None)
        y = unimesh.psum(xb @ wb, b)
        return unimesh.psum((y * y).sum(), a)

    program = _refused(
        lambda: unimesh.shard_map(loss, mesh, (P(a, b), P(b, None)), P(), backend=backend)
    )
    x_lay, w_lay = Layout(mesh, P(b, None)), Layout(mesh, P(None, a))
    xs = _refused(lambda: unimesh.distribute(x, x_lay, backend))
    ws = unimesh.distribute(w, w_lay, backend)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = float(((x64 @ w64) ** 2).sum())
    got = float(np.asarray(unimesh.full_array(program(xs, ws), backend=backend)))
    assert got == pytest.approx(want, rel=1e-5)
    if "grad" not in backend.capabilities:
        return
    value, (gx, gw) = unimesh.value_and_grad(program, argnums=(0, 1), backend=backend)(xs, ws)
    assert float(np.asarray(unimesh.full_array(value, backend=backend))) == pytest.approx(
        want, rel=1e-5
    )
    for grad, lay, expected in (
        (gx, x_lay, 2 * (x64 @ w64) @ w64.T),
        (gw, w_lay, 2 * x64.T @ (x64 @ w64)),
    ):
        for device, block in backend.local_shards(grad).items():  # laid out like the argument
            np.testing.assert_allclose(
                np.asarray(block),
                expected[lay.shard_slices(expected.shape, device)],
                rtol=1e-4,
                atol=1e-5,
            )


def _members(mesh: Mesh, axes: tuple[str, ...], device: int) -> tuple[list[int], int]:
    """The group along ``axes`` holding ``device`` (in index order) and the device's index."""
    rows = mesh.groups_array(axes)
    row = [int(m) for m in rows[(rows == device).any(axis=1)][0]]
    return row, row.index(device)


def _chunk(a: np.ndarray, dim: int, n: int, i: int) -> np.ndarray:
    return np.split(a, n, axis=dim)[i]


# collective name -> (program body on a block, numpy reference from (members' blocks, index))
def _collective_table(axes: tuple[str, ...], n: int) -> dict[str, tuple[Any, Any]]:
    shift = [(i, (i + 1) % n) for i in range(n)]
    partial = [(i, i + 1) for i in range(n - 1)]
    last = -1
    return {
        "psum": (lambda b: unimesh.psum(b, axes), lambda blocks, i: np.sum(blocks, axis=0)),
        "pmean": (lambda b: unimesh.pmean(b, axes), lambda blocks, i: np.mean(blocks, axis=0)),
        "all_gather": (
            lambda b: unimesh.all_gather(b, axes, dim=last),
            lambda blocks, i: np.concatenate(blocks, axis=last),
        ),
        "psum_scatter": (
            lambda b: unimesh.psum_scatter(b, axes, scatter_dimension=last, tiled=True),
            lambda blocks, i: _chunk(np.sum(blocks, axis=0), last, n, i),
        ),
        "all_to_all": (
            lambda b: unimesh.all_to_all(b, axes, split_axis=last, concat_axis=0, tiled=True),
            lambda blocks, i: np.concatenate([_chunk(x, last, n, i) for x in blocks], axis=0),
        ),
        "ppermute(shift)": (
            lambda b: unimesh.ppermute(b, axes, shift),
            lambda blocks, i: blocks[(i - 1) % n],
        ),
        "ppermute(partial)": (
            lambda b: unimesh.ppermute(b, axes, partial),
            lambda blocks, i: blocks[i - 1] if i > 0 else np.zeros_like(blocks[0]),
        ),
        "pbroadcast": (
            lambda b: unimesh.pbroadcast(b, axes, n - 1),
            lambda blocks, i: blocks[n - 1],
        ),
    }


def _collective_setup(mesh: Mesh) -> tuple[P, tuple[int, ...], np.ndarray]:
    """Every axis sharding a dim, and a last dim every group size divides."""
    spec = P(*mesh.axis_names)
    shape = tuple(2 * n for n in mesh.shape) + (2 * mesh.size,)
    x = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    return spec, shape, x


def _reference(mesh: Mesh, spec: P, x: np.ndarray, axes: tuple[str, ...], ref: Any) -> np.ndarray:
    lay = Layout(mesh, spec)

    def result(device: int) -> np.ndarray:
        row, i = _members(mesh, axes, device)
        return np.asarray(ref([x[lay.shard_slices(x.shape, m)] for m in row], i))

    return _assemble(mesh, spec, result)


@capability("shard_map")
@pytest.mark.parametrize("mesh_key", ["1d", "1d-reversed", "2d", "2d-permuted", "3d"])
def test_collectives_against_the_reference(
    backend: unimesh.Backend, devices: int, mesh_key: str
) -> None:
    """psum, pmean, all_gather, psum_scatter, all_to_all, ppermute and pbroadcast over every
    axis and pairs of axes in both orders, each device's result against numpy on the core's
    groups (members in the order of their index along the axes)."""
    mesh = _mesh(mesh_key, devices)
    spec, _, x = _collective_setup(mesh)
    placed = _refused(lambda: unimesh.distribute(x, Layout(mesh, spec), backend))
    for axes in _axis_sets(mesh):
        n = math.prod(mesh.axis_size(a) for a in axes)
        table = _collective_table(axes, n)
        program = _refused(
            lambda: unimesh.shard_map(
                lambda b: {k: op(b) for k, (op, _) in table.items()},  # noqa: B023
                mesh,
                spec,
                spec,
                backend=backend,
            )
        )
        got = program(placed)
        for name, (_, ref) in table.items():
            want = _reference(mesh, spec, x, axes, ref)
            np.testing.assert_allclose(
                np.asarray(unimesh.full_array(got[name], backend=backend)),
                want,
                rtol=1e-5,
                atol=1e-5,
                err_msg=f"{name} over {axes}",
            )


@capability("shard_map", "grad")
@pytest.mark.parametrize("mesh_key", ["1d", "1d-reversed", "2d-permuted", "3d"])
def test_collective_gradients_are_the_global_gradients(
    backend: unimesh.Backend, devices: int, mesh_key: str
) -> None:
    """For L(x) = sum over devices of <w_d, c(x)_d> (each collective c, weights w varying by
    device), unimesh.value_and_grad must give the gradient of that global function: L is
    linear, so <grad, probe> equals L(probe) computed by the numpy reference, for any probe.
    One program per axis set takes a dict of inputs, one per collective."""
    mesh = _mesh(mesh_key, devices)
    spec, shape, x = _collective_setup(mesh)
    lay = Layout(mesh, spec)
    rng = np.random.default_rng(12)
    probes = [rng.standard_normal(shape) for _ in range(2)]
    for axes in _axis_sets(mesh)[:3]:
        table = _collective_table(axes, math.prod(mesh.axis_size(a) for a in axes))
        weights = {
            name: rng.standard_normal(_reference(mesh, spec, x, axes, ref).shape).astype(np.float32)
            for name, (_, ref) in table.items()
        }

        def body(xb: dict[str, Any], wb: dict[str, Any], table: dict[str, Any] = table) -> Any:
            total = sum((wb[k] * op(xb[k])).sum() for k, (op, _) in table.items())
            return unimesh.psum(total, mesh.axis_names)

        program = _refused(
            lambda: unimesh.shard_map(body, mesh, (spec, spec), P(), backend=backend)
        )
        xs = _refused(lambda: {k: unimesh.distribute(x, lay, backend) for k in table})  # noqa: B023
        ws = {k: unimesh.distribute(w, lay, backend) for k, w in weights.items()}
        value, grads = unimesh.value_and_grad(program, backend=backend)(xs, ws)

        def loss(
            a: np.ndarray,
            name: str,
            axes: tuple[str, ...] = axes,
            table: dict[str, Any] = table,
            weights: dict[str, Any] = weights,
        ) -> float:
            return float(
                (
                    weights[name].astype(np.float64)
                    * _reference(mesh, spec, a, axes, table[name][1])
                ).sum()
            )

        total = sum(loss(x.astype(np.float64), k) for k in table)
        assert float(np.asarray(unimesh.full_array(value, backend=backend))) == pytest.approx(
            total, rel=1e-4, abs=1e-4
        ), f"loss over {axes}"
        for name in table:
            grad = np.asarray(unimesh.full_array(grads[name], backend=backend), np.float64)
            for probe in probes:
                assert float((grad * probe).sum()) == pytest.approx(
                    loss(probe, name), rel=1e-4, abs=1e-4
                ), f"gradient of {name} over {axes}"


@capability("shard_map")
def test_pytrees_of_arguments_and_results(backend: unimesh.Backend, devices: int) -> None:
    """A dict of arguments with a dict of specs, a spec standing for a whole tuple, None as an
    argument, and a list of results under one spec: jax.shard_map's prefix rules."""
    mesh = _mesh("2d", devices)
    a, b = mesh.axis_names
    shape = (2 * mesh.shape[0], 2 * mesh.shape[1])
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)

    def body(params: dict[str, Any], pair: tuple[Any, Any], nothing: None) -> Any:
        assert nothing is None
        return {"sum": [unimesh.psum(params["w"], b), pair[0] + pair[1]]}

    program = _refused(
        lambda: unimesh.shard_map(
            body, mesh, ({"w": P(a, b)}, P(a), None), {"sum": P(a)}, backend=backend
        )
    )
    got = program({"w": x}, (x, 2 * x), None)
    total, pair = (np.asarray(unimesh.full_array(r, backend=backend)) for r in got["sum"])
    lay = Layout(mesh, P(a, b))
    want = _assemble(
        mesh,
        P(a),
        lambda d: np.sum(
            [x[lay.shard_slices(shape, m)] for m in _members(mesh, (b,), d)[0]], axis=0
        ),
    )
    np.testing.assert_allclose(total, want)
    np.testing.assert_allclose(pair, 3 * x)


# -- checkpoints ----------------------------------------------------------------------------------
def _shared_dir(backend: unimesh.Backend, tmp_path: Any) -> str:
    """Process 0's temporary directory, on every process (one machine: the suite's processes
    share its disk)."""
    backend.initialize(120.0)
    return backend.exchange(str(tmp_path).encode(), 120.0)[0].decode()


def _layout(found: tuple[Any, Layout] | None) -> Layout | None:
    return None if found is None else found[1]


def _same_place(got: Layout | None, want: Layout) -> bool:
    """The same spec on the same axes and devices (the process split a native mesh carries,
    ``devices_per_process``, aside)."""
    return (
        got is not None
        and Layout(want.mesh, got.spec) == want  # P(None, None) is P(): trailing Nones aside
        and got.mesh.axis_names == want.mesh.axis_names
        and np.array_equal(got.mesh.device_ids, want.mesh.device_ids)
    )


@capability("checkpoint")
@pytest.mark.parametrize(
    ("saved_key", "loaded_key"), [("2d", "1d"), ("1d", "2d-permuted"), ("3d", "transposed")]
)
def test_checkpoint_loads_onto_another_layout(
    backend: unimesh.Backend, devices: int, saved_key: str, loaded_key: str, tmp_path: Any
) -> None:
    """unimesh.save of the backend's arrays, then unimesh.load onto another mesh and spec:
    every block bit-exact against numpy, each process reading only its blocks' bytes."""
    saved, loaded = _mesh(saved_key, devices), _mesh(loaded_key, devices)
    from unimesh.convert import layout_of

    a, b = saved.axis_names, loaded.axis_names
    rng = np.random.default_rng(7)
    n = devices
    values: dict[
        str, np.ndarray
    ] = {  # every dim a multiple of the device count: even under any spec
        "w": rng.standard_normal((2 * n, n)).astype(np.float32),
        "h": rng.standard_normal((n, 2 * n)).astype(np.float16),
        "i": np.arange(2 * n, dtype=np.int32).reshape(n, 2),
        "m": rng.random((n, 2)) > 0.5,
    }
    specs = {"w": P(a[0], a[-1] if len(a) > 1 else None), "h": P(None, a[0]), "i": P(),
             "m": P(a[-1])}  # fmt: skip
    targets = {"w": P(b[-1], b[0] if len(b) > 1 else None), "h": P(b[0], None), "i": P(b[0]),
               "m": P()}  # fmt: skip
    if "uneven_shards" in backend.capabilities and n > 1:
        values["u"] = rng.standard_normal((n + 1, 3)).astype(np.float32)
        specs["u"], targets["u"] = P(a[0]), P(None, b[-1])

    def place(k: str) -> Any:
        return _refused(lambda: unimesh.distribute(values[k], Layout(saved, specs[k]), backend))

    arrays = {k: place(k) for k in values}
    path = _shared_dir(backend, tmp_path) + "/ck"
    _refused(lambda: unimesh.save(path, {"model": arrays}, backend=backend))
    ckpt = unimesh.open_checkpoint(path)
    for k, x in values.items():
        assert _same_place(ckpt.layout(f"model.{k}"), Layout(saved, specs[k])), k
        assert ckpt.read(f"model.{k}").tobytes() == x.tobytes(), k
    layouts = {"model": {k: Layout(loaded, s) for k, s in targets.items()}}
    stats: dict[str, int] = {}
    got = _refused(lambda: unimesh.load(path, layouts, backend=backend, stats=stats))
    for k, x in values.items():
        lay = layouts["model"][k]
        assert _same_place(_layout(layout_of(got["model"][k])), lay), k
        for device_id, block in backend.local_shards(got["model"][k]).items():
            want = x[lay.shard_slices(x.shape, device_id)]
            assert np.asarray(block).tobytes() == want.tobytes(), (k, device_id)
    assert stats["bytes_read"] <= stats["bytes_held"] * 1.05


@capability("reshard")
@pytest.mark.parametrize(
    ("from_key", "to_key"), [("2d", "1d"), ("1d", "2d-permuted"), ("3d", "transposed")]
)
def test_reshard_moves_only_what_each_process_lacks(
    backend: unimesh.Backend, devices: int, from_key: str, to_key: str
) -> None:
    """unimesh.reshard of the backend's arrays (a dict of them) onto another mesh and spec:
    every block bit-exact against numpy, and each process receives exactly the bytes of its
    target blocks that none of its source blocks holds (counted with numpy masks)."""
    from unimesh.convert import layout_of

    source, target = _mesh(from_key, devices), _mesh(to_key, devices)
    a, b = source.axis_names, target.axis_names
    rng = np.random.default_rng(11)
    n = devices
    values = {
        "w": rng.standard_normal((2 * n, n)).astype(np.float32),
        "i": np.arange(2 * n, dtype=np.int32).reshape(n, 2),
        "m": rng.random((n, 2)) > 0.5,
    }
    specs = {"w": P(a[0], a[-1] if len(a) > 1 else None), "i": P(), "m": P(a[-1])}
    wanted = {"w": P(b[-1], b[0] if len(b) > 1 else None), "i": P(b[0]), "m": P()}
    if "uneven_shards" in backend.capabilities and n > 1:
        values["u"] = rng.standard_normal((n + 1, 3)).astype(np.float32)
        specs["u"], wanted["u"] = P(a[0]), P(None, b[-1])

    def place(k: str) -> Any:
        return _refused(lambda: unimesh.distribute(values[k], Layout(source, specs[k]), backend))

    arrays = {k: place(k) for k in values}
    layouts = {k: Layout(target, s) for k, s in wanted.items()}
    stats: dict[str, int] = {}
    got = _refused(lambda: unimesh.reshard(arrays, layouts, stats=stats))
    mine_source, mine_target = backend.process_devices(source), backend.process_devices(target)
    floor = 0
    for k, x in values.items():
        lay = layouts[k]
        assert _same_place(_layout(layout_of(got[k])), lay), k
        for device_id, block in backend.local_shards(got[k]).items():
            want = x[lay.shard_slices(x.shape, device_id)]
            block = np.asarray(block)
            assert block.shape == want.shape and block.dtype == want.dtype, (k, device_id)
            assert block.tobytes() == want.tobytes(), (k, device_id)
        need, held = np.zeros(x.shape, bool), np.zeros(x.shape, bool)
        for d in mine_target:
            need[lay.shard_slices(x.shape, d)] = True
        for d in mine_source:
            held[Layout(source, specs[k]).shard_slices(x.shape, d)] = True
        floor += int((need & ~held).sum()) * x.dtype.itemsize
    assert stats["bytes_received"] == floor, (stats, floor)


@capability("shard_params", refusal=True)
def test_refuses_shard_params(backend: unimesh.Backend, devices: int) -> None:
    rules = unimesh.LayoutMap(_mesh("1d", devices), {"w": P()})
    with pytest.raises(UnsupportedError):
        unimesh.shard_params({"w": np.zeros(2, np.float32)}, rules, backend=backend)


@capability("checkpoint", refusal=True)
def test_refuses_checkpoint(backend: unimesh.Backend, devices: int, tmp_path: Any) -> None:
    unimesh.save(tmp_path / "ck", {"w": np.zeros((2, 2), np.float32)})
    lay = Layout(_mesh("1d", devices), P())
    with pytest.raises(UnsupportedError):
        unimesh.load(tmp_path / "ck", {"w": lay}, backend=backend)


# -- what a backend does not declare, it must refuse with UnsupportedError ----------------------
@capability("tuple_axes", refusal=True)
def test_refuses_tuple_axes(backend: unimesh.Backend, devices: int) -> None:
    mesh = _mesh("2d", devices)
    with pytest.raises(UnsupportedError):
        unimesh.to_native(Layout(mesh, P(mesh.axis_names)), backend)


@capability("partial", refusal=True)
def test_refuses_partial(backend: unimesh.Backend, devices: int) -> None:
    mesh = _mesh("2d", devices)
    with pytest.raises(UnsupportedError):
        unimesh.to_native(Layout(mesh, P(None, partial={mesh.axis_names[0]: "sum"})), backend)


@capability("uneven_shards", refusal=True)
def test_refuses_uneven_shards(backend: unimesh.Backend, devices: int) -> None:
    mesh = _mesh("1d", devices)
    if mesh.size == 1:
        pytest.skip("one device cannot hold uneven shards")
    with pytest.raises(UnsupportedError):
        unimesh.distribute(np.zeros(mesh.size + 1), Layout(mesh, P("x")), backend)


@capability("shard_map", refusal=True)
def test_refuses_shard_map(backend: unimesh.Backend, devices: int) -> None:
    with pytest.raises(UnsupportedError):
        unimesh.shard_map(lambda x: x, _mesh("1d", devices), P(), P(), backend=backend)


@capability("grad", refusal=True)
def test_refuses_grad(backend: unimesh.Backend, devices: int) -> None:
    with pytest.raises(UnsupportedError):
        unimesh.value_and_grad(lambda x: x, backend=backend)


@capability("layout_map", refusal=True)
def test_refuses_layout_map(backend: unimesh.Backend, devices: int) -> None:
    with pytest.raises(UnsupportedError):
        unimesh.to_native(LayoutMap(_mesh("1d", devices), {"w": P("x")}), backend)
