"""The MLX backend in one process (a world of one): the 1-device mesh and the bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

import unimesh
from unimesh import Layout, LayoutError, Mesh, MeshMismatchError, MeshSpecError, P

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from unimesh_mlx import MLXArray, MLXLayout, MLXMesh, shard_linear

ONE = Mesh((1,), ("x",))


def test_one_device_mesh():
    native = unimesh.to_native(ONE, "mlx")
    assert isinstance(native, MLXMesh)
    assert native.rank == 0 and native.coords == {"x": 0}
    assert native.device == mx.default_device()
    group = native.axis_group("x")
    assert group.members == (0,) and group.rank() == 0 and group.size() == 1
    assert group.emulated  # a world of one cannot split
    x = mx.array([1.0, 2.0])
    assert group.all_sum(x).tolist() == [1.0, 2.0]
    assert group.all_max(x).tolist() == [1.0, 2.0] and group.all_min(x).tolist() == [1.0, 2.0]
    assert group.all_gather(x).tolist() == [1.0, 2.0]
    assert unimesh.from_native(native) == ONE
    assert unimesh.from_native(mx.default_device()) == Mesh((1,), ("device",))
    lay = Layout(ONE, P("x"))
    native_layout = unimesh.to_native(lay, "mlx")
    assert isinstance(native_layout, MLXLayout)
    assert native_layout.local_slices((5, 2)) == (slice(0, 5), slice(0, 2))
    assert unimesh.from_native(native_layout) == lay
    data = np.arange(10.0).reshape(5, 2)
    shard = unimesh.distribute(data, lay, "mlx")
    assert isinstance(shard, MLXArray) and isinstance(shard.local, mx.array)
    assert shard.shape == (5, 2) and shard.layout == lay
    np.testing.assert_array_equal(np.array(shard.local), data)
    assert unimesh.get_backend("mlx").local_shards(shard).keys() == {0}


def test_bad_inputs():
    with pytest.raises(
        MeshMismatchError,
        match=r"needs 4 MLX processes.*mpirun --allow-run-as-root "
        r"-np 4 .*mlx\.launch -n 4 --backend ring",
    ):
        unimesh.to_native(Mesh((2, 2), ("dp", "tp")), "mlx")
    with pytest.raises(MeshMismatchError, match="holding devices 0..0"):
        unimesh.to_native(Mesh((1,), ("x",), [3]), "mlx")
    native = unimesh.to_native(ONE, "mlx")
    with pytest.raises(MeshSpecError, match="unknown axis 'tp'"):
        native.axis_group("tp")
    with pytest.raises(LayoutError, match=r"takes P\(axis, None\) or P\(None, axis\)"):
        shard_linear(nn.Linear(2, 2), Layout(ONE, P()), native)
    with pytest.raises(unimesh.UnsupportedError, match="unknown option"):
        unimesh.to_native(ONE, "mlx", colour="red")
    with pytest.raises(unimesh.ConversionError, match="converts MLXMesh and mx.Device"):
        unimesh.from_native(mx.array([1.0]))


def test_gradient_rules_only_where_a_transform_traces(monkeypatch):  # type: ignore[no-untyped-def]
    """With the tracer probe (MLX's own is_tracer), a program keeps its gradient rules for
    exactly the arrays an MLX transform traces: the array it was given and what is computed
    from it, under grad, vjp, jvp, vmap and compile; not a closed-over array, not anything
    outside a transform."""
    from unimesh_mlx import tracing

    be = unimesh.get_backend("mlx")
    probe = tracing.make_probe()
    assert probe is not None, "the self-test failed on this MLX: the probe is off"
    constant = mx.ones((2, 2)) * 3
    assert not be.arrays().needs_grad(constant) and not be.arrays().needs_grad(mx.ones(2) + 1)
    assert probe("not an array") and probe(np.ones(2))  # cannot say: may be traced
    for transform in (
        lambda f, a: mx.grad(f)(a),
        lambda f, a: mx.vjp(f, [a], [mx.array(1.0)]),
        lambda f, a: mx.jvp(f, [a], [mx.ones_like(a)]),
        lambda f, a: mx.vmap(f)(a),
        lambda f, a: mx.compile(f)(a),
    ):
        seen: list[tuple[bool, ...]] = []

        def loss(a, seen=seen):  # type: ignore[no-untyped-def]
            seen.append(tuple(map(be.arrays().needs_grad, (a, a * 2, constant, constant + 1))))
            return (a * constant).sum()

        transform(loss, mx.ones((2, 2)))
        assert seen == [(True, True, False, False)]
    nested: list[tuple[bool, bool]] = []

    def outer(a):  # type: ignore[no-untyped-def]
        def inner(b):  # type: ignore[no-untyped-def]
            nested.append((be.arrays().needs_grad(a), be.arrays().needs_grad(b)))
            return (b * a).sum()

        return mx.grad(inner)(a * 1.0).sum()

    mx.grad(outer)(mx.ones(2))
    assert nested == [(True, True)]  # closed over, but traced by the outer transform
    monkeypatch.setenv("UNIMESH_MLX_TRACER_PROBE", "0")
    assert tracing.make_probe() is None
    assert tracing.tracer_probe.cache_info().currsize == 1  # made once, on first use


def test_gradient_rules_without_the_probe(monkeypatch):  # type: ignore[no-untyped-def]
    """Where MLX cannot be asked, a program skips its gradient rules only for an argument's
    block made from host data (no MLX transform can differentiate it: they trace new array
    objects), and keeps them for every other array, including the tracer mx.grad hands the
    function."""
    from unimesh_mlx import tracing

    monkeypatch.setattr(tracing, "tracer_probe", lambda: None)
    be = unimesh.get_backend("mlx")
    shard = unimesh.distribute(np.ones((2, 2), np.float32), Layout(ONE, P()), "mlx")
    assert not be.arrays().needs_grad(shard.local)
    assert be.arrays().needs_grad(shard.local * 2) and be.arrays().needs_grad(mx.ones(2))
    seen: list[bool] = []

    def loss(a):  # type: ignore[no-untyped-def]
        seen.append(be.arrays().needs_grad(a))
        return (a * a).sum()

    grad = mx.grad(loss)(shard.local)
    assert seen == [True]
    np.testing.assert_array_equal(np.array(grad), 2 * np.ones((2, 2)))
    kept = mx.ones((2, 2))
    assert be.arrays().needs_grad(
        unimesh.from_local({0: kept}, Layout(ONE, P()), (2, 2), "mlx").local
    )
    made = unimesh.from_local({0: np.ones((2, 2))}, Layout(ONE, P()), (2, 2), "mlx")
    assert not be.arrays().needs_grad(made.local)
    key = id(made.local)
    del made, shard
    assert all(be.arrays().needs_grad(mx.zeros(1)) for _ in range(100))  # ids reused: never fresh
    from unimesh_mlx.translate import _FRESH

    assert key not in _FRESH


def test_an_argument_from_another_mesh_moves_by_reshard_and_its_gradient_flows_back():
    """An argument laid out on another mesh than the program's moves by unimesh.reshard (the
    host path before, which cut the gradient and was refused under autodiff): the value and
    the gradient are the analytic ones under unimesh.value_and_grad and a bare mx.grad;
    full_array of a traced array is still refused (JAX refuses a tracer too)."""
    other = Mesh((1,), ("b",))
    x = unimesh.distribute(np.arange(4, dtype=np.float32), Layout(ONE, P()), "mlx")
    program = unimesh.shard_map(lambda v: (v * v).sum(), other, P("b"), P(), backend="mlx")
    assert float(unimesh.full_array(program(x), "mlx")) == 14.0
    value, grad = unimesh.value_and_grad(program, backend="mlx")(x)
    assert float(unimesh.full_array(value, "mlx")) == 14.0
    np.testing.assert_array_equal(unimesh.full_array(grad, "mlx"), 2 * np.arange(4))
    bare = mx.grad(lambda v: program(MLXArray(v, x.layout, x.shape)).local)(x.local)
    np.testing.assert_array_equal(np.array(bare), 2 * np.arange(4))
    with pytest.raises(unimesh.UnsupportedError, match=r"full_array of .*traces"):
        mx.grad(lambda v: mx.array(unimesh.full_array(MLXArray(v, x.layout, x.shape))).sum())(
            x.local
        )
    with pytest.raises(unimesh.UnsupportedError, match=r"full_array of .*traces"):
        mx.grad(lambda v: mx.array(unimesh.full_array(v, "mlx")).sum())(x.local)
    np.testing.assert_array_equal(unimesh.full_array(x.local * 2, "mlx"), 2 * np.arange(4))
    same = unimesh.shard_map(lambda v: (v * v).sum(), ONE, P(), P(), backend="mlx")
    value, grad = unimesh.value_and_grad(same, backend="mlx")(x)
    np.testing.assert_array_equal(unimesh.full_array(grad, "mlx"), 2 * np.arange(4))
    assert float(unimesh.full_array(value, "mlx")) == 14.0


def test_float64_is_kept_and_a_dtype_mlx_lacks_is_refused():
    """Issue 41: full_array of a float64 MLXArray rounded through float32, and distribute of
    float64 data gave float32 blocks. Now both keep float64, bit for bit (numpy in float64 is
    the reference), as do program arguments given as global arrays."""
    data = np.arange(12, dtype=np.float64).reshape(6, 2) / 12.0
    lay = Layout(ONE, P("x"))
    shard = unimesh.distribute(data, lay, "mlx")
    assert shard.local.dtype == mx.float64
    whole = unimesh.full_array(shard)
    assert whole.dtype == np.float64
    np.testing.assert_array_equal(whole, data)  # 1/12 was 0.0833333358168602
    program = unimesh.shard_map(lambda b: b * 3.0, ONE, P("x"), P("x"), backend="mlx")
    out = program(data)
    assert out.local.dtype == mx.float64
    np.testing.assert_array_equal(unimesh.full_array(out), data * 3.0)
    for dtype in (np.float32, np.float16, np.int64, np.int8, np.uint8, np.bool_):
        got = unimesh.distribute(data.astype(dtype), lay, "mlx")
        assert np.array(got.local).dtype == np.dtype(dtype), dtype
    with pytest.raises(unimesh.ConversionError, match="MLX has no dtype complex128"):
        unimesh.distribute(data.astype(np.complex128), lay, "mlx")


_WATCHED = r"""
import os, sys, time
from unimesh_mlx.process import PROCESS
pids = set()
for i in range(20):
    with PROCESS.watch(30, "a quick call", f"q{i}", "0"):
        pids.add(PROCESS.watchdog_pid)
