"""shard_map, the axis collectives and shard_params: the core's checks, and parameter sharding of a
JAX pytree and a Keras model compared with JAX's own NamedSharding (torch and MLX parameter
sharding run in their multi-process workers)."""

from __future__ import annotations

import numpy as np
import pytest

import unimesh
from unimesh import (
    AxisContextError,
    AxisRules,
    Layout,
    LayoutError,
    LayoutMap,
    MeshSpecError,
    P,
    UnsupportedError,
)

jax = pytest.importorskip("jax")
MESH = unimesh.make_mesh({"dp": 2, "tp": 4})


@pytest.mark.parametrize(
    "call",
    [
        lambda: unimesh.psum(1.0, "dp"),
        lambda: unimesh.pmean(1.0, "dp"),
        lambda: unimesh.pmax(1.0, "dp"),
        lambda: unimesh.pmin(1.0, "dp"),
        lambda: unimesh.all_gather(np.zeros(2), "dp"),
        lambda: unimesh.axis_index("dp"),
        lambda: unimesh.axis_size("dp"),
    ],
)
def test_collectives_outside_shard_map_say_where_to_call_them(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AxisContextError, match=r"outside unimesh.shard_map.*'dp'|'dp'.*outside"):
        call()


def run(f, in_specs, out_specs, *args):  # type: ignore[no-untyped-def]
    return unimesh.shard_map(f, MESH, in_specs, out_specs, backend="jax")(*args)


def test_bad_axes_and_dims_inside_shard_map() -> None:
    with pytest.raises(MeshSpecError, match="'pp'"):
        run(lambda x: unimesh.psum(x, "pp"), P(), P(), np.zeros(2))
    with pytest.raises(MeshSpecError, match="repeats"):
        run(lambda x: unimesh.psum(x, ("dp", "dp")), P(), P(), np.zeros(2))
    with pytest.raises(LayoutError, match="dim must be an int in \\[-2, 1\\].*got 5"):
        run(lambda x: unimesh.all_gather(x, "tp", dim=5), P(), P(), np.zeros((2, 2)))
    with pytest.raises(LayoutError, match="tiled=False for scalars"):
        run(lambda x: unimesh.all_gather(x.sum(), "tp"), P(), P(), np.zeros(2))


def test_bad_shard_map_arguments() -> None:
    with pytest.raises(LayoutError, match="needs a function, got 3"):
        unimesh.shard_map(3, MESH, P(), P(), backend="jax")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="needs a unimesh.Mesh, got 'dp=2'"):
        unimesh.shard_map(abs, "dp=2", P(), P(), backend="jax")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="in_specs must be a P.*got 'dp'"):
        unimesh.shard_map(abs, MESH, "dp", P(), backend="jax")
    with pytest.raises(LayoutError, match=r"in_specs\[1\] must be a P.*got 'tp'"):
        unimesh.shard_map(abs, MESH, (P(), "tp"), P(), backend="jax")
    with pytest.raises(LayoutError, match="'pp'"):
        unimesh.shard_map(abs, MESH, P("pp"), P(), backend="jax")
    other = Layout(unimesh.make_mesh({"x": 8}), P("x"))
    with pytest.raises(LayoutError, match=r"out_specs\[0\] is a layout on"):
        unimesh.shard_map(abs, MESH, P(), (other,), backend="jax")
    program = unimesh.shard_map(lambda x, y: x, MESH, (P(), P()), P(), backend="jax")
    with pytest.raises(LayoutError, match="takes 2 argument.*got 1"):
        program(np.zeros(2))
    with pytest.raises(LayoutError, match=r"out_specs \(.*\) is not a prefix of the results"):
        run(lambda x: x, P(), (P(), P()), np.zeros(2))


def test_tensorflow_refuses_shard_map() -> None:
    pytest.importorskip("tensorflow")
    with pytest.raises(UnsupportedError, match="tensorflow.*shard_map"):
        unimesh.shard_map(abs, MESH, P(), P(), backend="tensorflow")


