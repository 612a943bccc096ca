"""shard_map programs written once against unimesh, each a scalar loss of its arguments.

JAX computes the reference (``jax.grad`` through ``jax.shard_map`` with ``check_vma``) in the
test process; torch (torchrun) and MLX (mpirun, mlx.launch) run the very same functions in
``program_worker.py`` and must give the same value and gradients. The bodies use only what
jax, torch and MLX arrays share (``@``, ``*``, ``.sum()``, ``.T``, comparisons).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np

import unimesh
from unimesh import Layout, P

MESH = "dp=2,tp=2"
Pair = namedtuple("Pair", ["a", "b"])


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _data(seed: int, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    rng = _rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _weighted(y: Any) -> Any:
    """A loss that weighs every element and device differently, so cotangents vary."""
    k = 1.0 + unimesh.axis_index(("dp", "tp"))
    n = 1
    for s in y.shape:
        n *= s
    return (y * y * 0.5 + y * k).sum() / n


def _total(local: Any) -> Any:
    return unimesh.psum(local, ("dp", "tp"))


class Case:
    """``fn(mesh, backend)`` -> a loss function of ``args``; ``specs`` lay the arguments out
    (None: passed as global arrays) and ``argnums`` are differentiated."""

    def __init__(
        self,
        name: str,
        build: Callable[[unimesh.Mesh, str], Callable[..., Any]],
        args: list[Any],
        specs: list[Any],
        argnums: tuple[int, ...],
    ) -> None:
        self.name = name
        self.build = build
        self.args = args
        self.specs = specs
        self.argnums = argnums


def _collective_case(
    name: str, op: Callable[[Any], Any], in_spec: P, shape: tuple[int, ...], seed: int
) -> Case:
    def build(mesh: unimesh.Mesh, backend: str) -> Callable[..., Any]:
        program = unimesh.shard_map(
            lambda b: _total(_weighted(op(b))), mesh, in_spec, P(), backend=backend
        )
        return program

    return Case(name, build, _data(seed, shape), [in_spec], (0,))


CASES: list[Case] = [
    _collective_case("psum", lambda b: unimesh.psum(b, "tp"), P("dp", "tp"), (4, 6), 1),
    _collective_case(
        "psum-tuple", lambda b: unimesh.psum(b, ("tp", "dp")), P("dp", "tp"), (4, 6), 2
    ),
    _collective_case("pmean", lambda b: unimesh.pmean(b * b, "dp"), P("dp", "tp"), (4, 6), 3),
    _collective_case("psum-replicated", lambda b: unimesh.psum(b, "tp"), P("dp"), (4, 6), 4),
    _collective_case("all_gather", lambda b: unimesh.all_gather(b, "tp"), P("dp", "tp"), (4, 6), 5),
    _collective_case(
        "all_gather-dim1-untiled",
        lambda b: unimesh.all_gather(b, "dp", dim=1, tiled=False),
        P("dp", "tp"),
        (4, 6),
        6,
    ),
    _collective_case(
        "all_gather-tuple",
        lambda b: unimesh.all_gather(b, ("tp", "dp")),
        P(("tp", "dp")),
        (8, 3),
        7,
    ),
    _collective_case(
        "psum_scatter-tiled",
        lambda b: unimesh.psum_scatter(b, "tp", scatter_dimension=1, tiled=True),
        P("dp"),
        (4, 6),
        8,
    ),
    _collective_case(
        "psum_scatter-untiled",
        lambda b: unimesh.psum_scatter(b, "dp", scatter_dimension=0),
        P(None, "tp"),
        (2, 6),
        9,
    ),
    _collective_case(
        "all_to_all-tiled",
        lambda b: unimesh.all_to_all(b, "tp", 1, 0, tiled=True),
        P("dp"),
        (4, 6),
        10,
    ),
    _collective_case(
        "all_to_all-untiled",
        lambda b: unimesh.all_to_all(b, "dp", 0, 1),
        P(None, "tp"),
        (2, 6, 3),
        11,
    ),
    _collective_case(
        "all_to_all-tuple",
        lambda b: unimesh.all_to_all(b, ("dp", "tp"), 0, 1, tiled=True),
        P(),
        (8, 2),
        12,
    ),
    _collective_case(
        "ppermute-ring",
        lambda b: unimesh.ppermute(b, "tp", [(0, 1), (1, 0)]) * 2.0 + b,
        P("dp", "tp"),
        (4, 6),
        13,
    ),
    _collective_case(
        "ppermute-shift",
        lambda b: unimesh.ppermute(b, ("dp", "tp"), [(0, 1), (1, 2), (2, 3)]),
        P(("dp", "tp")),
        (8, 3),
        14,
    ),
    _collective_case(
        "pbroadcast", lambda b: unimesh.pbroadcast(b, "tp", 1) * b, P("dp", "tp"), (4, 6), 15
    ),
]


def _both_sinks(mesh: unimesh.Mesh, backend: str) -> Callable[..., Any]:
    """A psum's result that both meets a value varying along its axis and reaches the
    replicated result: where the body's graph is read (MLX compiled), tp keeps the
    check_vma=False rules and dp takes check_vma's (the mixed plan)."""

    def body(b: Any) -> Any:
        y = unimesh.psum(b, "tp")
        return _total(_weighted(y)) + unimesh.psum((y * y).sum(), "dp")

    return unimesh.shard_map(body, mesh, P("dp", "tp"), P(), backend=backend)


