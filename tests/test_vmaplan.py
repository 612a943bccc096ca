"""The gradient plan read from a body's graph (:mod:`unimesh.vmaplan`): where check_vma's sums
go, on graphs written by hand (the values each program's gradient then takes are checked
against JAX under mpirun and mlx.launch: tests/test_programs.py, every case compiled on MLX)."""

from __future__ import annotations

import pytest

from unimesh.vmaplan import Graph, PlanError, Site, VmaPlan, shape_after

pytestmark = pytest.mark.quick

AXES = frozenset({"dp", "tp"})
NONE: frozenset[str] = frozenset()


def _megatron() -> tuple[Graph, list[Site]]:
    """examples/mlp_step.py's loss: x, t over dp; w1 columns and w2 rows over tp."""
    ops: list[tuple[tuple[str, ...], tuple[str, ...], int | None]] = [
        (("x", "w1"), ("pre",), None),
        (("pre",), ("h",), None),
        (("h", "w2"), ("part",), None),
        (("part",), ("y",), 0),  # psum over tp
        (("y", "t"), ("diff",), None),
        (("diff", "diff"), ("sq",), None),
        (("sq", "n"), ("mean",), None),  # n: a constant
        (("mean",), ("loss",), 1),  # psum over dp
    ]
    graph = Graph(["x", "t", "w1", "w2"], ops, ["loss"], frozenset({"n"}))
    return graph, [Site("psum", ("tp",)), Site("psum", ("dp",))]


def _solve(graph: Graph, sites: list[Site], outs: list[tuple[frozenset[str], frozenset[str]]]
           ) -> VmaPlan:  # fmt: skip
    plan = VmaPlan()
    vma = [frozenset({"dp"}), frozenset({"dp"}), frozenset({"tp"}), frozenset({"tp"})]
    plan.solve(graph, sites, vma[: len(graph.inputs)], outs, AXES)
    return plan


def test_megatron_step_sums_as_the_hand_written_one() -> None:
    """Megatron's f (the input's gradient summed over tp), DDP (the weights' over dp), and
    no sum for either psum's transpose nor a division of the replicated loss."""
    graph, sites = _megatron()
    plan = _solve(graph, sites, [(NONE, AXES)])
    assert plan.reason is None and plan.exact == AXES
    assert plan.inputs == {0: {"tp"}, 1: NONE, 2: {"dp"}, 3: {"dp"}}
    assert plan.sums == {0: NONE, 1: NONE}
    assert plan.input_axes(2, ("dp",)) == ("dp",) and plan.input_axes(1, ("tp",)) == ()
    assert plan.sum_axes(0, ("tp",)) == () and plan.copies_axes(("dp", "tp")) == ()


def test_a_source_reaching_both_kinds_of_sink_keeps_the_unchecked_rules() -> None:
    """y = psum(part, tp) is a replicated result and also meets a value varying along tp:
    along tp the check_vma=False rules stay (psum transposes to psum, the result counts once);
    dp is still placed."""
    graph, sites = _megatron()
    graph.ops += [(("y", "w1"), ("mixed",), None)]
    graph.outputs += ["y", "mixed"]
    outs = [(NONE, AXES), (frozenset({"dp"}), frozenset({"tp"})), (AXES, NONE)]
    plan = _solve(graph, sites, outs)
    assert plan.exact == {"dp"}
    assert plan.sum_axes(0, ("tp",)) == ("tp",)
    assert plan.copies_axes(("dp", "tp")) == ("tp",)
    assert plan.input_axes(0, ("tp",)) == ("tp",)


def test_an_output_varying_where_its_spec_says_not_keeps_the_unchecked_rules() -> None:
    graph, sites = _megatron()
    graph.outputs += ["part"]  # varies along dp and tp; its spec says replicated over tp
    plan = _solve(graph, sites, [(NONE, AXES), (frozenset({"dp"}), frozenset({"tp"}))])
    assert plan.exact == {"dp"}


def test_an_output_named_varying_but_invariant_is_a_pvary() -> None:
    """JAX's implicit pvary at the boundary: the loss returned under P("dp") (one copy per
    device along dp, each counted) sends dp's sum back to the weights, and the psum over dp
    reaches it: its transpose sums."""
    graph, sites = _megatron()
    plan = _solve(graph, sites, [(frozenset({"dp"}), frozenset({"tp"}))])
    assert plan.exact == AXES
    assert plan.sums[1] == {"dp"}


def test_pbroadcast_and_invariant_all_gather_are_left_to_the_unchecked_rules() -> None:
    for op in ("pbroadcast", "all_gather_invariant"):
        graph, sites = _megatron()
        sites[0] = Site(op, ("tp",))
        plan = _solve(graph, sites, [(NONE, AXES)])
        assert plan.exact == {"dp"}, op