def test_shard_map_result_is_a_jax_array_with_the_out_spec_and_jits() -> None:
    native = unimesh.to_native(MESH, "jax")
    program = jax.jit(
        unimesh.shard_map(
            lambda x: unimesh.psum(x, "tp") * 2, MESH, P("dp", "tp"), P("dp"), backend="jax"
        )
    )
    x = np.arange(8.0 * 4).reshape(8, 4)
    out = program(x)
    assert out.sharding.is_equivalent_to(jax.sharding.NamedSharding(native, jax.P("dp")), 2)
    np.testing.assert_allclose(np.asarray(out), x.sum(1, keepdims=True) * 2)


def tree() -> dict:
    rng = np.random.default_rng(1)
    return {
        "w1": rng.standard_normal((8, 16)).astype(np.float32),
        "w2": rng.standard_normal((16, 4)).astype(np.float32),
        "block": {"bias": np.zeros(16, np.float32), "scale": [np.ones(4, np.float32)]},
    }


def assert_placed(leaf, host: np.ndarray, spec: P) -> None:  # type: ignore[no-untyped-def]
    native = unimesh.to_native(MESH, "jax")
    want = jax.sharding.NamedSharding(native, jax.P(*spec))
    assert leaf.sharding.is_equivalent_to(want, host.ndim), (leaf.sharding, want)
    np.testing.assert_array_equal(np.asarray(leaf), host)


def test_shard_params_of_a_jax_pytree_by_layout_map() -> None:
    params = tree()
    rules = LayoutMap(MESH, {"w1": P(None, "tp"), "w2": P("tp", None), "block/b.*": P("tp")})
    placed = unimesh.shard_params(params, rules, backend="jax")
    assert_placed(placed["w1"], params["w1"], P(None, "tp"))
    assert_placed(placed["w2"], params["w2"], P("tp", None))
    assert_placed(placed["block"]["bias"], params["block"]["bias"], P("tp"))
    assert_placed(placed["block"]["scale"][0], params["block"]["scale"][0], P())  # unmatched


def test_shard_params_of_a_jax_pytree_by_axis_rules() -> None:
    params = tree()
    rules = AxisRules([("embed", None), ("mlp", "tp"), ("batch", "dp")])
    names = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}
    placed = unimesh.shard_params(params, rules, mesh=MESH, logical_axes=names, backend="jax")
    assert_placed(placed["w1"], params["w1"], P(None, "tp"))
    assert_placed(placed["w2"], params["w2"], P("tp", None))
    placed = unimesh.shard_params(
        params, rules, mesh=MESH, backend="jax", logical_axes=lambda path: names.get(path)
    )
    assert_placed(placed["w2"], params["w2"], P("tp", None))


def test_shard_params_by_axis_rules_keeps_flax_order() -> None:
    """The issue's rules: flax gives w1 ("embed", "mlp") P("dp", "tp"); resolving dim by dim
    gave P(("dp", "tp"), None) and lost the tensor-parallel split."""
    from flax.linen import logical_to_mesh_axes

    params = tree()
    rules = [("mlp", "tp"), ("embed", ("dp", "tp")), ("embed", "dp")]
    names = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}
    placed = unimesh.shard_params(
        params, AxisRules(rules), mesh=MESH, logical_axes=names, backend="jax"
    )
    for path in ("w1", "w2"):
        flax_spec = P(*logical_to_mesh_axes(names[path], rules))
        assert_placed(placed[path], params[path], flax_spec)
    assert placed["w1"].sharding.spec == unimesh.to_native(Layout(MESH, P("dp", "tp")), "jax").spec


def test_shard_params_errors_name_the_parameter() -> None:
    params = tree()
    with pytest.raises(
        LayoutError,
        match="'block/scale/0' of shape \\(4,\\) does not divide evenly.*'jax' needs even shards",
    ):
        unimesh.shard_params(
            params,
            LayoutMap(MESH, {"w2": P(None, "tp"), ".*scale.*": P(("dp", "tp"))}),
            backend="jax",
        )
    with pytest.raises(LayoutError, match="'block/bias' has shape \\(16,\\).*names 2 dims"):
        unimesh.shard_params(params, LayoutMap(MESH, {"block/bias": P("dp", "tp")}), backend="jax")
    with pytest.raises(LayoutError, match="LayoutMap or unimesh.AxisRules, got"):
        unimesh.shard_params(params, {"w1": P("tp")}, backend="jax")  # type: ignore[arg-type]
    rules = AxisRules([("mlp", "tp")])
    with pytest.raises(LayoutError, match="needs mesh="):
        unimesh.shard_params(params, rules, logical_axes={}, backend="jax")
    with pytest.raises(LayoutError, match="needs logical_axes"):
        unimesh.shard_params(params, rules, mesh=MESH, backend="jax")
    with pytest.raises(LayoutError, match="not on mesh="):
        unimesh.shard_params(
            params, LayoutMap(MESH, {}), mesh=unimesh.make_mesh({"x": 8}), backend="jax"
        )