CASES.append(Case("psum-both-sinks", _both_sinks, _data(16, (4, 6)), [P("dp", "tp")], (0,)))
#: the axes a compiled MLX case's plan places, where not every axis of the mesh
EXACT = {"psum-both-sinks": frozenset({"dp"}), "pbroadcast": frozenset({"dp"})}


def _issue_example(mesh: unimesh.Mesh, backend: str) -> Callable[..., Any]:
    """The gradient that was wrong on torch (32 instead of 16)."""

    def loss_fn(x: Any, y: Any, w: Any) -> Any:
        pred = unimesh.psum(x @ w, "tp")
        return unimesh.pmean(((pred - y) ** 2).mean(), "dp")

    return unimesh.shard_map(
        loss_fn,
        mesh,
        in_specs=(P("dp", "tp"), P("dp", None), P("tp", None)),
        out_specs=P(),
        backend=backend,
    )


CASES.append(
    Case(
        "issue-example",
        _issue_example,
        [np.ones((16, 8), np.float32), np.zeros((16, 1), np.float32), np.ones((8, 1), np.float32)],
        [P("dp", "tp"), P("dp", None), P("tp", None)],
        (0, 2),
    )
)


def _tree_program(mesh: unimesh.Mesh, backend: str) -> Callable[..., Any]:
    """Pytrees: a dict of parameters with a dict of specs, a namedtuple sharing one spec, a
    None leaf, and a tuple of results whose specs are a prefix."""

    def body(params: dict[str, Any], batch: Any, nothing: None) -> Any:
        h = batch.a @ params["w1"]  # (B/dp, H/tp)
        h = h * (h > 0)
        out = unimesh.psum(h @ params["w2"], "tp")  # (B/dp, O)
        loss = ((out - batch.b) ** 2).sum()
        return unimesh.psum(loss, "dp"), {"out": out}

    program = unimesh.shard_map(
        body,
        mesh,
        in_specs=({"w1": P(None, "tp"), "w2": P("tp", None)}, P("dp"), None),
        out_specs=(P(), {"out": P("dp")}),
        backend=backend,
    )

    def loss(params: dict[str, Any], batch: Any) -> Any:
        total, _extra = program(params, batch, None)
        return total

    return loss


_W1, _W2, _XA, _XB = _data(20, (6, 4), (4, 3), (4, 6), (4, 3))
CASES.append(
    Case(
        "pytree",
        _tree_program,
        [{"w1": _W1, "w2": _W2}, Pair(_XA, _XB)],
        [{"w1": P(None, "tp"), "w2": P("tp", None)}, None],
        (0, 1),
    )
)


def _relaid_program(mesh: unimesh.Mesh, backend: str) -> Callable[..., Any]:
    """Arguments laid out otherwise than the program's in_specs: shard_map moves them to its
    layout first, and the gradient flows back through the move to the argument's layout."""

    def body(x: Any, w: Any) -> Any:
        return _total(_weighted(unimesh.psum(x @ w, "tp")))

    return unimesh.shard_map(
        body, mesh, in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P(), backend=backend
    )


