"""``unimesh.reshard`` cases for 4 processes of one device each (torch under torchrun, MLX under
mpirun and mlx.launch), run inside the program launches (program_worker.py) and on JAX's 8
devices in the test process (test_reshard.py).

Each case distributes a numpy array on a source layout, reshards it, and checks on every process
that each of its devices holds exactly ``target.shard_slices`` of the array (bit for bit) and
that ``stats["bytes_received"]`` is the minimum: the elements of this process's target blocks
that none of its source blocks holds, counted with numpy masks (not with the planner).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import unimesh
from unimesh import Layout, Mesh, P
from unimesh.spec import entry_axes


def meshes(world: int) -> dict[str, Mesh]:
    """Meshes over ``world`` devices: 2 x world/2, a line, the devices in another order
    (transposed: increasing along each axis, as DTensor needs of a sharded axis), and half of
    them (a sub-mesh)."""
    order = np.arange(world).reshape(world // 2, 2).T
    return {
        "square": Mesh((2, world // 2), ("dp", "tp")),
        "line": Mesh((world,), ("x",)),
        "transposed": Mesh(order.shape, ("u", "v"), device_ids=order),
        "half": Mesh((world // 2,), ("y",), device_ids=list(range(1, world, 2))),
    }


def cases(
    world: int, subsets: bool, uneven: bool
) -> list[tuple[str, Layout, Layout, tuple[int, ...], str]]:
    """(name, source, target, shape, dtype) for a job of ``world`` devices (4 or 8); ``subsets``
    adds meshes over some of them, ``uneven`` blocks that do not divide evenly."""
    m = meshes(world)
    sq, line, tr = m["square"], m["line"], m["transposed"]
    out = [
        ("same-mesh", Layout(sq, P("dp", "tp")), Layout(sq, P("tp", "dp")), (8, 8), "float32"),
        ("same-layout", Layout(sq, P("dp", "tp")), Layout(sq, P("dp", "tp")), (8, 8), "float32"),
        ("other-mesh", Layout(sq, P("dp")), Layout(tr, P(None, "v")), (8, 8), "float32"),
        ("tuple-axes", Layout(sq, P(("tp", "dp"))), Layout(line, P(None, "x")), (8, 16), "float32"),
        ("replicated-to-sharded", Layout(line, P()), Layout(sq, P("tp", "dp")), (8, 8), "float32"),
        ("bfloat16", Layout(sq, P("dp")), Layout(tr, P(("u", "v"))), (16, 3), "bfloat16"),
        ("int64", Layout(line, P("x")), Layout(sq, P(None, ("dp", "tp"))), (8, 8), "int64"),
        ("bool", Layout(sq, P("tp")), Layout(line, P("x")), (8, 2), "bool"),
    ]
    if uneven:
        out += [
            # torch's redistribute is wrong here, silently (pytorch#194457): [Shard(0),
            # Shard(0)] of an uneven (5, 3) to [Replicate(), Replicate()]
            ("uneven-to-replicated", Layout(sq, P(("dp", "tp"))), Layout(sq, P()), (5, 3),
             "float32"),
            ("uneven", Layout(sq, P("tp", "dp")), Layout(tr, P("v", "u")), (7, 5), "float32"),
        ]  # fmt: skip
    if subsets and uneven:
        # ranks 0 and 2 hold no source block, and rank 2's target block is empty
        out.append(
            ("empty-target-block", Layout(m["half"], P("y")), Layout(line, P("x")), (2, 3),
             "float32")
        )  # fmt: skip
    if subsets:
        half = m["half"]
        out += [
            ("subset-to-all", Layout(half, P("y")), Layout(sq, P("tp", "dp")), (8, 8), "float32"),
            (
                "all-to-subset",
                Layout(sq, P("dp", "tp")),
                Layout(half, P(None, "y")),
                (8, 8),
                "int64",
            ),
        ]
    return out


def value(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A global array whose every element differs (bools: a pattern)."""
    n = int(np.prod(shape))
    if dtype == "bool":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if dtype == "bfloat16":
        import ml_dtypes

        return (np.arange(n, dtype=np.float32) / 8).astype(ml_dtypes.bfloat16).reshape(shape)
    return (np.arange(n) * 7 % 101).astype(dtype).reshape(shape)