def test_shard_params_of_a_keras_model() -> None:
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras.distribution needs KERAS_BACKEND=jax")
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="up"), keras.layers.Dense(4, name="down")]
    )
    before = {v.path: np.asarray(v.value) for v in model.variables}
    rules = LayoutMap(MESH, {".*up/kernel": P(None, "tp"), ".*down/kernel": P("tp", None)})
    assert unimesh.shard_params(model, rules, backend="keras") is model
    specs = {"up/kernel": P(None, "tp"), "down/kernel": P("tp", None)}
    for v in model.variables:
        spec = next((s for k, s in specs.items() if v.path.endswith(k)), P())
        assert_placed(v.value, before[v.path], spec)
    x = np.ones((2, 8), np.float32)
    want = x @ before[model.variables[0].path] + before[model.variables[1].path]
    want = want @ before[model.variables[2].path] + before[model.variables[3].path]
    np.testing.assert_allclose(np.asarray(model(x)), want, rtol=1e-5, atol=1e-5)


def test_rules_that_match_nothing_are_refused_before_anything_moves() -> None:
    """Issue 40: a key that matches no parameter is named with the closest paths, on the
    backend's own path spelling, before a parameter is touched; strict=False warns."""
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras.distribution needs KERAS_BACKEND=jax")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="up")])
    before = [v.value for v in model.variables]
    rules = LayoutMap(MESH, {".*up/kernel": P(None, "tp"), r"up\.weight": P("tp", None)})
    with pytest.raises(LayoutError, match=r"1 of 2 LayoutMap keys match no parameter.*"
                       r"'up\\\\.weight' \(closest: '.*up/kernel'"):  # fmt: skip
        unimesh.shard_params(model, rules, backend="keras")
    assert all(v.value is b for v, b in zip(model.variables, before))  # untouched
    with pytest.warns(UserWarning, match=r"match no parameter"):
        unimesh.shard_params(model, rules, backend="keras", strict=False)
    assert (
        model.variables[0].value.sharding.spec
        == unimesh.to_native(Layout(MESH, P(None, "tp")), "jax").spec
    )
    names = {"w1": ("embed", "mlp"), "w9": ("mlp", "embed")}
    with pytest.raises(LayoutError, match=r"1 of 2 logical_axes paths.*'w9' \(closest: 'w"):
        unimesh.shard_params(
            tree(), AxisRules([("mlp", "tp")]), mesh=MESH, logical_axes=names, backend="jax"
        )


@pytest.mark.parametrize(
    "call",
    [
        lambda: unimesh.psum_scatter(np.zeros(4), "dp"),
        lambda: unimesh.all_to_all(np.zeros(4), "dp", 0, 0),
        lambda: unimesh.ppermute(np.zeros(4), "dp", [(0, 1)]),
        lambda: unimesh.pbroadcast(np.zeros(4), "dp", 0),
    ],
)
def test_new_collectives_outside_shard_map(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AxisContextError, match="outside unimesh.shard_map"):
        call()


