"""Models, not just trees (issue 36, item 5). Run by tests/test_checkpoint_models.py:

    torchrun 4: python model_worker.py torch DIR   unimesh.save(DIR/model, m1) of an FSDP2 x TP
                                                   nn.Module, then unimesh.load(DIR/model, m2)
                                                   into a TP-only module of other values; rank 0
                                                   writes m1's full tensors to DIR/ref-*.bin
    mpirun 4:   python model_worker.py mlx DIR     an mlx.nn.Module of the same names, its Linear
                                                   layers made by MLX's shard_linear, loaded with
                                                   unimesh.load(DIR/model, module)
    python model_worker.py keras DIR               a Keras model under ModelParallel (8 JAX
                                                   devices) fit with CheckpointCallback, loaded
                                                   into a model under another distribution
Each writes DIR/MODE-rank-R.json: errors found and bytes read and held.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from dcp_worker import _model, _reference, write_reference


def _report(out: Path, mode: str, rank: int, report: dict[str, Any]) -> None:
    (out / f"{mode}-rank-{rank}.json").write_text(json.dumps(report, indent=1))
    print(f"{mode} rank {rank}: done", flush=True)


def torch_mode(out: Path) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from unimesh_torch.translate import to_host

    import unimesh

    rank = int(unimesh.initialize("torch")[0])
    report: dict[str, Any] = {"errors": []}
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        m1 = _model()
        parallelize_module(m1.block, mesh["tp"], {"wq": ColwiseParallel(),
                                                  "wo": RowwiseParallel()})  # fmt: skip
        fully_shard(m1.block, mesh=mesh["dp"])
        fully_shard(m1, mesh=mesh["dp"])
        unimesh.save(out / "model", m1)
        full = write_reference(out, dict(m1.state_dict()), rank)
        torch.manual_seed(99)  # other values, another layout: tensor parallel only, over 4
        m2 = _model()
        for p in m2.parameters():
            torch.nn.init.normal_(p)
        tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        parallelize_module(m2.block, tp, {"wq": ColwiseParallel(), "wo": RowwiseParallel()})
        before = {k: type(v).__name__ for k, v in m2.state_dict().items()}
        stats: dict[str, int] = {}
        assert unimesh.load(out / "model", m2, stats=stats) is m2
        # a tree of CPU DTensors is filled in place: load returns the very DTensors given,
        # their local tensors' memory holding the checkpoint's values (host_views)
        given = {k: v for k, v in m2.state_dict().items() if hasattr(v, "to_local")}
        memory = {k: v.to_local().data_ptr() for k, v in given.items()}
        with torch.no_grad():
            for v in given.values():
                v.to_local().zero_()
        got = unimesh.load(out / "model", given)
        same = all(got[k] is v and v.to_local().data_ptr() == memory[k] for k, v in given.items())
        report["in_place"] = sorted(given) if same else "load made new arrays"
        for name, value in m2.state_dict().items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            if to_host(whole).tobytes() != to_host(full[name].detach()).tobytes():
                report["errors"].append(f"{name}: differs after the load")
            if type(value).__name__ != before[name]:
                report["errors"].append(f"{name}: became a {type(value).__name__}")
        # the module still runs: a forward pass on the loaded parameters
        m2.block.wq(torch.ones(2, 8))
        report.update(read=stats["bytes_read"], held=stats["bytes_held"])
    except Exception:  # noqa: BLE001 - the failure is the result
        report["errors"].append(traceback.format_exc(limit=8))
    _report(out, "torch", rank, report)


def mlx_mode(out: Path) -> None:
    import mlx.core as mx
    from mlx import nn
    from mlx.nn.layers.distributed import shard_linear
    from mlx.utils import tree_flatten
    from unimesh_mlx.runtime import mx_to_host

    import unimesh

    rank, size = (int(v) for v in unimesh.initialize("mlx"))
    report: dict[str, Any] = {"errors": []}
    try:
        world = mx.distributed.init()

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.wq = shard_linear(nn.Linear(8, 16), "all-to-sharded", group=world)
                self.wo = shard_linear(nn.Linear(16, 8, bias=False), "sharded-to-all",
                                       group=world)  # fmt: skip
                self.norm = nn.LayerNorm(8)
                self.steps = mx.zeros((6,), dtype=mx.int64)

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(10, 8)
                self.block = Block()

        model = Model()
        stats: dict[str, int] = {}
        assert unimesh.load(out / "model", model, stats=stats) is model
        want = _reference(out)
        q, w = 16 // size, 16 // size
        expect = {
            "emb.weight": want["emb.weight"],
            "block.wq.weight": want["block.wq.weight"][rank * q : (rank + 1) * q],
            "block.wq.bias": want["block.wq.bias"][rank * q : (rank + 1) * q],
            "block.wo.weight": want["block.wo.weight"][:, rank * w : (rank + 1) * w],
            "block.norm.weight": want["block.norm.weight"],
            "block.norm.bias": want["block.norm.bias"],
            "block.steps": want["block.steps"],
        }
        got = dict(tree_flatten(model.parameters()))
        if sorted(got) != sorted(expect):
            report["errors"].append(f"parameters {sorted(got)}")
        for name, value in expect.items():
            mine = mx_to_host(got[name])
            if mine.dtype != value.dtype or mine.tobytes() != value.tobytes():
                report["errors"].append(f"{name}: {mine.dtype} {mine.shape} differs")
        # the sharded layers still compute: y = wo(wq(x)) against numpy in float64
        x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
        y = np.array(model.block.wo(model.block.wq(mx.array(x))))
        h = x.astype(np.float64) @ want["block.wq.weight"].T.astype(np.float64)
        h += want["block.wq.bias"]
        ref = h @ want["block.wo.weight"].T.astype(np.float64)
        report["max_error"] = float(np.abs(y - ref).max())
        report.update(read=stats["bytes_read"], held=stats["bytes_held"])
        # and it saves back: the sharded weights as their global tensors
        unimesh.save(out / "from-mlx", model)
        back = unimesh.open_checkpoint(out / "from-mlx")
        for name in ("block.wq.weight", "block.wo.weight", "emb.weight"):
            if back.read(name).tobytes() != want[name].tobytes():
                report["errors"].append(f"{name}: saved back differently")
    except Exception:  # noqa: BLE001
        report["errors"].append(traceback.format_exc(limit=8))
    _report(out, "mlx", rank, report)


def keras_mode(out: Path) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import unimesh_keras

    import unimesh
    from unimesh import LayoutMap, Mesh, P

    report: dict[str, Any] = {"errors": []}
    try:

        def build() -> Any:
            model = keras.Sequential(
                [keras.Input((16,)), keras.layers.Dense(32, name="up"),
                 keras.layers.Dense(8, name="down")]
            )  # fmt: skip
            model.compile(optimizer="sgd", loss="mse")
            return model

        mesh1 = Mesh.from_string("batch=2,model=4")
        rules1 = LayoutMap(mesh1, {".*/up/kernel": P(None, "model"), ".*/down/kernel": P("model")})
        with unimesh_keras.distribution(mesh1, rules1).scope():
            keras.utils.set_random_seed(1)
            m1 = build()
            x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
            y = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
            callback = unimesh_keras.CheckpointCallback(out / "keras" / "step-{step}", every=2)
            m1.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
        report["saved"] = [Path(p).name for p in callback.saved]
        final = {v.path.split("/", 1)[1]: np.asarray(v.value) for v in m1.variables}
        mesh2 = Mesh.from_string("model=8")
        rules2 = LayoutMap(mesh2, {".*/up/kernel": P("model"), ".*/up/bias": P("model"),
                                   ".*/down/kernel": P(None, "model")})  # fmt: skip
        with unimesh_keras.distribution(mesh2, rules2).scope():
            keras.utils.set_random_seed(2)
            m2 = build()
        layouts = {v.path: unimesh.from_native(v.value.sharding) for v in m2.variables}
        stats: dict[str, int] = {}
        assert unimesh.load(callback.saved[-1], m2, stats=stats) is m2
        for v in m2.variables:
            if np.asarray(v.value).tobytes() != final[v.path.split("/", 1)[1]].tobytes():
                report["errors"].append(f"{v.path}: differs from the trained model's")
            if unimesh.from_native(v.value.sharding) != layouts[v.path]:
                report["errors"].append(f"{v.path}: its layout changed on load")
        report["layouts"] = {k: repr(v.spec) for k, v in layouts.items()}
        report.update(read=stats["bytes_read"], held=stats["bytes_held"])
    except Exception:  # noqa: BLE001
        report["errors"].append(traceback.format_exc(limit=8))
    _report(out, "keras", 0, report)


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    {"torch": torch_mode, "mlx": mlx_mode, "keras": keras_mode}[mode](where)
