"""One process of ``unimesh demo``'s MLX run (started by the demo under mlx.launch, ring).

Prints ``UNIMESH_DEMO {json}``: whether this rank's shard is the reference block, and whether
the sharded matmul (local block @ weight block, summed over the column axis's group) equals
numpy's rows.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    import mlx.core as mx

    import unimesh
    from unimesh.__main__ import demo_problem

    mesh = unimesh.Mesh.from_string(sys.argv[1])
    layout, x, w = demo_problem(mesh)
    backend = unimesh.get_backend("mlx")
    native = unimesh.to_native(mesh, backend)
    rank = native.rank
    report: dict[str, object] = {"rank": rank, "native": type(native).__name__}
    shard = unimesh.distribute(x, layout, backend)
    rows, cols = layout.shard_slices(x.shape, rank)
    report["shards"] = bool(np.array_equal(np.array(shard.local), x[rows, cols]))
    partial = shard.local @ mx.array(w[cols])
    if mesh.ndim > 1:
        partial = native.axis_group(mesh.axis_names[1]).all_sum(partial)
    report["result"] = bool(np.allclose(np.array(partial), (x @ w)[rows], rtol=1e-5, atol=1e-4))
    sys.stdout.write("UNIMESH_DEMO " + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
