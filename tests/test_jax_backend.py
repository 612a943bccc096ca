"""The JAX backend against JAX's own answers, on 8 virtual CPU devices."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import unimesh
from unimesh import Layout, Mesh, MeshMismatchError, P, UnsupportedError

from .support.strategies import meshes, specs

jax = pytest.importorskip("jax")
from jax.sharding import AxisType, NamedSharding
from jax.sharding import Mesh as JMesh
from jax.sharding import PartitionSpec as JP
from unimesh_jax import global_devices, use_mesh

if len(jax.devices()) < 8:  # pragma: no cover - XLA_FLAGS came too late
    pytest.skip(
        "needs 8 CPU devices (XLA_FLAGS set before jax is imported)", allow_module_level=True
    )

small_meshes = (
    meshes(max_ndim=4, max_size=8, allow_gaps=True)
    .filter(lambda m: int(m.device_ids.max()) < 8)
    .map(lambda m: Mesh(m.shape, m.axis_names, m.device_ids, axis_types=m.axis_types))
)


def expected_types(mesh: Mesh) -> tuple[str, ...] | None:
    t = mesh.axis_types
    return None if t is None or all(x == "auto" for x in t) else t


def as_ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


@given(small_meshes)
def test_mesh_devices_and_round_trip(mesh: Mesh) -> None:
    jm = unimesh.to_native(mesh, "jax")
    assert isinstance(jm, JMesh)
    devs = global_devices()
    assert jm.devices.shape == mesh.shape
    assert [d for d in jm.devices.ravel()] == [devs[i] for i in mesh.device_ids.ravel()]
    assert tuple(jm.axis_names) == mesh.axis_names
    want = (
        tuple(AxisType.Auto for _ in mesh.shape)
        if mesh.axis_types is None
        else tuple(getattr(AxisType, t.capitalize()) for t in mesh.axis_types)
    )
    assert tuple(jm.axis_types) == want
    back = unimesh.from_native(jm)
    assert back == Mesh(
        mesh.shape, mesh.axis_names, mesh.device_ids, axis_types=expected_types(mesh)
    )


@given(st.data())
def test_named_sharding_matches_reference(data: st.DataObject) -> None:
    mesh = data.draw(small_meshes)
    spec = data.draw(specs(mesh, partial=False))
    lay = Layout(mesh, spec)
    sharding = unimesh.to_native(lay, "jax")
    assert isinstance(sharding, NamedSharding)
    assert tuple(sharding.spec) == tuple(spec)
    assert unimesh.from_native(sharding) == Layout(
        Mesh(mesh.shape, mesh.axis_names, mesh.device_ids, axis_types=expected_types(mesh)), spec
    )
    shape = tuple(
        math.prod(mesh.axis_size(a) for a in ((e,) if isinstance(e, str) else e or ())) * 2
        for e in spec
    ) + (3,)
    if "manual" in (mesh.axis_types or ()):
        with pytest.raises(UnsupportedError, match="'manual', which JAX uses only inside"):
            unimesh.distribute(np.zeros(shape), lay, "jax")
        return
    # an even shape: JAX's own device -> index map is the reference
    devs = global_devices()
    theirs = {
        devs.index(d): as_ranges(idx, shape)
        for d, idx in sharding.devices_indices_map(shape).items()
    }
    ours = {d: tuple((s.start, s.stop) for s in sl) for d, sl in lay.device_slices(shape).items()}
    assert theirs == ours
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    arr = unimesh.distribute(x, lay, "jax")
    assert arr.sharding == sharding
    for shard in arr.addressable_shards:
        d = devs.index(shard.device)
        np.testing.assert_array_equal(np.asarray(shard.data), x[lay.shard_slices(shape, d)])


def test_partial_sum_is_unreduced() -> None:
    mesh = Mesh((2, 4), ("dp", "tp"), axis_types=("explicit", "explicit"))
    lay = Layout(mesh, P("dp", partial={"tp": "sum"}))
    sharding = unimesh.to_native(lay, "jax")
    assert set(sharding.spec.unreduced) == {"tp"}
    assert unimesh.from_native(sharding) == lay
    with pytest.raises(UnsupportedError, match=r"only over 'explicit' axes; \['tp'\]"):
        unimesh.to_native(Layout(Mesh((2, 4), ("dp", "tp")), P("dp", partial={"tp": "sum"})), "jax")
    with pytest.raises(UnsupportedError, match="only pending sums"):
        unimesh.to_native(Layout(mesh, P("dp", partial={"tp": "max"})), "jax")


def test_abstract_mesh_and_jax_made_meshes() -> None:
    jm = jax.make_mesh((2, 4), ("dp", "tp"))
    assert unimesh.from_native(jm) == Mesh(
        (2, 4), ("dp", "tp"), axis_types=("explicit", "explicit")
    )
    assert unimesh.from_native(jm.abstract_mesh) == Mesh(
        (2, 4), ("dp", "tp"), axis_types=("explicit", "explicit")
    )
    sh = NamedSharding(jm, JP(("tp", "dp"), None))
    assert unimesh.from_native(sh).spec == P(("tp", "dp"), None)


def test_use_mesh_activates_jax_mesh() -> None:
    mesh = Mesh((2, 4), ("dp", "tp"), axis_types=("explicit", "explicit"))
    with use_mesh(mesh) as jm:
        assert unimesh.current_mesh() is mesh
        assert jax.sharding.get_abstract_mesh() == jm.abstract_mesh
    assert unimesh.current_mesh() is None
    assert jax.sharding.get_abstract_mesh().empty


def test_refusals() -> None:
    with pytest.raises(MeshMismatchError, match="JAX sees 8 devices.*xla_force_host_platform"):
        unimesh.to_native(Mesh((16,), ("dp",)), "jax")
    lay = Layout(Mesh((2, 4), ("dp", "tp")), P("dp", "tp"))
    with pytest.raises(UnsupportedError, match=r"'uneven_shards'.*shape \(3, 8\) does not divide"):
        unimesh.distribute(np.zeros((3, 8)), lay, "jax")
    jm = unimesh.to_native(Mesh((2, 4), ("dp", "tp")), "jax")
    with pytest.raises(UnsupportedError, match="UNCONSTRAINED"):
        unimesh.from_native(NamedSharding(jm, JP("dp", JP.UNCONSTRAINED)))
    with pytest.raises(UnsupportedError, match="unknown option"):
        unimesh.to_native(Mesh((2,), ("dp",)), "jax", colour="red")
    with pytest.raises(unimesh.ConversionError, match="jax backend converts Mesh"):
        unimesh.from_native(jax.numpy.zeros(2))


def test_a_converted_layout_is_kept_and_equal_layouts_share_it() -> None:
    """Issue 40, item 5: a layout converted again is a dict lookup (the NamedSharding is an
    immutable value), with the same answer as the first conversion."""
    from jax.sharding import NamedSharding

    mesh = unimesh.Mesh((2, 4), ("dp", "tp"))
    first = unimesh.to_native(unimesh.Layout(mesh, unimesh.P("dp", "tp")), "jax")
    again = unimesh.to_native(unimesh.Layout(mesh, unimesh.P("dp", "tp")), "jax")
    assert again is first and isinstance(first, NamedSharding)
    other = unimesh.to_native(unimesh.Layout(mesh, unimesh.P("tp", "dp")), "jax")
    assert other is not first and other.spec != first.spec
    with pytest.raises(unimesh.UnimeshError):  # a refusal is never kept as an answer
        unimesh.to_native(unimesh.Layout(mesh, unimesh.P("dp", "tp")), "jax", device_type="x")


def test_a_jitted_unimesh_step_is_the_jitted_jax_shard_map_step() -> None:
    """JAX stays at 1.00: ``jax.jit`` of the value and gradient of a step written with
    ``unimesh.shard_map`` lowers to the same StableHLO as the same step written with
    ``jax.shard_map`` and ``jax.lax`` by hand (examples/mlp_step.py's loss, dp=2 x tp=4), up to
    the module's name and source locations."""
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import mlp_step

    mesh = unimesh.make_mesh({"dp": 2, "tp": 4})
    specs = (P("dp", None), P("dp", None), mlp_step.SPECS)
    ours = unimesh.shard_map(mlp_step.loss, mesh, in_specs=specs, out_specs=P(), backend="jax")

    def native_loss(x, t, params):  # type: ignore[no-untyped-def]
        pre = x @ params["w1"]
        h = pre * (pre > 0)
        y = jax.lax.psum(h @ params["w2"], "tp")
        diff = y - t
        return jax.lax.pmean((diff * diff).sum() / x.shape[0], "dp")

    native = jax.shard_map(
        native_loss,
        mesh=unimesh.to_native(mesh, "jax"),
        in_specs=(JP("dp", None), JP("dp", None), {"w1": JP(None, "tp"), "w2": JP("tp", None)}),
        out_specs=JP(),
    )
    x, t, w1, w2 = mlp_step.data()

    def hlo(step) -> str:  # type: ignore[no-untyped-def]
        text = jax.jit(jax.value_and_grad(step, argnums=2)).lower(x, t, {"w1": w1, "w2": w2})
        lines = [ln for ln in text.as_text().splitlines() if not ln.startswith("#loc")]
        out = re.sub(r"\s*loc\(#?[^)]*\)", "", "\n".join(lines))
        return re.sub(r"module @\w+", "module @step", out)

    ours_text, native_text = hlo(ours), hlo(native)
    assert "stablehlo.dot_general" in native_text and "all_reduce" in native_text
    assert ours_text == native_text


# -- partial-manual programs (shard_map's axis_names) and the rest of its signature -------------
# Ported from JAX's tests/shard_map_test.py at jax-ml/jax commit
# cec06d116c05f0d52adfceee3d3b730fdbcb0ce5: the tests' meshes, specs, bodies and expected values,
# written with unimesh.shard_map (the JAX backend hands axis_names and check_vma to
# jax.shard_map); torch and MLX run the same programs in program_cases.py.


def test_an_eager_call_is_one_compiled_computation_with_jax_s_values() -> None:
    """Called on jax.Arrays outside any trace (or under an eager gradient), a program runs
    jitted: the body is traced once for two calls of one shape (jax.shard_map's eager path
    runs it on every call, op by op), once more for a new shape; values and gradients are
    those of jax.shard_map and jax.value_and_grad, eager, and for a numpy argument too; a
    body with a Python ``if`` on a value runs, on JAX's eager path, as jax.shard_map's does."""
    mesh = unimesh.make_mesh({"dp": 2, "tp": 4})
    traced: list[tuple[int, ...]] = []

    def body(x):  # type: ignore[no-untyped-def]
        traced.append(x.shape)
        return unimesh.psum(jax.numpy.sin(x) * x, "tp")

    ours = unimesh.shard_map(body, mesh, P("dp", "tp"), P("dp"), backend="jax")
    native = jax.shard_map(
        lambda x: jax.lax.psum(jax.numpy.sin(x) * x, "tp"),
        mesh=unimesh.to_native(mesh, "jax"),
        in_specs=JP("dp", "tp"),
        out_specs=JP("dp"),
    )
    lay = unimesh.Layout(mesh, P("dp", "tp"))
    x = unimesh.distribute(np.arange(32.0, dtype=np.float32).reshape(4, 8) / 7, lay, "jax")
    want = native(x)
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(want), rtol=1e-6)
    assert len(traced) == 1
    wide = unimesh.distribute(np.ones((4, 16), np.float32), lay, "jax")
    assert ours(wide).shape == (4, 4) and len(traced) == 2

    def total(f):  # type: ignore[no-untyped-def]
        return lambda a: (f(a) ** 2).sum()

    value, grad = unimesh.value_and_grad(total(ours), backend="jax")(x)
    value_again, _ = unimesh.value_and_grad(total(ours), backend="jax")(x)
    want_value, want_grad = jax.value_and_grad(total(native))(x)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5)
    assert float(value_again) == float(value) and grad.sharding == x.sharding
    host = np.asarray(x)  # numpy: placed by jit, as jax.shard_map places it eagerly
    np.testing.assert_allclose(np.asarray(ours(host)), np.asarray(want), rtol=1e-6)

    def branchy(b):  # type: ignore[no-untyped-def]
        total = unimesh.psum(b.sum(), ("dp", "tp"))
        return b * 2 if total > 0 else b  # Python reads the value: JAX's eager path

    mine = unimesh.shard_map(branchy, mesh, P("dp", "tp"), P("dp", "tp"), backend="jax")
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(mine(x)), 2 * np.asarray(x), rtol=1e-6)