@pytest.mark.parametrize(
    ("body", "error", "match"),
    [
        (lambda x: unimesh.psum_scatter(x.sum(), "tp"), LayoutError, "needs an array with a dim"),
        (
            lambda x: unimesh.psum_scatter(x, "tp", scatter_dimension=2),
            LayoutError,
            r"scatter_dimension must be an int in \[-2, 1\].*got 2",
        ),
        (
            lambda x: unimesh.psum_scatter(x, "tp", scatter_dimension=1, tiled=True),
            LayoutError,
            r"splits scatter_dimension 1 \(size 6\) into 4 blocks.*not a multiple of 4",
        ),
        (
            lambda x: unimesh.psum_scatter(x, "tp"),
            LayoutError,
            r"tiled=False.*one entry per device \(4\), got size 8",
        ),
        (
            lambda x: unimesh.all_to_all(x, "tp", 1, 0, tiled=True),
            LayoutError,
            r"split_axis 1 \(size 6\) into 4 blocks",
        ),
        (lambda x: unimesh.all_to_all(x, "tp", "0", 1), LayoutError, "split_axis must be an int"),
        (
            lambda x: unimesh.all_to_all(x, "tp", 0, -3),
            LayoutError,
            r"concat_axis must be an int in \[-2, 1\].*got -3",
        ),
        (lambda x: unimesh.all_to_all(x, "pp", 0, 0), MeshSpecError, "'pp'"),
        (lambda x: unimesh.ppermute(x, "tp", "ab"), LayoutError, "index pairs, got 'ab'"),
        (
            lambda x: unimesh.ppermute(x, "tp", [(0, 4)]),
            LayoutError,
            r"\(0, 4\): indices must be ints in \[0, 3\]",
        ),
        (
            lambda x: unimesh.ppermute(x, "tp", [(0, 1), (0, 2)]),
            LayoutError,
            "not a permutation: source 0 appears more than once",
        ),
        (
            lambda x: unimesh.ppermute(x, "tp", [(0, 1), (2, 1)]),
            LayoutError,
            "not a permutation: destination 1 appears more than once",
        ),
        (lambda x: unimesh.ppermute(x, "tp", [(True, 1)]), LayoutError, "indices must be ints"),
        (
            lambda x: unimesh.pbroadcast(x, "tp", 4),
            LayoutError,
            r"source must be an index in \[0, 3\].*got 4",
        ),
        (lambda x: unimesh.pbroadcast(x, ("dp", "tp"), -1), LayoutError, r"\[0, 7\].*got -1"),
        (
            lambda x: unimesh.all_gather(x, "tp", to="replicated"),
            LayoutError,
            "to= must be 'varying' or 'invarying', got 'replicated'",
        ),
    ],
)
def test_bad_collective_arguments_name_the_value(body, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        run(body, P(), P(), np.zeros((8, 6), np.float32))


def test_spec_trees_must_be_prefixes() -> None:
    program = unimesh.shard_map(lambda p: p["w"], MESH, ({"w": P(), "b": P()},), P(), backend="jax")
    with pytest.raises(LayoutError, match=r"in_specs .* is not a prefix of the arguments"):
        program({"w": np.zeros(2)})
    with pytest.raises(LayoutError, match=r"in_specs\[0\]\['w'\] must be a P.*got 3"):
        unimesh.shard_map(abs, MESH, ({"w": 3},), P(), backend="jax")
    with pytest.raises(LayoutError, match=r"out_specs .* is not a prefix of the results"):
        run(lambda x: [x, x], P(), {"a": P()}, np.zeros(2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"argnums": -1}, "argnums must be a non-negative int or a tuple of distinct ones, got -1"),
        ({"argnums": (0, 0)}, r"tuple of distinct ones, got \(0, 0\)"),
        ({"argnums": True}, "got True"),
        ({"argnums": "w"}, "got 'w'"),
        ({"argnums": ()}, r"got \(\)"),
    ],
)
def test_bad_value_and_grad_arguments(kwargs, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LayoutError, match=match):
        unimesh.value_and_grad(lambda x: x.sum(), backend="jax", **kwargs)
    with pytest.raises(LayoutError, match=match):
        unimesh.grad(lambda x: x.sum(), backend="jax", **kwargs)


def test_value_and_grad_needs_a_function_and_enough_arguments() -> None:
    with pytest.raises(LayoutError, match="needs a function, got 3"):
        unimesh.value_and_grad(3, backend="jax")  # type: ignore[arg-type]
    vg = unimesh.value_and_grad(lambda x, y: (x * y).sum(), argnums=(0, 2), backend="jax")
    with pytest.raises(LayoutError, match=r"argnums \(0, 2\) names argument 2, but .* was given 2"):
        vg(np.ones(2), np.ones(2))