def minimum_received(
    source: Layout, target: Layout, shape: tuple[int, ...], mine: set[int], itemsize: int
) -> int:
    """Bytes of this process's target blocks that none of its source blocks holds."""
    need = np.zeros(shape, bool)
    held = np.zeros(shape, bool)
    for d in target.mesh.device_ids.ravel().tolist():
        if d in mine:
            need[target.shard_slices(shape, d)] = True
    for d in source.mesh.device_ids.ravel().tolist():
        if d in mine:
            held[source.shard_slices(shape, d)] = True
    return int((need & ~held).sum()) * itemsize


def _unmoved(moved: Any, placed: Any) -> bool:
    """Whether a reshard gave back ``placed``'s own blocks: the array itself (JAX, MLX), or
    a DTensor on the same local tensor (torch's ``redistribute`` to its placements)."""
    if moved is placed:
        return True
    here, there = getattr(moved, "to_local", None), getattr(placed, "to_local", None)
    return here is not None and there is not None and here().data_ptr() == there().data_ptr()


def check(
    backend: str, source: Layout, target: Layout, shape: tuple[int, ...], dtype: str,
    mine: set[int],
) -> float | str:  # fmt: skip
    """0.0 when the reshard is right on this process; else what is wrong."""
    x = value(shape, dtype)
    placed = unimesh.distribute(x, source, backend=backend)
    held = unimesh.local_shards(placed, backend=backend)
    if held:  # as the framework holds it (JAX without x64 keeps int64 as int32)
        x = x.astype(next(iter(held.values())).dtype)
    stats: dict[str, int] = {}
    moved = unimesh.reshard(placed, target, stats=stats)
    if source == target and not _unmoved(moved, placed):  # (its mesh may record
        return "a reshard to the array's own layout copied it (nothing has to move)"  # dpp)
    blocks = unimesh.local_shards(moved, backend=backend)
    wanted = {d for d in target.mesh.device_ids.ravel().tolist() if d in mine}
    if set(blocks) - wanted or (wanted - set(blocks) and wanted):
        return f"blocks on devices {sorted(blocks)}, wanted {sorted(wanted)}"
    for d, block in blocks.items():
        want = x[target.shard_slices(shape, d)]
        got = np.asarray(block)
        if (
            got.shape != want.shape
            or got.dtype != want.dtype
            or not np.array_equal(got.view(np.uint8), want.view(np.uint8))
        ):
            return f"device {d}: got {got!r}, wanted {want!r}"
    floor = minimum_received(source, target, shape, mine, x.dtype.itemsize)
    if stats.get("bytes_received") != floor:
        return f"bytes_received {stats.get('bytes_received')}, the minimum is {floor}"
    return 0.0