def test_partial_auto_squares() -> None:
    """test_partial_auto: mesh (2, 2), manual {'i'}, in/out P('i', None), x * x."""
    mesh = Mesh((2, 2), ("i", "j"))
    v = np.arange(32.0).reshape(4, 8)
    f = unimesh.shard_map(
        lambda x: x * x, mesh, P("i", None), P("i", None), backend="jax", axis_names={"i"}
    )
    np.testing.assert_allclose(np.asarray(jax.jit(f)(v)), v * v)
    np.testing.assert_allclose(np.asarray(f(v)), v * v)
    # the gradient of sum(f(x)) (test_partial_auto_explicit takes it): 2v
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: f(x).sum())(v)), 2 * v)


def _manual_over_i(body, spec: P = P("i")):  # noqa: B008 - a spec is immutable
    """The tests' (4, 2) mesh ("i", "j"), manual over i, check_vma off, in/out ``spec``."""
    mesh = Mesh((4, 2), ("i", "j"))
    return unimesh.shard_map(
        body, mesh, spec, spec, backend="jax", axis_names={"i"}, check_vma=False
    )


def test_partial_auto_axis_index() -> None:
    """test_partial_auto_axis_index: mesh (4, 2), manual {'i'}, check_vma off."""
    f = _manual_over_i(lambda x: unimesh.axis_index("i").reshape(1, 1), P("i", None))
    got = jax.jit(f)(np.zeros((4, 1), np.float32))
    np.testing.assert_array_equal(np.asarray(got), np.arange(4, dtype=np.int32).reshape(-1, 1))


