"""torch DCP checkpoints in and out (issue 36). Run by tests/test_checkpoint_dcp.py:

    torchrun 4: python dcp_worker.py save DIR   torch's own dcp.save of an FSDP2 x TP model
                                                (fully_shard over parallelize_module) to DIR/dcp,
                                                and with HuggingFaceStorageWriter to DIR/hf;
                                                rank 0 writes every tensor's full_tensor() to
                                                DIR/ref-*.bin as the reference
    python dcp_worker.py load FRAMEWORK DIR     (jax: one process, 8 devices, torch unimportable;
                                                torch: torchrun 4; mlx: mpirun 4) loads DIR/dcp
                                                and DIR/hf onto another mesh and layout; writes
                                                DIR/load-FRAMEWORK-rank-R.json
    torchrun 4: python dcp_worker.py dcp-load DIR   torch's dcp.load through
                                                unimesh_torch.CheckpointReader of DIR/unimesh
                                                (saved from JAX by `jax-save`) into DTensors
    python dcp_worker.py jax-save DIR           a unimesh save from JAX, 8 devices

Every block each process holds is compared byte for byte with torch's own full tensor.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np


def _reference(out: Path) -> dict[str, np.ndarray]:
    """The full tensors rank 0 wrote: raw bytes, with dtype and shape beside them."""
    meta = json.loads((out / "ref.json").read_text())
    found = {}
    for name, (dtype, shape) in meta.items():
        if dtype == "bfloat16":
            import ml_dtypes

            np_dtype: Any = np.dtype(ml_dtypes.bfloat16)
        else:
            np_dtype = np.dtype(dtype)
        raw = (out / f"ref-{name}.bin").read_bytes()
        found[name] = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
    return found


def write_reference(out: Path, state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Every tensor's ``full_tensor()`` (torch's own gather, on every rank); rank 0 writes
    them to OUT/ref-NAME.bin with their dtypes and shapes in OUT/ref.json."""
    import torch

    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if rank == 0:
        meta = {}
        for name, t in full.items():
            t = t.detach().contiguous()
            meta[name] = (str(t.dtype).rsplit(".", 1)[-1], list(t.shape))
            (out / f"ref-{name}.bin").write_bytes(t.view(torch.uint8).numpy().tobytes())
        (out / "ref.json").write_text(json.dumps(meta))
    return full


def _model() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(8, 16, bias=True)
            self.wo = nn.Linear(16, 8, bias=False)
            self.norm = nn.LayerNorm(8)  # replicated over tp, sharded by FSDP
            self.register_buffer("steps", torch.arange(6, dtype=torch.int64))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.block = Block()

    torch.manual_seed(36)
    return Model()