def run_all(backend: str, world: int, mine: set[int], subsets: bool) -> dict[str, Any]:
    """Every case, ``reshard:NAME`` -> 0.0 or the problem (text)."""
    import traceback

    uneven = unimesh.get_backend(backend).supports("uneven_shards")
    report: dict[str, Any] = {}
    for name, source, target, shape, dtype in cases(world, subsets, uneven):
        try:
            report[f"reshard:{name}"] = check(backend, source, target, shape, dtype, mine)
        except Exception:  # noqa: BLE001 - any failure is this case's
            report[f"reshard:{name}"] = traceback.format_exc(limit=8)
    # the exchange in rounds of a few bytes (unimesh.moves.IN_FLIGHT: 64 MiB per process by
    # default): every pair's pieces spread over rounds all processes count alike
    from unimesh import moves

    kept, moves.IN_FLIGHT = moves.IN_FLIGHT, 96
    try:
        sq, line = meshes(world)["square"], meshes(world)["line"]
        report["reshard:rounds"] = check(
            backend, Layout(sq, P("dp", "tp")), Layout(line, P(None, "x")), (8, 24), "float32", mine
        )
    except Exception:  # noqa: BLE001 - any failure is this case's
        report["reshard:rounds"] = traceback.format_exc(limit=8)
    finally:
        moves.IN_FLIGHT = kept
    if backend in ("torch", "mlx"):
        try:
            gradient = torch_gradient if backend == "torch" else mlx_gradient
            report["reshard:gradient"] = gradient(min(mine))
        except Exception:  # noqa: BLE001 - any failure is this case's
            report["reshard:gradient"] = traceback.format_exc(limit=8)
    if backend == "mlx":  # a program with a psum after the reshard, differentiated
        for name, source, target, shape, over in psum_gradient_cases(world, uneven):
            try:
                report[f"psum-gradient:{name}"] = check_psum_gradient(
                    backend, source, target, shape, over, mine
                )
            except Exception:  # noqa: BLE001 - any failure is this case's
                report[f"psum-gradient:{name}"] = traceback.format_exc(limit=8)
    if unimesh.get_backend(backend).supports("partial") and backend != "jax":
        for name, source, target, shape, dtype in partial_cases(world):
            try:
                report[f"reshard:{name}"] = check_partial(
                    backend, source, target, shape, dtype, mine
                )
            except Exception:  # noqa: BLE001 - any failure is this case's
                report[f"reshard:{name}"] = traceback.format_exc(limit=8)
    return report


def partial_cases(world: int) -> list[tuple[str, Layout, Layout, tuple[int, ...], str]]:
    """Sources holding a pending reduction over tp: to P('tp') a reduce-scatter, to P() an
    all-reduce, and a max."""
    sq = meshes(world)["square"]
    return [
        ("partial-sum-to-sharded", Layout(sq, P(None, partial={"tp": "sum"})),
         Layout(sq, P("tp")), (8, 4), "float32"),
        ("partial-sum-to-replicated", Layout(sq, P("dp", partial={"tp": "sum"})),
         Layout(sq, P()), (6, 3), "int64"),
        ("partial-max-other-spec", Layout(sq, P("dp", partial={"tp": "max"})),
         Layout(sq, P(None, "dp")), (4, 6), "float32"),
    ]  # fmt: skip


def check_partial(
    backend: str, source: Layout, target: Layout, shape: tuple[int, ...], dtype: str,
    mine: set[int],
) -> float | str:  # fmt: skip
    """Each device's addend of ``value``: the block plus a pattern, and minus the pattern on
    the other coordinate (their sum is the block); for max the block, and the block minus one
    off the first coordinate; moved and reduced,
    every target block must be ``value``'s, and bytes received the minimum per addend."""
    x = value(shape, dtype)
    mesh = source.mesh
    (axis, op), = source.spec.partial.items()  # fmt: skip
    where = {int(d): c for c, d in np.ndenumerate(mesh.device_ids)}
    k = mesh.axis_names.index(axis)
    blocks = {}
    for d in sorted(mine & set(where)):
        block = x[source.shard_slices(shape, d)]
        c = where[d][k]
        if op == "sum":
            pattern = (np.arange(block.size) % 5).reshape(block.shape).astype(block.dtype)
            # the first coordinate holds the block plus the pattern, the second minus it
            blocks[d] = block + pattern if c == 0 else -pattern if c == 1 else 0 * pattern
        else:
            blocks[d] = block if c == 0 else block - 1
    placed = unimesh.from_local(blocks, source, shape, backend=backend)
    stats: dict[str, int] = {}
    moved = unimesh.reshard(placed, target, stats=stats)
    got_blocks = unimesh.local_shards(moved, backend=backend)
    for d, got in got_blocks.items():
        want = x[target.shard_slices(shape, d)]
        if not np.array_equal(np.asarray(got), want):
            return f"device {d}: got {np.asarray(got)!r}, wanted {want!r}"
    floor = 0
    for at in range(mesh.axis_size(axis)):  # the devices at each coordinate: one addend
        sub = {d for d, c in where.items() if c[k] == at}
        need = np.zeros(shape, bool)
        held = np.zeros(shape, bool)
        for d in target.mesh.device_ids.ravel().tolist():
            if d in mine:
                need[target.shard_slices(shape, d)] = True
        for d in sub & mine:
            held[source.shard_slices(shape, d)] = True
        floor += int((need & ~held).sum()) * x.dtype.itemsize
    if stats.get("bytes_received") != floor:
        return f"bytes_received {stats.get('bytes_received')}, the minimum is {floor}"
    return 0.0