def test_partial_auto_ppermute() -> None:
    """test_partial_auto_ppermute: mesh (4, 2), manual {'i'}, a ring over i."""
    f = _manual_over_i(lambda x: unimesh.ppermute(x, "i", [(0, 1), (1, 2), (2, 3), (3, 0)]))
    got = jax.jit(f)(np.arange(8.0))
    np.testing.assert_array_equal(np.asarray(got), [6.0, 7.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0])


def test_partially_sharded_dim_with_auto() -> None:
    """test_partially_sharded_dim_with_auto: mesh (4, 2), manual {'i'}, sum of each block."""
    f = _manual_over_i(lambda x: x.sum()[None])
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(np.arange(8.0))), [1.0, 5.0, 9.0, 13.0])


def test_partial_auto_refusals_are_layout_and_axis_errors() -> None:
    """JAX refuses a spec naming an automatic axis (test_partial_auto_error_wrong_in_specs) and a
    collective over one ('unbound axis name'); unimesh refuses both before tracing, on every
    backend, with its own classes."""
    mesh = Mesh((2, 2), ("i", "j"))
    with pytest.raises(unimesh.LayoutError, match="in_specs P\\('i', 'j'\\) names axis 'j'"):
        unimesh.shard_map(lambda x: x, mesh, P("i", "j"), P("i"), backend="jax", axis_names={"i"})
    f = unimesh.shard_map(
        lambda x: unimesh.psum(x, "j"), mesh, P("i"), P("i"), backend="jax", axis_names={"i"}
    )
    with pytest.raises(unimesh.AxisContextError, match="names axis 'j', over which the function"):
        f(np.arange(4.0))
    with pytest.raises(unimesh.MeshSpecError, match="'k'"):
        unimesh.shard_map(lambda x: x, mesh, P("i"), P("i"), backend="jax", axis_names={"k"})
    with pytest.raises(unimesh.LayoutError, match="axis_names must be a set"):
        unimesh.shard_map(lambda x: x, mesh, P("i"), P("i"), backend="jax", axis_names="i")