def test_axis_index_makes_a_value_vary() -> None:
    """y times axis_index(tp) varies along tp: the psum over tp that made y reaches a pvary,
    so its transpose sums (and the loss is summed over both axes)."""
    graph, sites = _megatron()
    sites[1] = Site("psum", ("dp", "tp"))
    sites.append(Site("axis_index", ("tp",)))
    graph.ops.insert(4, ((), ("k",), 2))
    graph.ops.insert(5, (("y", "k"), ("yk",), None))
    graph.ops[6] = (("yk", "t"), ("diff",), None)
    plan = _solve(graph, sites, [(NONE, AXES)])
    assert plan.exact == AXES and plan.sums == {0: {"tp"}, 1: NONE}


def test_a_graph_that_is_not_in_order_is_refused() -> None:
    graph, sites = _megatron()
    graph.ops.reverse()
    with pytest.raises(PlanError, match="before making it"):
        _solve(graph, sites, [(NONE, AXES)])


def test_a_body_calling_other_collectives_than_its_trace_is_refused() -> None:
    graph, sites = _megatron()
    plan = _solve(graph, sites, [(NONE, AXES)])
    assert plan.visit("psum", ("tp",)) == 0
    with pytest.raises(PlanError, match=r"called pmax\('dp',\) as its collective 1.*psum"):
        plan.visit("pmax", ("dp",))


def test_an_unsolved_plan_answers_as_the_unchecked_rules() -> None:
    plan = VmaPlan()
    assert plan.input_axes(0, ("dp", "tp")) == ("dp", "tp")
    assert plan.sum_axes(3, ("tp",)) == ("tp",)
    assert plan.copies_axes(("dp",)) == ("dp",)
    assert plan.visit("anything", ("dp",)) == 0  # nothing to check against


@pytest.mark.parametrize(
    ("op", "shape", "dims", "tiled", "want"),
    [
        ("all_gather", (4, 6), (1,), True, (4, 12)),
        ("all_gather", (4, 6), (1,), False, (4, 2, 6)),
        ("psum_scatter", (4, 6), (1,), True, (4, 3)),
        ("psum_scatter", (2, 6), (0,), False, (6,)),
        ("all_to_all", (4, 6), (1, 0), True, (8, 3)),
        ("all_to_all", (2, 6, 3), (0, 1), False, (6, 2, 3)),
        ("psum", (4, 6), (), True, (4, 6)),
    ],
)
def test_block_shapes_are_jax_collectives(
    op: str, shape: tuple[int, ...], dims: tuple[int, ...], tiled: bool, want: tuple[int, ...]
) -> None:
    """The shape each collective gives a block, as jax.lax's (2 devices): checked against JAX
    itself where it is installed."""
    assert shape_after(op, shape, 2, dims, tiled) == want
    jax = pytest.importorskip("jax")
    from jax import lax

    fns = {
        "all_gather": lambda b: lax.all_gather(b, "i", axis=dims[0], tiled=tiled),
        "psum_scatter": lambda b: lax.psum_scatter(b, "i", scatter_dimension=dims[0], tiled=tiled),
        "all_to_all": lambda b: lax.all_to_all(b, "i", dims[0], dims[1], tiled=tiled),
        "psum": lambda b: lax.psum(b, "i"),
    }
    out = jax.eval_shape(
        jax.vmap(fns[op], axis_name="i"), jax.ShapeDtypeStruct((2, *shape), "float32")
    )
    assert tuple(out.shape[1:]) == want


def _mlx_graph(body_fn, blocks):  # type: ignore[no-untyped-def]
    """MLX's graph of ``body_fn`` on ``blocks`` (in one process: the collectives are the
    trace's markers, nothing is communicated), its sites and which took an array."""
    mx = pytest.importorskip("mlx.core")
    import optree

    import unimesh
    from unimesh.program import Body, SpecTree
    from unimesh.vmaplan import TraceEnv

    be = unimesh.get_backend("mlx")
    mesh = unimesh.Mesh.from_string("dp=2,tp=2")
    from unimesh_mlx.graph import BODY_GRAPH

    tracer = TraceEnv(be, BODY_GRAPH, mesh, 0)
    body = Body(body_fn, SpecTree(mesh, unimesh.P(), "out_specs"))
    leaves, treedef = optree.tree_flatten(blocks)

    def run(given):  # type: ignore[no-untyped-def]
        _, outs, _, _ = body.flat(tracer, *optree.tree_unflatten(treedef, given))
        return [be.arrays().asarray(o) for o in outs]

    return BODY_GRAPH.trace(run, leaves), tracer, mx