def _gradient_problem() -> tuple[dict[str, Mesh], Layout, tuple[int, ...], Any, Any]:
    """The meshes, the source, the shape, the weights w and the value of the gradient cases."""
    m = meshes(4)
    shape = (8, 6)
    w = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    return m, Layout(m["square"], P(("dp", "tp"))), shape, w, value(shape, "float32")


def _gradient_cases(m: dict[str, Mesh], source: Layout) -> list[tuple[Layout, Layout, int]]:
    """(source, target, factor of w): split and replicated targets, a replicated source."""
    return [
        (source, Layout(m["line"], P(None, "x")), 1),
        (source, Layout(m["line"], P()), 1),
        (Layout(m["line"], P()), Layout(m["square"], P("tp", "dp")), 1),  # replicated source
    ]


def torch_gradient(rank: int) -> float | str:
    """torch's own autograd through a reshard (4 ranks): the loss <w, x> (each rank's part
    <w, its target block>; a replicated target's part is the whole, the same on every rank,
    as DTensor and jax.grad read a replicated value) has the gradient w, laid out like the
    source: the reverse reshard of the cotangent (a replicated source gets all of w on each
    replica, as DTensor.redistribute's backward gives it). 0.0 when all are right."""
    import torch

    m, source, shape, w, x = _gradient_problem()
    cases = [
        *_gradient_cases(m, source),
        # from half of the ranks: ranks 0 and 2 only receive, and must still run the backward
        (Layout(m["half"], P("y")), Layout(m["square"], P("tp", "dp")), 1),
    ]
    # a rank that sends but holds no target block could not run the backward: refused before
    # anything moves, on every rank
    placed = unimesh.distribute(x, source, backend="torch").requires_grad_(True)
    try:
        unimesh.reshard(placed, Layout(m["half"], P("y")))
        return "a move that leaves sending ranks without a target block was taken under grad"
    except unimesh.UnsupportedError as exc:
        if "hold source blocks but no target block" not in str(exc):
            return f"unexpected refusal: {exc}"
    with torch.no_grad():  # without grad it moves
        unimesh.reshard(placed, Layout(m["half"], P("y")))
    # a pending max under grad: its gradient is not a move, refused before anything moves
    peak = Layout(m["square"], P("dp", partial={"tp": "max"}))
    mine_block = x[peak.shard_slices(shape, rank)]
    held = unimesh.from_local({rank: mine_block}, peak, shape, backend="torch")
    try:
        unimesh.reshard(held.requires_grad_(True), Layout(m["line"], P("x")))
        return "a pending max was moved under grad"
    except unimesh.UnsupportedError as exc:
        if "gradient of a pending max" not in str(exc):
            return f"unexpected refusal: {exc}"
    for source, target, factor in cases:
        placed = unimesh.distribute(x, source, backend="torch").requires_grad_(True)
        moved = unimesh.reshard(placed, target)
        local = moved.to_local()
        mine = torch.from_numpy(np.ascontiguousarray(w[target.shard_slices(shape, rank)]))
        (local * mine).sum().backward()
        if rank not in source.mesh.device_ids:
            continue
        got = placed.grad.to_local().numpy()
        want = factor * w[source.shard_slices(shape, rank)]
        if not np.allclose(got, want, rtol=1e-6, atol=1e-6):
            return f"to {target!r}: gradient {got!r}, wanted {want!r}"
    return 0.0