CASES.append(
    Case(
        "relaid",
        _relaid_program,
        _data(30, (4, 6), (6, 4)),
        [P(None, "dp"), P(None, ("dp", "tp"))],  # neither as the program's in_specs say
        (0, 1),
    )
)


def _xp(a: Any) -> Any:
    """The array module of ``a`` (jax.numpy, torch, mlx.core) for exp and log."""
    import importlib

    top = type(a).__module__.split(".")[0]
    return importlib.import_module({"torch": "torch", "mlx": "mlx.core"}.get(top, "jax.numpy"))


def _loss_parallel_xent(mesh: unimesh.Mesh, backend: str) -> Callable[..., Any]:
    """A numerically stable cross-entropy over vocabulary-parallel logits (Megatron's loss
    parallel): the shift is ``pmax`` of ``stop_gradient(logits)`` over ``tp`` (pmax has no
    derivative), the softmax's sum a ``psum``. The gradient is softmax - labels, as JAX's."""

    def body(x: Any, y: Any) -> Any:  # (B/dp, V/tp) logits and one-hot labels
        m = unimesh.pmax(unimesh.stop_gradient(x), "tp").sum(-1) / x.shape[-1]  # a row shift
        xp = _xp(x)
        z = unimesh.psum(xp.exp(x - m[:, None]).sum(-1), "tp")
        picked = unimesh.psum((x * y).sum(-1), "tp")
        return unimesh.psum((xp.log(z) + m - picked).sum(), "dp") / 8

    return unimesh.shard_map(
        body, mesh, in_specs=(P("dp", "tp"), P("dp", "tp")), out_specs=P(), backend=backend
    )


_LOGITS = (_data(40, (8, 12))[0] * 20).astype(np.float32)  # large: exp overflows unshifted
CASES.append(
    Case(
        "loss-parallel-xent",
        _loss_parallel_xent,
        [_LOGITS, np.eye(12, dtype=np.float32)[_rng(41).integers(0, 12, 8)]],
        [P("dp", "tp"), P("dp", "tp")],
        (0,),
    )
)


# Partial-manual programs (``axis_names``), ported from JAX's tests/shard_map_test.py at
# jax-ml/jax commit cec06d116c05f0d52adfceee3d3b730fdbcb0ce5 (its 4x2 / 2x2 meshes are this
# file's dp=2, tp=2 with dp manual): the body, specs and check_vma of each test; the value and
# gradient compared with jax.shard_map's own, as every case here.
_DP_TP = P("dp", "tp")


def _manual_dp(
    body: Callable[[Any], Any], spec: P, check_vma: bool, then: P = _DP_TP
) -> Callable[[unimesh.Mesh, str], Callable[..., Any]]:
    """A program manual over dp only, its result fed to a full-manual weighted sum (laid out
    as ``then``, so its gradient crosses a relayout too)."""

    def build(mesh: unimesh.Mesh, backend: str) -> Callable[..., Any]:
        partial = unimesh.shard_map(
            body,
            mesh,
            in_specs=spec,
            out_specs=spec,
            backend=backend,
            axis_names={"dp"},
            check_vma=check_vma,
        )
        total = unimesh.shard_map(lambda y: _total(_weighted(y)), mesh, then, P(), backend=backend)
        return lambda x: total(partial(x))

    return build


CASES += [
    # test_partial_auto: in/out P('i', None), manual {'i'}, x * x, check_vma on
    Case(
        "partial-auto",
        _manual_dp(lambda x: x * x, P("dp", None), True),
        _data(50, (4, 8)),
        [P("dp", "tp")],
        (0,),
    ),
    # test_partial_auto_ppermute: in/out P('i'), ppermute over the manual axis, check_vma off
    Case(
        "partial-auto-ppermute",
        _manual_dp(lambda x: unimesh.ppermute(x * 3.0, "dp", [(0, 1), (1, 0)]), P("dp"), False),
        _data(51, (4, 2)),
        [P("dp")],
        (0,),
    ),
    # test_partially_sharded_dim_with_auto: jnp.sum(x)[None] on each dp block, check_vma off
    Case(
        "partial-auto-sum",
        _manual_dp(
            lambda x: (x * x).sum()[None] * (1.0 + unimesh.axis_index("dp")),
            P("dp"),
            False,
            P("dp"),
        ),
        _data(52, (8,)),
        [P("dp")],
        (0,),
    ),
    # test_shmap_partial_manual_auto: in/out P('x'), manual {'x'}, x * 2, with a psum over the
    # manual axis as the tests of the full-manual programs use (check_vma on)
    Case(
        "partial-auto-psum",
        _manual_dp(lambda x: unimesh.psum(x * 2.0, "dp") + x, P("dp", None), True),
        _data(53, (4, 2)),
        [P("dp", "tp")],
        (0,),
    ),
]


