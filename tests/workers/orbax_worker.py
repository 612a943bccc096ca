"""Orbax checkpoints in (issue 36, item 4). Run by tests/test_checkpoint_orbax.py:

    python orbax_worker.py save DIR             Orbax's own StandardCheckpointer saves a tree of
                                                jax.Arrays on 8 devices (4 x 2) to DIR/orbax
    python orbax_worker.py load FRAMEWORK DIR   (torch: torchrun 4; mlx: mpirun 4; jax: one
                                                process, 8 devices) loads DIR/orbax onto another
                                                mesh; writes DIR/load-FRAMEWORK-rank-R.json

Every block each process holds is compared byte for byte with the saved value; the bytes each
process read are compared with the bytes of the saved chunks its blocks touch (Orbax writes
one compressed chunk per saved shard: the unit TensorStore reads).
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

SAVED = "x=4,y=2"


def data() -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(37)
    return {
        "params.w": rng.standard_normal((8, 12)).astype(np.float32),
        "params.bf": rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16),
        "params.n": rng.integers(-(2**30), 2**30, size=(8, 2), dtype=np.int32),
        "params.r": rng.standard_normal((3, 5)).astype(np.float32),
        "opt.m": rng.standard_normal((16,)).astype(np.float32),
    }


def P(*e: Any) -> Any:
    from unimesh import P as _P

    return _P(*e)


SAVE_SPECS = {"params.w": ("x", "y"), "params.bf": (None, ("y", "x")), "params.n": ("x",),
              "params.r": (), "opt.m": (("x", "y"),)}  # fmt: skip
TARGETS = {
    "torch": ("a=2,b=2", {"params.w": (("b", "a"),), "params.bf": ("a", "b"),
                          "params.n": (None, "b"), "params.r": ("a",), "opt.m": ("b",)}),
    "mlx": ("a=4", {"params.w": (None, "a"), "params.bf": ("a",), "params.n": ("a",),
                    "params.r": (None, "a"), "opt.m": ()}),
    "jax": ("all=8", {"params.w": ("all",), "params.bf": (None, "all"), "params.n": ("all",),
                      "params.r": (), "opt.m": ("all",)}),
}  # fmt: skip


def save(out: Path) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import orbax.checkpoint as ocp

    import unimesh
    from unimesh import Layout, Mesh

    mesh = Mesh.from_string(SAVED)
    tree: dict[str, dict[str, Any]] = {}
    for name, value in data().items():
        group, leaf = name.split(".")
        sharding = unimesh.to_native(Layout(mesh, P(*SAVE_SPECS[name])), "jax")
        tree.setdefault(group, {})[leaf] = jax.device_put(value, sharding)
    tree["step"] = 7  # type: ignore[assignment]  # a scalar, as training loops save
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "orbax", tree)
    checkpointer.wait_until_finished()
    print("orbax: saved", flush=True)


def _chunk_bytes(name: str, value: np.ndarray, block: tuple[slice, ...]) -> int:
    """Bytes of the saved shards (Orbax's chunks) that ``block`` touches, by the saver's
    layout as the core computes it."""
    from unimesh import Layout, Mesh

    saved = Layout(Mesh.from_string(SAVED), P(*SAVE_SPECS[name]))
    seen = set()
    total = 0
    for sl in saved.device_slices(value.shape).values():
        key = tuple((s.start, s.stop) for s in sl)
        if key in seen or not all(
            max(a.start, b.start) < min(a.stop, b.stop) for a, b in zip(sl, block)
        ):
            continue
        seen.add(key)
        total += math.prod(s.stop - s.start for s in sl) * value.itemsize
    return total


def load(framework: str, out: Path) -> None:
    if framework == "jax":
        sys.modules["torch"] = None  # type: ignore[assignment]
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax

        jax.config.update("jax_enable_x64", True)
    import unimesh
    from unimesh import Layout, Mesh

    rank = 0 if framework == "jax" else int(unimesh.initialize(framework)[0])
    want = data()
    text, specs = TARGETS[framework]
    mesh = Mesh.from_string(text)
    layouts = {name: Layout(mesh, P(*spec)) for name, spec in specs.items()}
    report: dict[str, Any] = {}
    try:
        ck = unimesh.open_checkpoint(out / "orbax")
        stats: dict[str, int] = {}
        target: dict[str, Any] = {}
        for name, layout in layouts.items():
            group, leaf = name.split(".")
            target.setdefault(group, {})[leaf] = layout
        got = unimesh.load(out / "orbax", target, backend=framework, stats=stats)
        errors = []
        bound = 0
        for name, layout in layouts.items():
            group, leaf = name.split(".")
            value = want[name]
            blocks = unimesh.local_shards(got[group][leaf], backend=framework)
            seen = set()
            for device, block in blocks.items():
                sl = layout.shard_slices(value.shape, device)
                expect = value[sl]
                block = np.asarray(block)
                if block.dtype != expect.dtype or block.tobytes() != expect.tobytes():
                    errors.append(f"{name} on device {device}: {block.dtype} differs")
                key = tuple((s.start, s.stop) for s in sl)
                if key not in seen:
                    seen.add(key)
                    bound += _chunk_bytes(name, value, sl)
        step = ck.read("step")
        if int(step) != 7:
            errors.append(f"step read as {step}")
        report = {
            "kind": ck.kind,
            "errors": errors,
            "read": stats["bytes_read"],
            "held": stats["bytes_held"],
            "chunks": bound,
            "total": sum(v.nbytes for v in want.values()),
            "torch_imported": sys.modules.get("torch") is not None,
        }
    except Exception:  # noqa: BLE001 - the failure is the result
        report = {"errors": [traceback.format_exc(limit=8)]}
    (out / f"load-{framework}-rank-{rank}.json").write_text(json.dumps(report, indent=1))
    print(f"{framework} rank {rank}: loaded", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]))
    else:
        load(sys.argv[2], Path(sys.argv[3]))