def test_shard_map_mesh_from_context_and_check_vma() -> None:
    """mesh=None takes ``with mesh:`` or ``jax.set_mesh``'s; check_vma=False is JAX's flag:
    the out_spec P() over a varying value JAX refuses with it on passes with it off; JAX's
    refusal is a LayoutError carrying JAX's words."""
    mesh = Mesh((8,), ("x",))
    v = np.arange(8.0)
    with mesh:
        f = unimesh.shard_map(
            lambda b: unimesh.psum(b, "x"), in_specs=P("x"), out_specs=P(), backend="jax"
        )
    np.testing.assert_allclose(np.asarray(f(v)), [28.0])
    with jax.set_mesh(unimesh.to_native(Mesh((4, 2), ("a", "b")), "jax")):
        g = unimesh.shard_map(lambda b: b * 2, in_specs=P("a"), out_specs=P("a"), backend="jax")
        np.testing.assert_allclose(np.asarray(g(v)), v * 2)
    bad = unimesh.shard_map(lambda b: b, mesh, P("x"), P(), backend="jax")
    with pytest.raises(unimesh.LayoutError, match="out_specs is P\\(\\) which implies"):
        bad(v)
    loose = unimesh.shard_map(lambda b: b, mesh, P("x"), P(), backend="jax", check_vma=False)
    np.testing.assert_allclose(np.asarray(loose(v)), [0.0])  # device 0's block, as JAX gives
    with pytest.raises(unimesh.LayoutError, match="needs out_specs"):
        unimesh.shard_map(lambda b: b, mesh, P("x"), backend="jax")
    with pytest.raises(unimesh.LayoutError, match="no mesh is current"):
        unimesh.shard_map(lambda b: b, in_specs=P(), out_specs=P(), backend="jax")
