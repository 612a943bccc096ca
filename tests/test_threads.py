"""Thread safety (issue 17): ``to_native``, ``distribute`` and ``current_mesh`` from 8 threads at
once give what one thread gets (JAX, and torch under its fake process group)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import Layout, Mesh, P

from .support.torch_fake import fake_torch_world

MESHES = [
    Mesh((2, 4), ("dp", "tp")),
    Mesh((4, 2), ("dp", "tp"), [[0, 1], [4, 5], [2, 3], [6, 7]]),
    Mesh((8,), ("x",)),
    Mesh((2, 2, 2), ("a", "b", "c"), [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]),
]


def at_once(work: Callable[[int], Any], threads: int = 8, rounds: int = 20) -> list[Any]:
    """``work(i)`` for i in 0..threads*rounds, ``threads`` at a time, all released together
    each round; every result (an exception is re-raised)."""
    results: list[Any] = [None] * (threads * rounds)
    errors: list[BaseException] = []
    for r in range(rounds):
        barrier = threading.Barrier(threads)

        def run(i: int, barrier: threading.Barrier = barrier) -> None:
            try:
                barrier.wait()
                results[i] = work(i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        pool = [threading.Thread(target=run, args=(r * threads + t,)) for t in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(120)
        assert not any(t.is_alive() for t in pool), "a thread is stuck"
    if errors:
        raise errors[0]
    return results


def test_current_mesh_is_per_thread() -> None:
    def work(i: int) -> tuple[Mesh | None, Mesh, Mesh | None]:
        mesh = MESHES[i % len(MESHES)]
        before = unimesh.current_mesh()
        with mesh:
            inside = unimesh.current_mesh()
        return before, inside, unimesh.current_mesh()

    outside = unimesh.current_mesh()
    with MESHES[0]:  # this thread's context is not the others'
        results = at_once(work)
    for i, (before, inside, after) in enumerate(results):
        assert before is None and after is None
        assert inside is MESHES[i % len(MESHES)]
    assert unimesh.current_mesh() is outside


def test_jax_to_native_and_distribute_from_threads() -> None:
    pytest.importorskip("jax")
    import jax

    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    specs = [P("dp", "tp"), P("tp"), P("x"), P(("a", "b"), "c")]

    def one(i: int) -> tuple[Any, Any, dict[int, Any], np.ndarray]:
        mesh = MESHES[i % len(MESHES)]
        layout = Layout(mesh, specs[i % len(MESHES)])
        native = unimesh.to_native(mesh, backend="jax")
        sharding = unimesh.to_native(layout, backend="jax")
        array = unimesh.distribute(x, layout, backend="jax")
        blocks = {s.device.id: np.asarray(s.data) for s in array.addressable_shards}
        return native, sharding, blocks, np.asarray(unimesh.full_array(array))

    together = at_once(one, rounds=3)  # first: the threads build the native meshes
    alone = [one(i) for i in range(len(MESHES))]
    for i, (native, sharding, blocks, whole) in enumerate(together):
        want = alone[i % len(MESHES)]
        assert native == want[0] and sharding == want[1]
        assert isinstance(native, jax.sharding.Mesh)
        assert blocks.keys() == want[2].keys()
        assert all(np.array_equal(blocks[d], want[2][d]) for d in blocks)
        np.testing.assert_array_equal(whole, x)


def test_torch_to_native_and_distribute_from_threads() -> None:
    with fake_torch_world(5, 8):
        x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
        specs = [P("dp", "tp"), P("tp"), P("x"), P(("a", "b"), "c")]

        def one(i: int) -> tuple[Any, tuple[Any, ...], tuple[int, ...], tuple[Any, ...]]:
            mesh = MESHES[i % len(MESHES)]
            layout = Layout(mesh, specs[i % len(MESHES)])
            native = unimesh.to_native(mesh, backend="torch")
            placements = tuple(unimesh.to_native(layout, backend="torch").placements)
            array = unimesh.distribute(x, layout, backend="torch")  # the fake group moves no data
            return native, placements, tuple(array.shape), tuple(array.to_local().shape)

        together = at_once(one, rounds=3)  # first: the threads build the DeviceMeshes
        alone = [one(i) for i in range(len(MESHES))]
        for i, got in enumerate(together):
            want = alone[i % len(MESHES)]
            assert got[0] is want[0]  # one DeviceMesh per mesh: its groups are made once
            assert got[1:] == want[1:]
            block = Layout(MESHES[i % len(MESHES)], specs[i % len(MESHES)]).shard_slices(x.shape, 5)
            assert got[2] == x.shape and got[3] == x[block].shape