def test_value_and_grad_is_refused_where_not_declared() -> None:
    pytest.importorskip("tensorflow")
    with pytest.raises(UnsupportedError, match="'tensorflow' does not support 'grad'"):
        unimesh.value_and_grad(lambda x: x, backend="tensorflow")


def test_value_and_grad_matches_jax_grad_through_shard_map() -> None:
    """The JAX backend's value_and_grad is jax.value_and_grad; gradients keep the arguments'
    shardings, and grad with has_aux returns (grads, aux)."""
    w = unimesh.distribute(
        np.arange(8.0, dtype=np.float32).reshape(8, 1), Layout(MESH, P("tp", None)), backend="jax"
    )
    x = np.ones((4, 8), np.float32)
    program = unimesh.shard_map(
        lambda xb, wb: unimesh.psum((xb @ wb).sum(), ("dp", "tp")),
        MESH,
        (P("dp", "tp"), P("tp", None)),
        P(),
        backend="jax",
    )
    value, g = unimesh.value_and_grad(program, argnums=1, backend="jax")(x, w)
    want_value, want = jax.value_and_grad(program, argnums=1)(x, w)
    np.testing.assert_allclose(np.asarray(value), np.asarray(want_value))
    np.testing.assert_allclose(np.asarray(g), np.asarray(want))
    np.testing.assert_allclose(np.asarray(g), np.full((8, 1), 4.0))  # 4 rows of ones, summed
    assert g.sharding == w.sharding
    grads, aux = unimesh.grad(
        lambda x, w: (program(x, w), "aux"), argnums=(1,), has_aux=True, backend="jax"
    )(x, w)
    assert aux == "aux" and len(grads) == 1
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(want))


def test_checked_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """UNIMESH_CHECKED=1 turns the checked mode on (checked=False turns it off again), here on
    the example third-party backend, whose devices are threads of this process."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).with_name("conformance_example")))
    try:
        from unimesh_example.backend import ThreadedExampleBackend
    finally:
        sys.path.pop(0)
    backend = ThreadedExampleBackend()
    mesh = unimesh.Mesh((4,), ("x",))

    def body(b):  # type: ignore[no-untyped-def]
        return unimesh.psum(b[:1] if unimesh.axis_index("x") == 1 else b, "x")

    monkeypatch.setenv("UNIMESH_CHECKED", "1")
    program = unimesh.shard_map(body, mesh, P("x"), P("x"), backend=backend)
    with pytest.raises(
        unimesh.MeshMismatchError,
        match=r"\(shape\): process\(es\) \[0, 2, 3\] call psum over \('x',\) of "
        r"float64 \(2,\); process\(es\) \[1\] call psum over \('x',\) of "
        r"float64 \(1,\)",
    ):
        program(np.zeros(8))
    unchecked = unimesh.shard_map(body, mesh, P("x"), P("x"), backend=backend, checked=False)
    with pytest.raises(ValueError, match="same shape") as info:
        unchecked(np.zeros(8))
    assert not isinstance(info.value, unimesh.MeshMismatchError)


def test_a_program_s_edges_follow_each_call_s_shapes_and_layouts() -> None:
    """The engine keeps each global argument's block per (layout, shape): calls with other
    shapes, and another program's layouts on the same processes, get their own blocks, never a
    block kept for an earlier call (the example backend's engine, a thread per device)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).with_name("conformance_example")))
    try:
        from unimesh_example.backend import ThreadedExampleBackend
    finally:
        sys.path.pop(0)
    backend = ThreadedExampleBackend()
    mesh = unimesh.Mesh((2, 2), ("a", "b"))
    programs = {
        spec: unimesh.shard_map(lambda v: v * 2.0, mesh, spec, spec, backend=backend)
        for spec in (P("a", "b"), P("b"), P(None, ("b", "a")))
    }
    for shape in ((8, 4), (4, 8), (8, 4), (6, 12), (4, 8)):
        x = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
        for spec, program in programs.items():
            out = program(x)
            layout = Layout(mesh, spec)
            for d in range(4):
                np.testing.assert_array_equal(
                    out.blocks[d], 2.0 * x[layout.shard_slices(shape, d)], err_msg=f"{spec} {d}"
                )