try:
    with PROCESS.watch(30, "a call that raises", "r", "0"):
        raise ValueError("inside")
except ValueError:
    pass
pids.add(PROCESS.watchdog_pid)
print("GUARDS", len(pids), flush=True)
PROCESS.stop_watchdog()
time.sleep(0.2)
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"
print("STOPPED", not any(map(alive, pids)), flush=True)
if os.fork() == 0:  # a child that outlives this process must not keep a watchdog alive
    os.close(1)
    os.close(2)
    time.sleep(3)
    os._exit(0)
with PROCESS.watch(1, "a stuck call", "s", "0"):
    time.sleep(30)
print("NOT ENDED", flush=True)
"""


def test_one_watchdog_process_bounds_every_watched_call(tmp_path):  # type: ignore[no-untyped-def]
    """MLX collectives cannot be interrupted, so a watched call runs under a watchdog process:
    one per process, armed and disarmed for each call (a call that raises disarms it too),
    ended by ``PROCESS.stop_watchdog``; a call that overruns its time ends this process
    (SIGTERM) with the message, even with a forked child alive that inherited the watchdog's
    pipe."""
    import os
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _WATCHED],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert "GUARDS 1" in proc.stdout, proc.stdout + proc.stderr
    assert "STOPPED True" in proc.stdout, proc.stdout + proc.stderr
    assert "NOT ENDED" not in proc.stdout
    assert proc.returncode == -15, (proc.returncode, proc.stderr)
    assert "a stuck call did not finish within 1 s" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 60  # ended by the watchdog, not by the 30 s sleep


def test_the_launcher_is_read_once_into_one_record(tmp_path):  # type: ignore[no-untyped-def]
    """What mpirun and mlx.launch tell a process, as the process state reads it: the world
    size and the variable that says so, the rank, whether groups split, the job's key for
    its sign-ins and whether the job runs on this machine alone."""
    import json

    from unimesh_mlx.process import Launcher

    mpi = Launcher.read(
        {
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "PMIX_NAMESPACE": "job7",
        }
    )
    assert mpi == Launcher((4, "OMPI_COMM_WORLD_SIZE=4"), "2", True, True, "mpi job7", True)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]]))
    ring = Launcher.read({"MLX_HOSTFILE": str(hosts), "MLX_RANK": "1"})
    assert ring.world == (3, "MLX_HOSTFILE lists 3 hosts") and ring.rank == "1"
    assert ring.split is False and not ring.mpi_ranks and ring.single
    assert ring.job is not None and ring.job.startswith("ring ")
    hosts.write_text("")
    assert Launcher.read({"MLX_HOSTFILE": str(hosts)}).job is None  # no hosts: no sign-ins
    assert Launcher.read({}) == Launcher(None, "?", None, False, None, False)


def test_the_watchdog_names_who_never_came(tmp_path):  # type: ignore[no-untyped-def]
    """The watchdog module's message: the ranks that never signed in for the stage, where the
    job runs on this machine alone; else the ranks of this machine that did."""
    from unimesh_mlx.watchdog import overdue

    for name in ("s.0", "s.2", "t.1"):
        (tmp_path / name).touch()
    where = str(tmp_path)
    assert overdue("late", where, "s", 4, True) == (
        "late: ranks [1, 3] never reached it (of 4 processes, all on this machine)"
    )
    assert overdue("late", where, "t", 2, True) == (
        "late: rank 0 never reached it (of 2 processes, all on this machine)"
    )
    assert overdue("late", where, "s", 8, False) == (
        "late: of the processes on this machine, ranks [0, 2] reached it"
    )
    assert overdue("late", "", "s", 4, True) == "late"
    assert overdue("late", str(tmp_path / "gone"), "s", 4, True) == "late"


def test_a_forked_child_lets_go_of_the_parents_sign_ins(tmp_path):  # type: ignore[no-untyped-def]
    """After a fork, the child's process state holds no sign-in of its parent's (the
    parent removes them), nor its watchdog."""
    from unimesh_mlx.process import MLXProcess

    state = MLXProcess()
    state.sign_in(str(tmp_path), "init", "0")
    signed = tmp_path / "init.0"
    assert signed.exists()
    state.after_fork()
    state.sign_out()
    assert signed.exists() and state.watchdog_pid is None
    state.sign_in(str(tmp_path), "check1", "0")
    state.sign_out()  # its own, and the directory, once empty of others
    assert not (tmp_path / "check1.0").exists() and signed.exists()


def test_compiled_steps_keep_each_constant_its_own_trace():
    """unimesh.compile keys a trace by each constant argument's type and, for floats, its
    bits: 1 and True, 0.0 and -0.0 are different constants of the step (== says they are
    equal); a NaN finds its trace again (== says it is not equal to itself)."""
    calls = []

    def step(x, c):
        calls.append(c)
        return x * 2.0, c

    f = unimesh.compile(step, backend="mlx")
    x = mx.array([1.0])
    assert f(x, 1)[1] is not True and f(x, True)[1] is True
    assert f(x, 0.0)[1].hex() == "0x0.0p+0" and f(x, -0.0)[1].hex() == "-0x0.0p+0"
    assert f(x, np.float32(0.5))[1] == np.float32(0.5) and f(x, np.float32(2.0))[1] == 2.0
    traced = len(calls)
    for _ in range(6):
        f(x, float("nan"))
    assert len(calls) == traced + 2  # one trace for every NaN (and its lean retrace)


def test_value_and_grad_takes_numpy_arguments_as_jax_does():  # type: ignore[no-untyped-def]
    """A floating numpy argument of a program is differentiated as an mx.array made from it
    (jax.grad takes numpy too; MLX's value_and_grad raised its tree_flatten error): the
    gradient is a global array, mx.grad's of the same array. A Python float is float32, MLX's
    default; an integer numpy leaf is refused by name (jax.grad refuses it too)."""
    program = unimesh.shard_map(lambda v: (v * v * v).sum(), ONE, P(), P(), backend="mlx")
    a = np.array([1.0, -2.0, 0.5], np.float32)
    value, grad = unimesh.value_and_grad(program, backend="mlx")(a)
    native = mx.grad(lambda v: (v * v * v).sum())(mx.array(a))
    np.testing.assert_array_equal(np.array(grad), np.array(native))
    assert float(unimesh.full_array(value, "mlx")) == pytest.approx(float((a**3).sum()))
    _, g = unimesh.value_and_grad(lambda v: v * v, backend="mlx")(1.5)
    assert g.dtype == mx.float32 and float(g) == 3.0
    with pytest.raises(unimesh.ConversionError, match=r"argument 0: its leaf .* not a float"):
        unimesh.value_and_grad(program, backend="mlx")(np.arange(3))