def mlx_gradient(rank: int) -> float | str:
    """MLX through ``unimesh.value_and_grad`` (4 ranks): the same loss and expected gradient
    as :func:`torch_gradient` (w, laid out like the source, replicated sources included)."""
    m, source, shape, w, x = _gradient_problem()
    cases = [
        *_gradient_cases(m, source),
        (source, Layout(m["transposed"], P("v", "u")), 1),
    ]
    import mlx.core as mx

    for source, target, factor in cases:
        placed = unimesh.distribute(x, source, backend="mlx")
        mine = mx.array(np.ascontiguousarray(w[target.shard_slices(shape, rank)]))

        def loss(a: Any, target: Layout = target, mine: Any = mine) -> Any:
            return (unimesh.reshard(a, target).local * mine).sum()

        val, grad = unimesh.value_and_grad(loss)(placed)
        got = np.asarray(grad.local)
        want = factor * w[source.shard_slices(shape, rank)]
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            return f"to {target!r}: gradient {got!r}, wanted {want!r}"
        expect = float(
            (x[target.shard_slices(shape, rank)] * w[target.shard_slices(shape, rank)]).sum()
        )
        if not np.isclose(float(np.asarray(val)), expect, rtol=1e-5):
            return f"to {target!r}: value {val}, wanted {expect}"
    return 0.0


#: where the program after a reshard sums, case by case in turn: over every axis that splits
#: the target, over its first (a second program sums over the rest), over none (the second
#: program sums over all)
PSUM_OVER = ("all", "one", "none")


def psum_gradient_cases(
    world: int, uneven: bool
) -> list[tuple[str, Layout, Layout, tuple[int, ...], str]]:
    """(name, source, target, shape, where the psum is) for every source/target pair of
    :func:`cases` (float32, whatever the case's dtype), the psum variant rotating through
    :data:`PSUM_OVER`."""
    return [
        (name, source, target, shape, PSUM_OVER[i % len(PSUM_OVER)])
        for i, (name, source, target, shape, _) in enumerate(cases(world, False, uneven))
    ]


def psum_loss(backend: str, target: Layout, over: str, shape: tuple[int, ...]) -> Any:
    """The loss of a training step: reshard the parameter to ``target``, then a program
    summing ``sin`` of its block with a psum over ``over`` of the target's axes; where that
    leaves a value varying along some axes, a second program sums them. Every variant is
    the global ``sum(sin(x))``, so ``jax.grad`` of it is ``cos(x)``."""
    if backend == "jax":
        import jax.numpy as sin_of  # jnp.sin and mx.sin alike
    else:
        import mlx.core as sin_of
    mesh, axes = target.mesh, target.spec.axes()
    first = axes if over == "all" else axes[:1] if over == "one" else ()
    rest = tuple(a for a in axes if a not in first)
    spec, share = target.spec, 1
    if not _even(target, shape):  # shard_map takes equal blocks: the program takes the whole value
        # (moved by a second reshard as it enters) and sums it, a 1/n share on each device
        spec, share, first, rest = P(), math.prod(mesh.axis_size(a) for a in axes), axes, ()

    def body(b: Any) -> Any:
        total = sin_of.sin(b).sum() / share
        if not rest:  # nothing varies after this psum: the loss itself
            return unimesh.psum(total, first) if first else total
        total = total.reshape((1,))
        return unimesh.psum(total, first) if first else total

    def loss(x: Any) -> Any:
        y = unimesh.reshard(x, target)
        out = P() if not rest else P(rest)
        z = unimesh.shard_map(body, mesh, in_specs=spec, out_specs=out, backend=backend)(y)
        if not rest:
            return z
        return unimesh.shard_map(
            lambda c: unimesh.psum(c.sum(), rest), mesh, in_specs=P(rest), out_specs=P(),
            backend=backend,
        )(z)  # fmt: skip

    return loss