def _layout(mesh: unimesh.Mesh, spec: P) -> Layout:
    return Layout(mesh, spec)


def global_array(a: np.ndarray, backend: str) -> Any:
    """``a`` as the backend's own (undistributed) array."""
    if backend == "torch":
        import torch

        return torch.as_tensor(a)
    if backend == "mlx":
        import mlx.core as mx

        return mx.array(a)
    import jax.numpy as jnp

    return jnp.asarray(a)


def arguments(case: Case, mesh: unimesh.Mesh, backend: str) -> list[Any]:
    """The case's arguments: distributed by their specs, or global arrays where None."""
    import optree

    out = []
    for value, spec in zip(case.args, case.specs):
        if spec is None:
            out.append(optree.tree_map(lambda a: global_array(a, backend), value))
        else:
            specs = optree.tree_broadcast_prefix(spec, value, is_leaf=lambda s: isinstance(s, P))
            out.append(
                optree.tree_map(
                    lambda a, s: unimesh.distribute(a, Layout(mesh, s), backend=backend),
                    value,
                    specs,
                )
            )
    return out


#: The cases also run through unimesh.compile (issue 38): mx.compile on MLX, torch.compile
#: (backend aot_eager: dynamo and AOT autograd, without inductor's C++ build) on torch
COMPILED = ("issue-example", "pytree", "loss-parallel-xent")


def planned_names(backend: str) -> tuple[str, ...]:
    """The cases whose gradient also runs as ``unimesh.compile`` traces it, with MLX's own
    compilation turned off (``mx.disable_compile``: each call traces, and each trace reads
    the body's graph, unimesh.vmaplan; kernel fusion would build a C++ kernel per case, 1-4 s
    each on 2 cores): on MLX every case, each collective's planned rule checked against the
    reference. :data:`COMPILED` runs compiled for real."""
    return tuple(c.name for c in CASES) if backend == "mlx" else ()


COMPILE_OPTIONS = {"torch": {"backend": "aot_eager"}}


def _whole_torch() -> bool:
    """Whether this torch's dynamo compiles a value_and_grad step whole (2.13 does; 2.11
    refuses ``requires_grad_`` in a compiled function, and the step falls back)."""
    import torch

    return tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)


def run(
    case: Case, mesh: unimesh.Mesh, backend: str, compiled: bool = False
) -> dict[str, np.ndarray]:
    """The loss and every gradient, whole, as numpy (every process gets the same); with
    ``compiled``, the value-and-gradient step under :func:`unimesh.compile`."""
    import optree

    loss = case.build(mesh, backend)
    step = unimesh.value_and_grad(loss, argnums=case.argnums, backend=backend)
    if compiled:
        step = unimesh.compile(
            step, backend=backend, compiler_options=COMPILE_OPTIONS.get(backend, {})
        )
    args = arguments(case, mesh, backend)
    value, grads = step(*args)
    if compiled:  # a second call runs the compiled trace (the first traced it)
        value, grads = step(*args)
        program = getattr(loss, "unimesh_program", None)  # None: the loss calls a program
        if backend == "mlx" and program is not None and program.body.manual is None:
            plan = program.plan  # the compiled trace must have read the body's graph
            if plan is None or plan.reason is not None:
                raise AssertionError(f"{case.name}: no gradient plan ({plan and plan.reason})")
            want = EXACT.get(case.name, frozenset(mesh.axis_names))
            if plan.exact != want:
                raise AssertionError(f"{case.name}: the plan places {plan.exact}, not {want}")
        whole = getattr(step, "unimesh_whole", None)  # torch 2.13: forward and backward one
        if whole is not None and whole() != (case.name != "pytree" and _whole_torch()):
            raise AssertionError(  # graph, but where nonstrict_trace cannot take an argument
                f"{case.name}: the gradient compiled "  # (pytree's namedtuple)
                f"{'whole' if whole() else 'outside the graph'}"
            )
    out = {"value": np.asarray(unimesh.full_array(value, backend=backend), np.float64)}
    for n, g in zip(case.argnums, grads):
        leaves, treedef = optree.tree_flatten(g)
        for path, leaf in zip(optree.treespec_paths(treedef), leaves):
            key = f"grad{n}" + "".join(f"/{p}" for p in path)
            out[key] = np.asarray(unimesh.full_array(leaf, backend=backend), np.float64)
    return out


