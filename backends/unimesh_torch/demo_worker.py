"""One rank of ``unimesh demo``'s torch run (started by the demo under torchrun, gloo).

Prints ``UNIMESH_DEMO {json}``: whether this rank's DTensor shard is the reference block, and
whether the sharded matmul (DTensor @ replicated weight) equals numpy's.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor

    import unimesh
    from unimesh.__main__ import demo_problem

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = unimesh.Mesh.from_string(sys.argv[1])
    layout, x, w = demo_problem(mesh)
    backend = unimesh.get_backend("torch")
    report: dict[str, object] = {"rank": rank}
    try:
        device_mesh = unimesh.to_native(mesh, backend)
        dt = unimesh.distribute(torch.from_numpy(x), layout, backend)
    except unimesh.UnimeshError as exc:  # the same on every rank: nobody waits for anybody
        report["error"] = f"{type(exc).__name__}: {exc}"
    else:
        shards = backend.local_shards(dt)
        ok_shards = all(np.array_equal(block, x[layout.shard_slices(x.shape, d)])
                        for d, block in shards.items())
        wt = distribute_tensor(torch.from_numpy(w), device_mesh, [Replicate()] * mesh.ndim)
        result = (dt @ wt).full_tensor().numpy()
        ok_result = bool(np.allclose(result, x @ w, rtol=1e-5, atol=1e-4))
        report.update(native=type(device_mesh).__name__, shards=ok_shards, result=ok_result)
    sys.stdout.write("UNIMESH_DEMO " + json.dumps(report) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
