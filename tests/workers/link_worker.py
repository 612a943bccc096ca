"""One process of one of two jobs joined by ``unimesh.link`` (tests/test_link.py starts both jobs
under their own launchers): ``link_worker.py SCENARIO JOB PORT OUT``.

Scenarios (each names its two jobs):
- ``torch-jax``: ``trainer`` (torchrun 4, DTensors on dp=2 x tp=2) and ``server`` (two
  ``jax.distributed`` processes of two CPU devices each). The trainer sends fused and plain
  weights, float32 and bfloat16; the server receives q/k/v as one qkv (Concat), a renamed
  tensor cast to bfloat16, and the rest on its own layouts; then the bad transfers (each a
  LinkError on every process of both jobs, the link usable after); then new values replayed
  on the first plan; then the server sends back onto uneven torch blocks and into DTensors
  in place.
- ``torch-torch``: ``trainer`` (torchrun 4) into ``server`` (torchrun 2): existing DTensors
  filled in place (uneven), one part of a fused tensor (Slice), a LayoutMap target.
- ``torch-mlx``: ``trainer`` (torchrun 2) and ``server`` (mpirun 2, MLX), both ways.
- ``kill-sender`` / ``kill-receiver``: two JAX jobs of two processes, ``a`` sends, ``b``
  receives; one process of the named side kills itself (SIGKILL) in the second transfer.
- ``missing``: job ``b``'s process 1 starts its runtime but never joins the link.

Each process writes ``OUT/JOB-INDEX.json``: the checks it made and the errors it saw.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

SCENARIO, JOB, PORT, OUT = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
PEER = {"trainer": "server", "server": "trainer", "a": "b", "b": "a"}[JOB]
TIMEOUT = float(os.environ.get("LINK_TIMEOUT", "60"))
record: dict[str, Any] = {"checks": [], "errors": []}


def value(name: str, shape: tuple[int, ...], dtype: str = "float32", scale: float = 1.0) -> Any:
    """The global value of tensor ``name`` (the same on every process of both jobs)."""
    import ml_dtypes

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    v = (rng.standard_normal(shape) * scale).astype(np.float32)
    return v.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else v.astype(dtype)


def same_bits(a: Any, b: Any) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_blocks(name: str, array: Any, expected: np.ndarray, layout: Any) -> int:
    """Every local block of ``array`` is its ``shard_slices`` of ``expected``, bit for bit;
    returns the bytes of this process's distinct blocks (the minimum to receive), and adds
    those of its blocks that repeat one of its others to ``record["copies"]``."""
    import unimesh

    got = unimesh.local_shards(array)
    boxes: set[tuple[tuple[int, int], ...]] = set()
    for device, block in got.items():
        index = layout.shard_slices(expected.shape, device)
        want = expected[index]
        assert same_bits(np.asarray(block), want), (name, device, np.asarray(block), want)
        box = tuple((s.start, s.stop) for s in index)
        if box in boxes:
            record["copies"] = record.get("copies", 0) + want.nbytes
        boxes.add(box)
    record["checks"].append(f"{name}: {len(got)} blocks bit for bit")
    item = expected.dtype.itemsize
    return sum(int(np.prod([b - a for a, b in box])) * item for box in boxes)


def expect_error(what: str, call: Any, *words: str) -> None:
    import unimesh

    try:
        call()
    except unimesh.LinkError as exc:
        text = str(exc)
        missing = [w for w in words if w not in text]
        assert not missing, (what, missing, text)
        record["errors"].append(f"{what}: {text}")
        return
    raise AssertionError(f"{what}: no LinkError")


def start(framework: str) -> tuple[int, int]:
    import unimesh

    return unimesh.initialize(framework)


def torch_jax(ln: Any, rank: int) -> None:
    import unimesh
    from unimesh import Concat, Layout, Mesh, P

    q, k, v = (8, 16), (4, 16), (4, 16)
    if JOB == "trainer":
        import torch

        mesh = Mesh((2, 2), ("dp", "tp"))

        def dist(name: str, shape: tuple[int, ...], spec: Any, dtype: str = "float32",
                 scale: float = 1.0) -> Any:  # fmt: skip
            host = value(name, shape, dtype, scale)
            if dtype == "bfloat16":
                t = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
                return unimesh.distribute(t, Layout(mesh, spec), backend="torch")
            return unimesh.distribute(host, Layout(mesh, spec), backend="torch")

        def tree(scale: float) -> dict[str, Any]:
            return {
                "layers": {
                    "0": {
                        "q": dist("layers.0.q", q, P("dp", "tp"), scale=scale),
                        "k": dist("layers.0.k", k, P(None, "tp"), scale=scale),
                        "v": dist("layers.0.v", v, P("tp"), scale=scale),
                        "w": dist("layers.0.w", (8, 12), P(("tp", "dp")), scale=scale),
                    }
                },
                "emb": dist("emb", (6, 10), P("dp"), "bfloat16", scale=scale),
            }

        stats: dict[str, int] = {}
        ln.send(tree(1.0), version=1, stats=stats)
        record["sent1"] = stats["bytes_sent"]
        record["plans1"] = ln.plans
        # the bad transfers: each refused on every process of both jobs, nothing moved
        expect_error("version", lambda: ln.send(tree(1.0), version=2), "version 2", "version 5")
        expect_error("shape", lambda: ln.send(tree(1.0), version=1), "layers.0.w", "(8, 12)")
        expect_error("dtype", lambda: ln.send(tree(1.0), version=1), "int32", "float32")
        expect_error("nothing", lambda: ln.send(tree(1.0), version=1), "layers.0.o")
        expect_error("devices", lambda: ln.send(tree(1.0), version=1), "head")
        t0 = time.perf_counter()
        stats = {}
        ln.send(tree(2.0), version=3, stats=stats)
        record["replay_seconds"] = time.perf_counter() - t0
        record["sent3"] = stats["bytes_sent"]
        record["plans3"] = ln.plans
        # back from the server: uneven rows on 4 ranks, and in place into DTensors
        target = Layout(Mesh((4,), ("w",)), P("w"))
        stats = {}
        got = ln.receive({"r": target}, version=4, stats=stats)
        record["min"] = check_blocks("r", got["r"], value("r", (6, 12)), target)
        record["received"] = stats["bytes_received"]
        place = Layout(mesh, P("tp", "dp"))
        mine = unimesh.distribute(np.zeros((6, 12), np.float32), place, backend="torch")
        before = mine.to_local().data_ptr()
        got = ln.receive({"r": mine}, version=4)
        assert got["r"] is mine and mine.to_local().data_ptr() == before
        check_blocks("r in place", mine, value("r", (6, 12)), place)
        return
    # the server: two JAX processes of two devices each
    import jax
    import jax.numpy as jnp

    mesh = Mesh((2, 2), ("x", "y"))
    layouts = {
        "qkv": Layout(mesh, P("x", "y")),
        "w16": Layout(mesh, P(None, ("y", "x"))),
        "layers.0.w": Layout(mesh, P("y")),
        "emb": Layout(mesh, P()),
    }
    sources = {"qkv": Concat(["layers.0.q", "layers.0.k", "layers.0.v"], 0), "w16": "layers.0.w"}

    def expected(scale: float) -> dict[str, np.ndarray]:
        w = value("layers.0.w", (8, 12), scale=scale)
        return {
            "qkv": np.concatenate(
                [value(f"layers.0.{n}", s, scale=scale) for n, s in (("q", q), ("k", k), ("v", v))]
            ),
            "w16": np.asarray(jnp.asarray(w).astype(jnp.bfloat16)),  # JAX's own cast
            "layers.0.w": w,
            "emb": value("emb", (6, 10), "bfloat16", scale),
        }

    stats: dict[str, int] = {}
    got = ln.receive(layouts, version=1, stats=stats, sources=sources, dtype={"w16": "bfloat16"})
    least = 0
    record["copies"] = 0
    for name, want in expected(1.0).items():
        assert isinstance(got[name], jax.Array)
        least += check_blocks(name, got[name], want, layouts[name])
    record["min"], record["received"], record["copied"] = (
        least,
        stats["bytes_received"],
        stats["bytes_copied"],
    )
    record["plans1"], record["copies1"] = ln.plans, record["copies"]
    recv = ln.receive
    cast = {"w16": "bfloat16"}
    expect_error("version", lambda: recv(layouts, version=5, sources=sources, dtype=cast),
                 "version 2", "version 5")  # fmt: skip
    wrong = jax.device_put(jnp.zeros((8, 10)), unimesh.to_native(layouts["layers.0.w"], "jax"))
    expect_error("shape", lambda: recv({**layouts, "layers.0.w": wrong}, version=1,
                                       sources=sources, dtype={"w16": "bfloat16"}),
                 "layers.0.w", "(8, 12)", "(8, 10)")  # fmt: skip
    expect_error("dtype", lambda: recv(layouts, version=1, sources=sources,
                                       dtype={"w16": "int32"}), "int32", "float32")  # fmt: skip
    expect_error("nothing", lambda: recv({**layouts, "layers.0.o": layouts["emb"]}, version=1,
                                         sources=sources, dtype={"w16": "bfloat16"}),
                 "layers.0.o")  # fmt: skip
    far = Layout(Mesh((2, 4), ("x", "y")), P("x"))  # 8 devices: this job has 4
    expect_error("devices", lambda: recv({**layouts, "head": far}, version=1, sources=sources,
                                         dtype={"w16": "bfloat16"}), "head")  # fmt: skip
    stats = {}
    got = recv(layouts, version=3, stats=stats, sources=sources, dtype={"w16": "bfloat16"})
    for name, want in expected(2.0).items():
        check_blocks(f"{name} v3", got[name], want, layouts[name])
    record["plans3"], record["received3"] = ln.plans, stats["bytes_received"]
    assert ln.version == 3
    r = unimesh.distribute(value("r", (6, 12)), Layout(mesh, P("x")), backend="jax")
    stats = {}
    ln.send({"r": r}, version=4, stats=stats)
    record["sent4"] = stats["bytes_sent"]
    ln.send({"r": r}, version=4)


def torch_torch(ln: Any, rank: int) -> None:
    import unimesh
    from unimesh import Layout, LayoutMap, Mesh, P, Slice

    if JOB == "trainer":
        mesh = Mesh((2, 2), ("dp", "tp"))
        qkv = unimesh.distribute(value("qkv", (12, 10)), Layout(mesh, P("tp", "dp")),
                                 backend="torch")  # fmt: skip
        o = unimesh.distribute(value("o", (7, 5)), Layout(mesh, P(("dp", "tp"))), backend="torch")
        # a tensor on half of the ranks: ranks 0 and 2 hold none of it
        half = Layout(Mesh((2,), ("h",), device_ids=[1, 3]), P("h"))
        b = unimesh.distribute(value("b", (6, 4)), half, backend="torch")
        stats: dict[str, int] = {}
        ln.send({"attn": {"qkv": qkv, "o": o}, "b": b}, stats=stats)
        record["sent1"] = stats["bytes_sent"]
        ln.send({"attn": {"qkv": qkv, "o": o}})
        # a pending sum is refused by name on both jobs
        pending = Layout(mesh, P(partial={"tp": "sum"}))
        summed = unimesh.from_local({rank: np.ones(3, np.float32)}, pending, (3,), backend="torch")
        expect_error("partial", lambda: ln.send({"s": summed}), "'s'", "pending", "reduce")
        return
    import torch

    mesh = Mesh((2,), ("tp",))
    lay_q, lay_o = Layout(mesh, P("tp")), Layout(mesh, P(None, "tp"))
    q = unimesh.distribute(np.zeros((5, 10), np.float32), lay_q, backend="torch")
    o = unimesh.distribute(np.zeros((7, 5), np.float32), lay_o, backend="torch")
    ptr = q.to_local().data_ptr()
    stats: dict[str, int] = {}
    got = ln.receive({"q": q, "o": o, "b": lay_q}, stats=stats,
                     sources={"q": Slice("attn.qkv", 0, 3, 8), "o": "attn.o"})  # fmt: skip
    assert got["q"] is q and q.to_local().data_ptr() == ptr and got["o"] is o
    least = check_blocks("q in place", q, value("qkv", (12, 10))[3:8], lay_q)
    least += check_blocks("o in place", o, value("o", (7, 5)), lay_o)
    least += check_blocks("b from half the ranks", got["b"], value("b", (6, 4)), lay_q)
    record["min"], record["received"] = least, stats["bytes_received"]
    rules = LayoutMap(mesh, {r".*qkv": P(None, "tp"), r".*\.o": P("tp")})
    got = ln.receive(rules)
    assert isinstance(got["attn.qkv"], torch.distributed.tensor.DTensor)
    check_blocks("qkv by rules", got["attn.qkv"], value("qkv", (12, 10)), rules.get("attn.qkv"))
    check_blocks("o by rules", got["attn.o"], value("o", (7, 5)), rules.get("attn.o"))
    expect_error("partial", lambda: ln.receive({"s": lay_q}), "'s'", "pending", "reduce")


def torch_mlx(ln: Any, rank: int) -> None:
    import unimesh
    from unimesh import Layout, Mesh, P

    if JOB == "trainer":
        mesh = Mesh((2,), ("tp",))
        w = unimesh.distribute(value("w", (6, 8)), Layout(mesh, P(None, "tp")), backend="torch")
        e = unimesh.distribute(value("e", (5, 3)), Layout(mesh, P("tp")), backend="torch")
        ln.send({"w": w, "e": e}, version=1)
        back = Layout(mesh, P("tp"))
        stats: dict[str, int] = {}
        got = ln.receive({"m": back}, stats=stats)
        record["min"] = check_blocks("m", got["m"], value("m", (7, 4)), back)
        record["received"] = stats["bytes_received"]
        return
    from unimesh_mlx import MLXArray

    mesh = Mesh((2,), ("x",))
    lay_w, lay_e = Layout(mesh, P("x")), Layout(mesh, P())
    stats = {}
    got = ln.receive({"w": lay_w, "e": lay_e}, version=1, stats=stats)
    assert isinstance(got["w"], MLXArray)
    least = check_blocks("w", got["w"], value("w", (6, 8)), lay_w)
    least += check_blocks("e", got["e"], value("e", (5, 3)), lay_e)
    record["min"], record["received"] = least, stats["bytes_received"]
    m = unimesh.distribute(value("m", (7, 4)), Layout(mesh, P(None, "x")), backend="mlx")
    ln.send({"m": m})


def faults(ln: Any, rank: int) -> None:
    import unimesh
    from unimesh import Layout, Mesh, P

    mesh = Mesh((2,), ("x",))
    lay = Layout(mesh, P("x"))
    victim = ("a" if SCENARIO.endswith("sender") else "b", 1)
    for turn in range(2):
        if turn == 1 and (JOB, rank) == victim:
            stall = SCENARIO.startswith("stall")
            record["checks"].append("stopping" if stall else "killing myself")
            (OUT / f"{JOB}-{rank}.json").write_text(json.dumps(record))
            os.kill(os.getpid(), signal.SIGSTOP if stall else signal.SIGKILL)
        t0 = time.monotonic()
        try:
            if JOB == "a":
                big = unimesh.distribute(value("big", (256, 1024)), lay, backend="jax")
                ln.send({"big": big})
            else:
                got = ln.receive({"big": Layout(mesh, P(None, "x"))})
                check_blocks("big", got["big"], value("big", (256, 1024)),
                             Layout(mesh, P(None, "x")))  # fmt: skip
        except unimesh.LinkError as exc:
            record["errors"].append(str(exc))
            record["seconds"] = time.monotonic() - t0
            record["ok"] = True
            (OUT / f"{JOB}-{rank}.json").write_text(json.dumps(record))
            # the job lost a process: its runtime's own shutdown would wait for it (JAX's
            # coordination service), so this survivor ends here, its result written
            os._exit(0)


def main() -> None:
    import unimesh

    OUT.mkdir(parents=True, exist_ok=True)
    framework = {
        ("torch-jax", "trainer"): "torch",
        ("torch-jax", "server"): "jax",
        ("torch-torch", "trainer"): "torch",
        ("torch-torch", "server"): "torch",
        ("torch-mlx", "trainer"): "torch",
        ("torch-mlx", "server"): "mlx",
    }.get((SCENARIO, JOB), "jax")
    rank, _ = start(framework)
    if SCENARIO == "missing" and JOB == "b" and rank == 1:
        time.sleep(TIMEOUT + 30)  # started, never joins: killed by the test
        return
    try:
        ln = unimesh.link(f"127.0.0.1:{PORT}", job=JOB, peer=PEER, timeout=TIMEOUT)
    except unimesh.LaunchError as exc:
        record["errors"].append(f"LaunchError: {exc}")
        (OUT / f"{JOB}-{rank}.json").write_text(json.dumps(record))
        os._exit(0)  # a job missing a process: its runtime's shutdown would wait for it
    with ln:
        {"torch-jax": torch_jax, "torch-torch": torch_torch, "torch-mlx": torch_mlx}.get(
            SCENARIO, faults
        )(ln, rank)
    record["ok"] = True
    (OUT / f"{JOB}-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