def _even(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether every dim splits into equal blocks under ``layout``."""
    return all(
        shape[d] % math.prod(layout.mesh.axis_size(a) for a in entry_axes(e)) == 0
        for d, e in enumerate(layout.spec)
    )


def _crosses_processes(source: Layout, target: Layout, shape: tuple[int, ...]) -> bool:
    """Whether some device's target block holds elements its source block does not (one
    device per process: a move between processes), counted with numpy masks."""
    ids = {int(d) for lay in (source, target) for d in lay.mesh.device_ids.ravel().tolist()}
    return any(minimum_received(source, target, shape, {d}, 1) for d in ids)


def check_psum_gradient(
    backend: str, source: Layout, target: Layout, shape: tuple[int, ...], over: str,
    mine: set[int],
) -> float | str:  # fmt: skip
    """0.0 when ``unimesh.value_and_grad`` of :func:`psum_loss` gives the value ``sum(sin(x))``
    and the gradient ``cos(x)`` (float64, to 1e-5 of max(1, |x|)) laid out like the source,
    on every device here: eagerly, and under ``unimesh.compile`` where neither the move nor
    its reverse sends between processes (else an UnsupportedError naming unimesh.compile
    before anything moves, which the MLX engine gives where its sends run as called)."""
    x = value(shape, "float32") / 32
    want_value = float(np.sin(x.astype(np.float64)).sum())
    want_grad = np.cos(x.astype(np.float64))
    placed = unimesh.distribute(x, source, backend=backend)
    step = unimesh.value_and_grad(psum_loss(backend, target, over, shape), backend=backend)
    runs = {"eager": step}
    if backend != "jax":
        runs["compiled"] = unimesh.compile(step, backend=backend)
    refused = _crosses_processes(source, target, shape) or _crosses_processes(target, source, shape)
    for how, run in runs.items():
        try:
            val, grad = run(placed)
        except unimesh.UnsupportedError as exc:
            if how == "compiled" and refused and "under unimesh.compile" in str(exc):
                continue
            raise
        if how == "compiled" and refused:
            return "compiled: a move between processes was traced, not refused"
        got = float(np.asarray(getattr(val, "local", val)))
        if abs(got - want_value) > 1e-5 * max(1.0, abs(want_value)):
            return f"{how}: value {got}, wanted {want_value}"
        for d, block in unimesh.local_shards(grad, backend=backend).items():
            if d not in mine:
                continue
            want = want_grad[source.shard_slices(shape, d)]
            have = np.asarray(block, dtype=np.float64)
            if (
                have.shape != want.shape
                or (np.abs(have - want) > 1e-5 * np.maximum(1.0, np.abs(want))).any()
            ):
                return f"{how}: device {d}: gradient {have!r}, wanted {want!r}"
    return 0.0


def cross_cases(
    world: int, other: str
) -> list[tuple[str, str, str, Layout, Layout, tuple[int, ...], str]]:
    """(name, from backend, to backend, source, target, shape, dtype): torch and ``other``
    (jax or mlx) in the same ``world`` processes, one device each, both ways."""
    m = meshes(world)
    sq, line, tr = m["square"], m["line"], m["transposed"]
    out = [
        ("in-place", "torch", other, Layout(sq, P("dp", "tp")), Layout(sq, P("dp", "tp")),
         (8, 8), "float32"),
        ("same-mesh", "torch", other, Layout(sq, P("dp", "tp")), Layout(sq, P("tp", "dp")),
         (8, 8), "float32"),
        ("other-mesh", "torch", other, Layout(sq, P("dp")), Layout(tr, P(None, "v")), (8, 8),
         "float32"),
        ("bfloat16", "torch", other, Layout(sq, P("dp")), Layout(line, P(None, "x")), (4, 8),
         "bfloat16"),
        ("int64", "torch", other, Layout(line, P("x")), Layout(sq, P(None, ("dp", "tp"))),
         (8, 8), "int64"),
        ("bool", "torch", other, Layout(sq, P("tp")), Layout(line, P("x")), (8, 2), "bool"),
        ("back-same-mesh", other, "torch", Layout(sq, P("dp", "tp")), Layout(sq, P("tp")),
         (8, 8), "float32"),
        ("back-other-mesh", other, "torch", Layout(sq, P("dp")), Layout(tr, P("u", "v")),
         (8, 8), "float32"),
        ("back-bfloat16", other, "torch", Layout(line, P("x")), Layout(sq, P(None, "tp")),
         (8, 4), "bfloat16"),
        # uneven blocks, which JAX cannot hold: to torch's uneven rows (6 over 4: the move
        # runs on torch's engine after the blocks cross), and from torch's uneven rows to
        # even columns (on torch's engine, then across)
        ("back-uneven", other, "torch", Layout(line, P(None, "x")),
         Layout(Mesh((world,), ("w",)), P("w")), (6, 12), "float32"),
        ("uneven-source", "torch", other, Layout(line, P("x")),
         Layout(sq, P(None, ("dp", "tp"))), (6, 12), "float32"),
    ]  # fmt: skip
    return out


def _pointer(array: Any) -> int | None:
    """The address of this process's block of a DTensor, a jax.Array or an MLXArray."""
    if hasattr(array, "to_local"):
        local = array.to_local()
        return int(local.data_ptr()) if local.numel() else None
    shards = getattr(array, "addressable_shards", None)
    if shards:
        return int(shards[0].data.unsafe_buffer_pointer())
    return None


