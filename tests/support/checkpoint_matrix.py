"""The any-to-any checkpoint matrix (issue 35): one set of tensors saved from torch (torchrun 4,
FSDP over TP: ``_StridedShard`` and ``Shard(1)``), JAX (8 devices, 4 x 2), MLX (mpirun 4) and
Keras on JAX (a LayoutMap), each loaded on every framework with another mesh shape and other
specs. Run by tests/test_checkpoint_matrix.py:

    python checkpoint_matrix.py FRAMEWORK save DIR      (under its launcher)
    python checkpoint_matrix.py FRAMEWORK load DIR      loads DIR/<every saver>; writes
                                                        DIR/load-FRAMEWORK-rank-R.json

Every block each process holds after the load is compared byte for byte with the same slice
of the data; the bytes each process read are compared with the bytes of its blocks.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

SAVERS = ("torch", "jax", "mlx", "keras")


def data() -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(35)
    return {
        "w": rng.standard_normal((8, 12)).astype(np.float32),
        "bf": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
        "h": rng.standard_normal((4, 8)).astype(np.float16),
        "n": rng.integers(-(2**40), 2**40, size=(6, 4), dtype=np.int64),
        "m": rng.random(8) > 0.5,
        "u": rng.standard_normal((7, 6)).astype(np.float32),  # uneven where split
        "r": rng.standard_normal((3, 5)).astype(np.float32),  # replicated
    }


def P(*e: Any) -> Any:
    from unimesh import P as _P

    return _P(*e)


SAVE: dict[str, tuple[str, dict[str, Any]]] = {
    # FSDP over TP: ("tp", "dp") on dim 0 is torch's _StridedShard, "tp" on dim 1 Shard(1)
    "torch": ("dp=2,tp=2", {"w": P(("tp", "dp"), None), "bf": P(None, "tp"), "h": P("dp", "tp"),
                            "n": P("tp"), "m": P("dp"), "u": P("tp"), "r": P()}),
    "jax": ("x=4,y=2", {"w": P("x", "y"), "bf": P(("y", "x")), "h": P(None, ("x", "y")),
                        "n": P(None, "x"), "m": P(("x", "y")), "u": P(), "r": P()}),
    "mlx": ("a=4", {"w": P(None, "a"), "bf": P("a"), "h": P("a"), "n": P(), "m": P("a"),
                    "u": P("a"), "r": P()}),
    "keras": ("batch=2,model=4", {"w": P(None, "model"), "bf": P("batch"), "h": P("batch", "model"),
                                  "n": P(None, "model"), "m": P("model"), "u": P(), "r": P()}),
}  # fmt: skip

LOAD: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    # per loader: a mesh for 2-D savers and one for the others (never the saver's shape)
    "torch": {
        "2d": ("z=4", {"w": P("z"), "bf": P(None, "z"), "h": P(None, "z"), "n": P(("z",)),
                       "m": P(), "u": P("z"), "r": P("z")}),
        "other": ("p=2,q=2", {"w": P(("q", "p")), "bf": P("q", "p"), "h": P(None, "p"),
                              "n": P("p", "q"), "m": P("q"), "u": P(None, "q"), "r": P("p")}),
    },
    "mlx": {
        "2d": ("z=4", {"w": P(None, "z"), "bf": P("z"), "h": P(None, "z"), "n": P("z"),
                       "m": P("z"), "u": P("z"), "r": P(None, "z")}),
        "other": ("p=2,q=2", {"w": P(("p", "q")), "bf": P("q", "p"), "h": P(None, "q"),
                              "n": P("q", "p"), "m": P("p"), "u": P(None, "p"), "r": P("q")}),
    },
    "jax": {
        "any": ("all=8", {"w": P("all"), "bf": P("all"), "h": P(None, "all"), "n": P(),
                          "m": P("all"), "u": P(), "r": P()}),
    },
    "keras": {  # a LayoutMap target: every tensor by its name
        "any": ("batch=8", {"model.w": P("batch"), "model.bf": P("batch"),
                            "model.h": P(None, "batch"), "model.m": P("batch")}),
    },
}  # fmt: skip


def _start(framework: str) -> int:
    if framework in ("jax", "keras"):
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        os.environ["KERAS_BACKEND"] = "jax"
        import jax

        jax.config.update("jax_enable_x64", True)  # int64 stays int64
        return 0
    import unimesh

    return int(unimesh.initialize(framework)[0])


def arrays_of(framework: str, rank: int) -> dict[str, Any]:
    """data(), laid out as SAVE says, as ``framework``'s distributed arrays (this process's
    part of them): torch DTensors, MLXArrays, jax.Arrays or Keras variables."""
    import unimesh
    from unimesh import Layout, Mesh

    text, specs = SAVE[framework]
    mesh = Mesh.from_string(text)
    arrays: dict[str, Any] = {}
    for name, value in data().items():
        layout = Layout(mesh, specs[name])
        if framework == "torch":
            import torch
            from unimesh_torch.translate import from_host

            full = from_host(value) if value.dtype.name == "bfloat16" else torch.as_tensor(value)
            arrays[name] = unimesh.distribute(full, layout, backend="torch")
        elif framework == "mlx":
            from unimesh_mlx.runtime import host_to_mx

            arrays[name] = unimesh.from_local(
                {rank: value[layout.shard_slices(value.shape, rank)]}, layout, value.shape,
                backend="mlx",
            )  # fmt: skip
            assert host_to_mx(value).dtype is not None
        elif framework == "jax":
            import jax

            arrays[name] = jax.device_put(value, unimesh.to_native(layout, "jax"))
        else:  # Keras variables made under a distribution from a LayoutMap
            import keras
            from unimesh_keras import distribution

            lm = unimesh.LayoutMap(mesh, {k: s for k, s in specs.items()})
            with distribution(mesh, lm).scope():
                arrays[name] = keras.Variable(value, name=name, trainable=False)
            assert unimesh.from_native(arrays[name].value.sharding) == layout, name
    return arrays


def save(framework: str, out: Path) -> None:
    import unimesh

    rank = _start(framework)
    arrays = arrays_of(framework, rank)
    if framework in ("torch", "mlx"):  # the writing in a background thread, peers agreeing
        handle = unimesh.async_save(out / framework, {"model": arrays})
        handle.wait()
        assert handle.done()
    else:
        unimesh.save(out / framework, {"model": arrays})
    print(f"{framework} rank {rank}: saved", flush=True)


def load(framework: str, out: Path) -> None:
    import unimesh
    from unimesh import Layout, Mesh

    rank = _start(framework)
    want = data()
    report: dict[str, Any] = {}
    for saver in SAVERS:
        try:
            saved_mesh = Mesh.from_string(SAVE[saver][0])
            plans = LOAD[framework]
            key = "any" if "any" in plans else ("2d" if saved_mesh.ndim == 2 else "other")
            text, specs = plans[key]
            mesh = Mesh.from_string(text)
            stats: dict[str, int] = {}
            if framework == "keras":
                lm = unimesh.LayoutMap(mesh, specs)
                got = unimesh.load(out / saver, lm, backend="keras", stats=stats)
                layouts = {k: lm.get(k) or Layout(mesh, P()) for k in got}
                arrays = got
            else:
                layouts = {f"model.{k}": Layout(mesh, s) for k, s in specs.items()}
                target = {"model": {k: layouts[f"model.{k}"] for k in specs}}
                got = unimesh.load(out / saver, target, backend=framework, stats=stats)
                arrays = {f"model.{k}": v for k, v in got["model"].items()}
            errors = []
            for name, array in arrays.items():
                value = want[name.split(".", 1)[1]]
                layout = layouts[name]
                for device, block in unimesh.local_shards(array, backend=framework).items():
                    expect = value[layout.shard_slices(value.shape, device)]
                    block = np.asarray(block)
                    if block.dtype != expect.dtype or block.tobytes() != expect.tobytes():
                        errors.append(f"{name} on device {device}: {block.dtype} differs")
            report[saver] = {
                "errors": errors,
                "read": stats["bytes_read"],
                "held": stats["bytes_held"],
                "tensors": len(arrays),
            }
        except Exception:  # noqa: BLE001 - a failure is this pair's result
            report[saver] = {"errors": [traceback.format_exc(limit=8)]}
    (out / f"load-{framework}-rank-{rank}.json").write_text(json.dumps(report, indent=1))
    print(f"{framework} rank {rank}: loaded", flush=True)


if __name__ == "__main__":
    framework, mode, where = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    (save if mode == "save" else load)(framework, where)