def native_autodiff(mesh: unimesh.Mesh, backend: str) -> dict[str, np.ndarray]:
    """The issue's example differentiated by the framework's own autodiff, not
    unimesh.value_and_grad: torch ``.backward()`` through the program's DTensor output (w is a
    DTensor parameter), MLX ``mx.value_and_grad`` of a function of w's local block. Returns
    w's whole gradient, to compare with JAX's ``issue-example:grad2``; on torch also
    ``mixed``: unimesh.value_and_grad of the loss plus ``(w * w).sum()`` in DTensor ops
    (JAX's gradient + 2w); ``compiled``: the same under ``torch.compile(fullgraph=True)``
    (torch) or ``mx.compile`` (MLX)."""
    case = next(c for c in CASES if c.name == "issue-example")
    program = case.build(mesh, backend)
    x, y, w = case.args
    w_layout = Layout(mesh, P("tp", None))
    if backend == "torch":
        xs, ys = (
            unimesh.distribute(a, Layout(mesh, s), backend="torch")
            for a, s in ((x, P("dp", "tp")), (y, P("dp", None)))
        )
        wd = unimesh.distribute(w, w_layout, backend="torch").requires_grad_(True)
        program(xs, ys, wd).full_tensor().backward()

        def mixed(w_d: Any) -> Any:  # w reaches the loss through DTensor ops and the program
            return program(xs, ys, w_d) + (w_d * w_d).sum()

        _, g = unimesh.value_and_grad(mixed, backend="torch")(wd.detach())
        # torch.compile(fullgraph=True) of the loss as torch users write it, straight (not
        # unimesh.compile), then .backward() outside: the program is one call in the graph
        import torch

        compiled_loss = torch.compile(
            lambda a, b, v: program(a, b, v).full_tensor(), backend="aot_eager", fullgraph=True
        )
        wc = wd.detach().requires_grad_(True)
        compiled_loss(xs, ys, wc).backward()
        return {
            "grad2": np.asarray(wd.grad.full_tensor(), np.float64),
            "mixed": np.asarray(g.full_tensor(), np.float64),
            "compiled": np.asarray(wc.grad.full_tensor(), np.float64),
        }
    import mlx.core as mx
    from unimesh_mlx import MLXArray

    wm = unimesh.distribute(w, w_layout, backend="mlx")

    def loss(w_local: Any) -> Any:
        return program(x, y, MLXArray(w_local, w_layout, w.shape)).local

    _, g = mx.value_and_grad(loss)(wm.local)
    _, compiled = mx.compile(mx.value_and_grad(loss))(wm.local)  # the graph replayed, compiled
    return {
        "grad2": np.asarray(unimesh.full_array(MLXArray(g, w_layout, w.shape)), np.float64),
        "compiled": np.asarray(
            unimesh.full_array(MLXArray(compiled, w_layout, w.shape)), np.float64
        ),
    }


def mlx_rules_only_when_traced(mesh: unimesh.Mesh) -> float | str:
    """MLX: the issue's example run outside any transform builds no gradient rule (no
    ``CustomTransforms`` node in its graph: nothing can differentiate it), and run under
    ``mx.grad`` it builds them (the tracer probe says so). 0.0, or what went wrong."""
    import io

    import mlx.core as mx
    from unimesh_mlx import MLXArray

    case = next(c for c in CASES if c.name == "issue-example")
    program = case.build(mesh, "mlx")
    x, y, w = case.args
    w_layout = Layout(mesh, P("tp", None))
    wm = unimesh.distribute(w, w_layout, backend="mlx")

    def rules(*arrays: Any) -> int:
        dot = io.StringIO()
        mx.export_to_dot(dot, *arrays)
        return dot.getvalue().count('"CustomTransforms"')

    w_local = wm.local * 1.0  # not a fresh block: only the probe can tell it is not traced
    forward = rules(program(x, y, MLXArray(w_local, w_layout, w.shape)).local)
    traced: list[int] = []

    def loss(v: Any) -> Any:
        out = program(x, y, MLXArray(v, w_layout, w.shape)).local
        traced.append(rules(out))
        return out

    mx.grad(loss)(w_local)
    if forward != 0 or not traced or traced[0] == 0:
        return f"gradient rules: {forward} outside a transform (want 0), {traced} under mx.grad"
    return 0.0