def save(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.placement_types import Shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    parallelize_module(model.block, mesh["tp"], {"wq": ColwiseParallel(), "wo": RowwiseParallel()})
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    state: dict[str, Any] = dict(model.state_dict())
    # beside the model: a bfloat16 tensor split on both axes, an uneven one, an int64 one
    g = torch.Generator().manual_seed(7)
    state["extra.bf"] = distribute_tensor(
        torch.randn(6, 4, generator=g).to(torch.bfloat16), mesh, [Shard(1), Shard(0)]
    )
    state["extra.odd"] = distribute_tensor(torch.randn(7, 3, generator=g), mesh, [Shard(0)] * 2)
    placements = {k: tuple(v.placements) for k, v in state.items() if hasattr(v, "placements")}
    dcp.save({**state, "step": 3}, checkpoint_id=str(out / "dcp"))
    dcp.save(
        state,
        storage_writer=HuggingFaceStorageWriter(path=str(out / "hf"), save_distributed=True),
    )
    write_reference(out, state, rank)
    if rank == 0:
        (out / "placements.json").write_text(json.dumps({k: repr(v) for k, v in
                                                         placements.items()}))  # fmt: skip
    print(f"rank {rank}: saved", flush=True)
    from unimesh_torch.runtime import finish_process_group

    finish_process_group()  # two barriers, then destroy: no teardown abort


# the load targets: another mesh, other specs (never the saver's dp=2 x tp=2 FSDP-over-TP)
TARGETS = {
    "jax": ("x=2,y=4", {"emb.weight": (None, "y"), "block.wq.weight": (("x", "y"),),
                        "block.wq.bias": ("y",), "block.wo.weight": (None, "y"),
                        "block.norm.weight": ("x",), "block.norm.bias": (),
                        "block.steps": ("x",), "extra.bf": ("x", "y"), "extra.odd": ()}),
    "torch": ("a=4", {"emb.weight": (None, "a"), "block.wq.weight": ("a",),
                      "block.wq.bias": (), "block.wo.weight": ("a",),
                      "block.norm.weight": ("a",), "block.norm.bias": ("a",),
                      "block.steps": (), "extra.bf": (None, "a"), "extra.odd": ("a",)}),
    "mlx": ("a=2,b=2", {"emb.weight": ("b", "a"), "block.wq.weight": (("b", "a"),),
                        "block.wq.bias": ("a",), "block.wo.weight": ("a", "b"),
                        "block.norm.weight": (), "block.norm.bias": ("b",),
                        "block.steps": ("a",), "extra.bf": ("a",), "extra.odd": (("a", "b"),)}),
}  # fmt: skip


def load(framework: str, out: Path) -> None:
    if framework == "jax":
        sys.modules["torch"] = None  # type: ignore[assignment]  # reading needs no torch
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax

        jax.config.update("jax_enable_x64", True)
        rank = 0
    import unimesh
    from unimesh import Layout, Mesh, P

    if framework != "jax":
        rank = int(unimesh.initialize(framework)[0])
    want = _reference(out)
    text, specs = TARGETS[framework]
    mesh = Mesh.from_string(text)
    layouts = {name: Layout(mesh, P(*spec)) for name, spec in specs.items()}
    report: dict[str, Any] = {}
    for kind in ("dcp", "hf"):
        try:
            ck = unimesh.open_checkpoint(out / kind)
            stats: dict[str, int] = {}
            got = unimesh.load(out / kind, layouts, backend=framework, stats=stats)
            errors = []
            for name, array in got.items():
                value = want[name]
                if ck.tensor(name).shape != value.shape:
                    errors.append(f"{name}: shape {ck.tensor(name).shape}, torch's {value.shape}")
                blocks = unimesh.local_shards(array, backend=framework)
                for device, block in blocks.items():
                    expect = value[layouts[name].shard_slices(value.shape, device)]
                    block = np.asarray(block)
                    if block.dtype != expect.dtype or block.tobytes() != expect.tobytes():
                        errors.append(f"{name} on device {device}: {block.dtype} differs")
            report[kind] = {
                "kind": ck.kind,
                "objects": ck.objects,
                "errors": errors,
                "tensors": len(got),
                "read": stats["bytes_read"],
                "held": stats["bytes_held"],
                "torch_imported": sys.modules.get("torch") is not None,
            }
        except Exception:  # noqa: BLE001 - a failure is this pair's result
            report[kind] = {"errors": [traceback.format_exc(limit=8)]}
    (out / f"load-{framework}-rank-{rank}.json").write_text(json.dumps(report, indent=1))
    print(f"{framework} rank {rank}: loaded", flush=True)


def data() -> dict[str, np.ndarray]:
    """What jax-save writes (and dcp-load expects): float32, bfloat16, int64, uneven."""
    import ml_dtypes

    rng = np.random.default_rng(36)
    return {
        "w": rng.standard_normal((8, 12)).astype(np.float32),
        "bf": rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16),
        "n": rng.integers(-(2**40), 2**40, size=(8,), dtype=np.int64),
        "u": rng.standard_normal((8, 6)).astype(np.float32),
    }


def jax_save(out: Path) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax

    jax.config.update("jax_enable_x64", True)
    import unimesh
    from unimesh import Layout, Mesh, P

    mesh = Mesh.from_string("x=4,y=2")
    specs = {"w": P("x", "y"), "bf": P(None, ("y", "x")), "n": P("y"), "u": P(None, "y")}
    tree = {
        name: jax.device_put(value, unimesh.to_native(Layout(mesh, specs[name]), "jax"))
        for name, value in data().items()
    }
    unimesh.save(out / "unimesh", {"model": tree})
    print("jax: saved", flush=True)


def dcp_load(out: Path) -> None:
    """torch's own dcp.load of a unimesh checkpoint through CheckpointReader, into DTensors on
    another mesh (dp=2 x tp=2) and placements, _StridedShard (FSDP over TP) among them."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import unimesh_torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from unimesh_torch.translate import to_host

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    want = data()
    placements = {
        "w": [_StridedShard(0, split_factor=2), Shard(0)],
        "bf": [Shard(1), Shard(0)],
        "n": [Replicate(), Shard(0)],
        "u": [Shard(0), Replicate()],
    }
    state = {
        "model": {
            name: distribute_tensor(
                torch.zeros(value.shape, dtype=getattr(torch, value.dtype.name)),
                mesh,
                placements[name],
            )
            for name, value in want.items()
        }
    }
    reader = unimesh_torch.CheckpointReader(out / "unimesh")
    errors = []
    try:
        dcp.load(state, storage_reader=reader)
        held = 0
        for name, value in want.items():
            dt = state["model"][name]
            held += dt.to_local().numel() * dt.to_local().element_size()
            whole = to_host(dt.full_tensor())
            if whole.dtype != value.dtype or whole.tobytes() != value.tobytes():
                errors.append(f"{name}: {whole.dtype} differs from what JAX saved")
    except Exception:  # noqa: BLE001 - the failure is the result
        errors.append(traceback.format_exc(limit=8))
        held = 0
    report = {"errors": errors, "read": reader.bytes_read, "held": held}
    (out / f"dcp-load-rank-{rank}.json").write_text(json.dumps(report))
    print(f"rank {rank}: dcp.load done", flush=True)
    from unimesh_torch.runtime import finish_process_group

    finish_process_group()  # two barriers, then destroy: no teardown abort


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "save":
        save(Path(sys.argv[2]))
    elif mode == "load":
        load(sys.argv[2], Path(sys.argv[3]))
    elif mode == "jax-save":
        jax_save(Path(sys.argv[2]))
    elif mode == "dcp-load":
        dcp_load(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")