def test_mlx_graph_of_the_mlp_step_places_the_hand_written_sums() -> None:
    """examples/mlp_step.py's loss traced by MLX's export callback: the same plan as the
    hand-written graph above (the pmean's division and the relu's comparison included)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    import mlp_step

    mx = pytest.importorskip("mlx.core")
    blocks = (
        mx.zeros((8, 8)),
        mx.zeros((8, 4)),
        {"w1": mx.zeros((8, 16)), "w2": mx.zeros((16, 4))},
    )
    graph, tracer, _ = _mlx_graph(mlp_step.loss, blocks)
    assert tracer.sites == [Site("psum", ("tp",)), Site("psum", ("dp",))]
    assert tracer.fed == [True, True]
    plan = VmaPlan()
    vma = [frozenset({"dp"}), frozenset({"dp"}), frozenset({"tp"}), frozenset({"tp"})]
    plan.solve(graph, tracer.sites, list(vma), [(NONE, AXES)], AXES, tracer.fed)
    assert plan.reason is None and plan.exact == AXES
    assert plan.inputs == {0: {"tp"}, 1: NONE, 2: {"dp"}, 3: {"dp"}}
    assert plan.sums == {0: NONE, 1: NONE}


def test_mlx_graph_refuses_a_body_that_evaluates() -> None:
    """A body that evaluates an array cannot be traced (the program then keeps the
    unchecked rules: the error is the plan's reason, not the call's)."""
    mx = pytest.importorskip("mlx.core")
    import unimesh

    def evaluates(x):  # type: ignore[no-untyped-def]
        return unimesh.psum(x, "tp") if x.sum().item() >= 0 else x

    with pytest.raises(ValueError, match="eval"):
        _mlx_graph(evaluates, (mx.zeros((2, 2)),))


def test_an_unused_collective_is_left_out_and_a_lost_one_refused() -> None:
    """An unused collective is not in the exported graph (nothing depends on it; it adds
    nothing to a gradient): the plan is solved without it. A collective whose mark is in the
    graph but no operation takes it is refused."""
    mx = pytest.importorskip("mlx.core")
    import unimesh

    def unused(x):  # type: ignore[no-untyped-def]
        unimesh.psum(x, "tp")
        return unimesh.psum(x * 2, "dp")

    graph, tracer, _ = _mlx_graph(unused, (mx.zeros((2, 2)),))
    assert graph.marked == {1}
    plan = VmaPlan()
    plan.solve(graph, tracer.sites, [AXES], [(NONE, AXES)], AXES, tracer.fed)
    assert plan.reason is None and plan.visit("psum", ("tp",)) == 0
    graph.marked = frozenset({0, 1})
    with pytest.raises(PlanError, match=r"collectives \[0\] of the body are not found"):
        VmaPlan().solve(graph, tracer.sites, [AXES], [(NONE, AXES)], AXES, tracer.fed)
    graph.marked = frozenset()
    with pytest.raises(PlanError, match="no collective of the body is marked"):
        VmaPlan().solve(graph, tracer.sites, [AXES], [(NONE, AXES)], AXES, tracer.fed)


def test_an_array_the_body_closes_over_keeps_the_unchecked_rules_where_it_meets_variation() -> None:
    """A weight read from outside the body (not an argument) may be differentiated by a
    transform around the program, and no edge can sum its gradient: the axes along which it
    (through the region) meets a varying value keep the check_vma=False rules."""
    graph, sites = _megatron()
    graph.constants = frozenset({"n", "scale"})
    graph.closed = frozenset({"scale"})
    graph.ops.insert(0, (("scale", "n"), ("scaled",), None))  # through an invariant operation
    graph.ops[1] = (("x", "w1", "scaled"), ("pre",), None)  # meets x (dp) and w1 (tp)
    plan = _solve(graph, sites, [(NONE, AXES)])
    assert plan.exact == NONE and plan.reason is not None
    graph, sites = _megatron()
    graph.constants = frozenset({"n", "scale"})
    graph.closed = frozenset({"scale"})
    graph.ops.append((("loss", "scale"), ("scaled_loss",), None))  # invariant: no sum needed
    graph.outputs = ["scaled_loss"]
    assert _solve(graph, sites, [(NONE, AXES)]).exact == AXES


def test_mlx_graph_names_the_arrays_a_body_closes_over() -> None:
    mx = pytest.importorskip("mlx.core")
    import unimesh

    weight = mx.ones((2, 2))
    mx.eval(weight)  # a model's parameter, evaluated: a constant of the graph

    def body(x):  # type: ignore[no-untyped-def]
        return unimesh.psum((x @ weight * 3.0).sum(), ("dp", "tp"))

    graph, tracer, _ = _mlx_graph(body, (mx.zeros((2, 2)),))
    assert len(graph.closed) == 1 and graph.closed < graph.constants  # 3.0 is not one
    assert len(graph.constants) > 1
    plan = VmaPlan()
    plan.solve(graph, tracer.sites, [AXES], [(NONE, AXES)], AXES, tracer.fed)
    assert plan.exact == NONE  # the weight meets x, which varies along both