def mlx_compiled_forward_without_rules(mesh: unimesh.Mesh) -> float | str:
    """MLX, ``unimesh.compile`` of the issue's example run forward only (issue 38, item 1): the
    first call traces with the gradient rules, finds that no gradient went through one and the
    second call traces again without them (no rule applied: the compiled graph has none);
    every call's value is the eager one's. ``mx.grad`` of a function calling the same
    compiled program differentiates its graph afterwards, so those calls keep the rules and
    give the eager gradient. 0.0, or what went wrong."""
    import mlx.core as mx
    from unimesh_mlx import MLXArray
    from unimesh_mlx.tracing import RULES

    case = next(c for c in CASES if c.name == "issue-example")
    program = case.build(mesh, "mlx")
    x, y, w = case.args
    w_layout = Layout(mesh, P("tp", None))
    wm = unimesh.distribute(w, w_layout, backend="mlx")
    x, y = (
        unimesh.distribute(a, Layout(mesh, s), backend="mlx")
        for a, s in zip((x, y), case.specs[:2])
    )
    eager = np.asarray(unimesh.full_array(program(x, y, wm)), np.float64)
    compiled = unimesh.compile(program, backend="mlx")
    applied, errors = [], []
    for _ in range(3):
        before = RULES.applied
        got = np.asarray(unimesh.full_array(compiled(x, y, wm)), np.float64)
        applied.append(RULES.applied - before)
        errors.append(float(np.max(np.abs(got - eager))))
    if applied[0] == 0 or applied[1:] != [0, 0] or max(errors) > 1e-6:
        return f"rules applied per call {applied} (want >0, 0, 0), value errors {errors}"

    def loss(w_local: Any) -> Any:
        return compiled(x, y, MLXArray(w_local, w_layout, w.shape)).local

    def eager_loss(w_local: Any) -> Any:
        return program(x, y, MLXArray(w_local, w_layout, w.shape)).local

    want = np.asarray(mx.grad(eager_loss)(wm.local), np.float64)
    worst = max(
        float(np.max(np.abs(np.asarray(mx.grad(loss)(wm.local), np.float64) - want)))
        for _ in range(2)
    )
    return worst if worst > 1e-6 else 0.0