def check_cross(
    name: str, frm: str, to: str, source: Layout, target: Layout, shape: tuple[int, ...],
    dtype: str, mine: set[int],
) -> float | str:  # fmt: skip
    """0.0 when ``reshard(x, target, backend=to)`` of ``frm``'s array is ``to``'s, right bit
    for bit (in ``to``'s dtype: JAX without x64 keeps int64 as int32), moved the minimum, and
    (``in-place``) shares the source block's memory where DLPack can."""
    x = value(shape, dtype)
    placed = unimesh.distribute(x, source, backend=frm)
    stats: dict[str, int] = {}
    if to == "jax" and dtype == "int64":  # JAX without x64 would narrow it: refused
        try:
            unimesh.reshard(placed, target, backend=to, stats=stats)
        except unimesh.UnsupportedError as exc:
            ok = "losing values" in str(exc) and "jax_enable_x64" in str(exc) and not stats
            return 0.0 if ok else f"unexpected refusal: {exc}"
        return "int64 went to JAX without x64 (narrowed to int32)"
    moved = unimesh.reshard(placed, target, backend=to, stats=stats)
    if unimesh.get_backend(to).name != unimesh.registry.owner_of(moved).name:
        return f"got a {unimesh.registry.owner_of(moved).name} array, wanted {to}'s"
    blocks = unimesh.local_shards(moved, backend=to)
    wanted = {d for d in target.mesh.device_ids.ravel().tolist() if d in mine}
    if set(blocks) != wanted:
        return f"blocks on devices {sorted(blocks)}, wanted {sorted(wanted)}"
    for d, block in blocks.items():
        got = np.asarray(block)
        want = x[target.shard_slices(shape, d)].astype(got.dtype)
        if got.shape != want.shape or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
            return f"device {d}: got {got!r}, wanted {want!r}"
    floor = minimum_received(source, target, shape, mine, x.dtype.itemsize)
    if stats.get("bytes_received") != floor:
        return f"bytes_received {stats.get('bytes_received')}, the minimum is {floor}"
    if name == "in-place" and to != "mlx" and _pointer(placed) != _pointer(moved):
        return "the block in place was copied (DLPack shares it)"
    return 0.0


def run_cross(other: str, world: int, mine: set[int]) -> dict[str, Any]:
    """Every cross-framework case, ``cross:NAME`` -> 0.0 or the problem."""
    import traceback

    report: dict[str, Any] = {}
    for name, frm, to, source, target, shape, dtype in cross_cases(world, other):
        try:
            report[f"cross:{name}"] = check_cross(name, frm, to, source, target, shape, dtype,
                                                  mine)  # fmt: skip
        except Exception:  # noqa: BLE001 - any failure is this case's
            report[f"cross:{name}"] = traceback.format_exc(limit=8)
    return report
