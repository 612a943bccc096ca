"""Checkpoints in object storage (issue 37, item 4), against the S3 endpoint the test starts
(moto's server on 127.0.0.1, reached through FSSPEC_S3_ENDPOINT_URL). Run by
tests/test_checkpoint_s3.py:

    torchrun 4: python s3_worker.py save torch URL OUT   the matrix's torch tensors (FSDP over
                                                         TP) saved to URL
    mpirun 4:   python s3_worker.py save mlx URL OUT     the matrix's MLX tensors saved to URL
    python s3_worker.py load jax URL OUT                 URL loaded on 8 JAX devices with another
                                                         mesh; OUT/load-<name>.json
    python s3_worker.py killed mlx URL OUT               a one-process save that dies after its
                                                         data file, before the manifest
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import _support  # noqa: F401 - tests/support on sys.path, before its modules are imported
import numpy as np
from checkpoint_matrix import LOAD, arrays_of, data


def save(framework: str, url: str, out: Path) -> None:
    import unimesh

    rank = int(unimesh.initialize(framework)[0])
    unimesh.save(url, {"model": arrays_of(framework, rank)})
    print(f"{framework} rank {rank}: saved to {url}", flush=True)


def load(url: str, out: Path) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax

    jax.config.update("jax_enable_x64", True)
    import unimesh
    from unimesh import Layout, Mesh

    report: dict[str, Any] = {"errors": []}
    try:
        text, specs = LOAD["jax"]["any"]
        mesh = Mesh.from_string(text)
        layouts = {name: Layout(mesh, spec) for name, spec in specs.items()}
        stats: dict[str, int] = {}
        got = unimesh.load(url, {"model": layouts}, backend="jax", stats=stats)
        want = data()
        for name, array in got["model"].items():
            for device, block in unimesh.local_shards(array, backend="jax").items():
                expect = want[name][layouts[name].shard_slices(want[name].shape, device)]
                if np.asarray(block).tobytes() != expect.tobytes():
                    report["errors"].append(f"{name} on device {device} differs")
        ck = unimesh.open_checkpoint(url)
        ck.read("model.w", (slice(0, 2),))  # two rows of one tensor: only their bytes
        report.update(
            read=stats["bytes_read"],
            held=stats["bytes_held"],
            slice_read=ck.bytes_read,
            fetched=ck.storage.bytes_read if ck.storage.local is None else -1,
            manifest=ck.storage.size("manifest.json") if ck.storage.local is None else -1,
        )
    except Exception:  # noqa: BLE001 - the failure is the result
        report["errors"].append(traceback.format_exc(limit=8))
    name = url.rstrip("/").rsplit("/", 1)[-1]
    (out / f"load-{name}.json").write_text(json.dumps(report, indent=1))
    print(f"jax: loaded {url}", flush=True)


def killed(url: str, out: Path) -> None:
    """A save of other values that dies (os._exit) once its data file is in the store and
    before the manifest: what a kill -9 at that moment leaves."""
    from unimesh.checkpoint import saving

    def die(self: Any, token: str, parts: Any) -> None:
        print("data written; dying before the manifest", flush=True)
        os._exit(9)

    saving.SaveJob._commit = die  # type: ignore[method-assign]
    saving.save(url, {"model": {name: value + 1 for name, value in data().items()
                               if value.dtype.kind == "f"}})  # fmt: skip


if __name__ == "__main__":
    mode, framework, url, where = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    if mode == "save":
        save(framework, url, where)
    elif mode == "load":
        load(url, where)
    else:
        killed(url, where)