def mlx_compiled_other_mesh(mesh: unimesh.Mesh) -> float | str:
    """MLX, a program's argument laid out on another mesh (the ranks in reverse order, split
    along the other dim): eagerly ``unimesh.reshard`` moves it (send/recv) and the value is
    numpy's; under ``unimesh.compile`` those send/recv rounds cannot be evaluated, so the
    step is refused with an UnsupportedError naming the fix (reshard first), before any
    piece moves; the same program then still runs eagerly. 0.0, or what went wrong."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    other = unimesh.Mesh((4,), ("x",), device_ids=[3, 2, 1, 0])
    src = unimesh.distribute(x, Layout(other, P("x")), backend="mlx")
    program = unimesh.shard_map(
        lambda b: unimesh.psum(b.sum(), ("dp", "tp")), mesh, (P(None, "tp"),), P(), backend="mlx"
    )
    first = float(np.asarray(unimesh.full_array(program(src))))
    compiled = unimesh.compile(program, backend="mlx")
    for call in range(2):  # the second call traces again (after the error): refused too
        try:
            compiled(src)
            return f"compiled call {call} with an argument on another mesh: no refusal"
        except unimesh.UnsupportedError as exc:
            if "unimesh.reshard(x, layout)" not in str(exc) or "mx.compile" not in str(exc):
                return f"unexpected message: {exc}"
    again = float(np.asarray(unimesh.full_array(program(src))))
    want = 2 * float(x.sum())  # each column block is held by both dp replicas: summed twice
    return 0.0 if first == want and again == want else f"eager {first}, {again}; want {want}"


def unused_collective(mesh: unimesh.Mesh, backend: str) -> float | str:
    """Issue 50, item 1: a program whose sender leaves a ppermute's result unused (MLX runs only
    what a result depends on, so the send never ran and the receiver waited forever). Every
    process must run it, eager and compiled; the value is x's dp-0 block kept on dp 0 and
    doubled on dp 1. 0.0, or what went wrong. (Not under a gradient: there the transpose of
    the unused result runs only where it reached the loss; see the issue note.)"""

    def body(x: Any) -> Any:
        got = unimesh.ppermute(2 * x, "dp", [(0, 1)])
        return got if unimesh.axis_index("dp") == 1 else x

    x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    want = np.concatenate([x[:2], 2 * x[:2]])
    program = unimesh.shard_map(body, mesh, P("dp"), P("dp"), backend=backend)
    xd = unimesh.distribute(x, Layout(mesh, P("dp")), backend=backend)
    errors = []
    for run in (
        program,
        unimesh.compile(
            program, backend=backend, compiler_options=COMPILE_OPTIONS.get(backend, {})
        ),
    ):
        for _ in range(2):
            got = np.asarray(unimesh.full_array(run(xd), backend=backend), np.float64)
            errors.append(float(np.max(np.abs(got - want))))

    worst = max(errors)
    return 0.0 if worst < 1e-6 else f"errors (eager, eager, compiled, compiled): {errors}"


def psum_small_ints(mesh: unimesh.Mesh, backend: str) -> float | str:
    """Issue 50, item 2: ``psum`` keeps int8, uint8, int16 and uint16 (JAX's psum does; MLX's
    ring backend, whose groups unimesh emulates by gathering, widened them to 32 bits), over
    one axis and over the world, with the framework's own all-reduce of the world as the
    answer (MLX ``all_sum``, torch ``all_reduce``). 0.0, or what went wrong."""
    problems = []
    # gloo carries no 16-bit ints ("Invalid scalar type" in torch's own distribute_tensor)
    names = ("int8", "uint8") if backend == "torch" else ("int8", "uint8", "int16", "uint16")
    for name in names:
        x = (np.arange(16) % 7).astype(name).reshape(4, 4)
        for axes in ("tp", ("dp", "tp")):
            program = unimesh.shard_map(
                lambda b, axes=axes: unimesh.psum(b, axes),
                mesh,
                P("dp", "tp"),
                P("dp", "tp"),
                backend=backend,
            )
            got = program(unimesh.distribute(x, Layout(mesh, P("dp", "tp")), backend=backend))
            block = unimesh.local_shards(got)
            block = next(iter(block.values()))
            native = _native_world_sum(backend, x, mesh) if axes != "tp" else None
            dtype = str(getattr(block, "dtype", "")).replace("torch.", "").replace("mlx.core.", "")
            if dtype != name:
                problems.append(f"psum over {axes} of {name} gave {dtype}")
            elif native is not None and not np.array_equal(np.asarray(block), native):
                problems.append(f"psum over {axes} of {name}: {np.asarray(block)} vs {native}")
    return "; ".join(problems) or 0.0


def _native_world_sum(backend: str, x: np.ndarray, mesh: unimesh.Mesh) -> np.ndarray:
    """The framework's own all-reduce over every process of this process's (2, 2) block of
    ``x`` under P('dp', 'tp'): the answer a psum over both axes must equal."""
    block = x[Layout(mesh, P("dp", "tp")).shard_slices(x.shape, _rank(backend))]
    if backend == "torch":
        import torch
        import torch.distributed as dist

        t = torch.as_tensor(block.copy())
        dist.all_reduce(t)
        return t.numpy()
    import mlx.core as mx

    return np.asarray(mx.distributed.all_sum(mx.array(block)))


def _rank(backend: str) -> int:
    if backend == "torch":
        import torch.distributed as dist

        return int(dist.get_rank())
    import mlx.core as mx

    return int(mx.distributed.init().rank())


def full_array_bfloat16(mesh: unimesh.Mesh, backend: str) -> float | str:
    """Issue 50, item 8: ``unimesh.full_array`` of a bfloat16 DTensor gave torch's raw
    ``TypeError: Got unsupported ScalarType BFloat16``; now it is the bytes of
    ``full_tensor()``, as an ml_dtypes bfloat16 array (what ``local_shards`` gives). 0.0, or
    what went wrong."""
    import ml_dtypes
    import torch

    x = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
    dt = unimesh.distribute(
        torch.as_tensor(x).to(torch.bfloat16), Layout(mesh, P("dp", "tp")), backend=backend
    )
    got = unimesh.full_array(dt, backend=backend)
    want = dt.full_tensor().view(torch.int16).numpy()
    if got.dtype != ml_dtypes.bfloat16 or got.view(np.int16).tobytes() != want.tobytes():
        return f"full_array gave {got.dtype} {got!r}"
    return 0.0


def mlx_gradient_communication(mesh: unimesh.Mesh) -> float | str:
    """MLX: the collectives of examples/mlp_step.py's gradient step under unimesh.compile
    are the hand-written Megatron/DDP step's (``mx.distributed.all_sum`` forward over "tp"
    and "dp", whose MLX gradient is the identity, then each weight gradient summed over "dp"),
    the same calls of the same shapes; without the body's graph (eager: JAX's check_vma=False
    rules) there are two more (the transposes of the two psums). Counted by wrapping
    ``mx.distributed``'s functions while each step is traced. 0.0, or what went wrong."""
    import sys as _sys
    from pathlib import Path as _Path

    import mlx.core as mx
    from unimesh_mlx import programs

    _sys.path.insert(0, str(_Path(__file__).parents[2] / "examples"))
    import mlp_step

    calls: list[tuple[str, tuple[int, ...]]] = []
    names = ("all_sum", "all_gather", "all_max", "all_min", "send", "recv", "sum_scatter")
    real = {n: getattr(mx.distributed, n) for n in names if hasattr(mx.distributed, n)}

    def counting(name: str) -> Any:
        def call(x: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append((name, tuple(x.shape)))
            return real[name](x, *args, **kwargs)

        return call

    specs = (P("dp", None), P("dp", None), mlp_step.SPECS)
    program = unimesh.shard_map(mlp_step.loss, mesh, specs, P(), backend="mlx")
    x, t, w1, w2 = mlp_step.data()
    xs, ts = (unimesh.distribute(a, Layout(mesh, P("dp", None)), backend="mlx") for a in (x, t))
    params = {
        k: unimesh.distribute(v, Layout(mesh, mlp_step.SPECS[k]), backend="mlx")
        for k, v in (("w1", w1), ("w2", w2))
    }
    step = unimesh.value_and_grad(program, argnums=2, backend="mlx")
    compiled = unimesh.compile(step, backend="mlx")
    native_mesh = unimesh.to_native(mesh, "mlx")
    dp, tp = native_mesh.axis_group("dp").group, native_mesh.axis_group("tp").group

    def native_loss(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        pre = x @ w1
        y = mx.distributed.all_sum((pre * (pre > 0)) @ w2, group=tp)
        diff = y - t
        return mx.distributed.all_sum((diff * diff).sum() / x.shape[0], group=dp) / dp.size()

    def native_step(x: Any, t: Any, w1: Any, w2: Any) -> Any:
        loss, grads = mx.value_and_grad(native_loss, argnums=(2, 3))(x, t, w1, w2)
        return (loss, *(mx.distributed.all_sum(g, group=dp) for g in grads))

    native = mx.compile(native_step)
    blocks = (xs.local, ts.local, params["w1"].local, params["w2"].local)
    runs = {
        "eager": lambda: step(xs, ts, params)[0],
        "compiled": lambda: compiled(xs, ts, params)[0],
        "native": lambda: native(*blocks)[0],
    }
    counted: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    programs._all_reduce.cache_clear()  # it keeps the functions it looked up
    for name in real:
        setattr(mx.distributed, name, counting(name))
    try:
        for name, run in runs.items():
            calls.clear()
            mx.eval(run())
            counted[name] = sorted(calls)
    finally:
        for name, fn in real.items():
            setattr(mx.distributed, name, fn)
        programs._all_reduce.cache_clear()
    if counted["compiled"] != counted["native"]:
        return f"compiled {counted['compiled']} != hand-written {counted['native']}"
    if len(counted["eager"]) != len(counted["native"]) + 2:
        return f"eager {counted['eager']}: expected the hand-written step's and two more"
    return 0.0
