"""One SGD step of a 2-layer MLP, data-parallel over "dp" and tensor-parallel over "tp".

Written once against unimesh; the same file runs on every backend that declares shard_map:

    python examples/mlp_step.py --backend jax                         # 8 CPU devices
    torchrun --standalone --nproc-per-node 4 examples/mlp_step.py --backend torch
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/mlp_step.py --backend mlx

The first layer's weight is split by columns over "tp" and the second's by rows (Megatron), so
each device computes a partial output that a psum over "tp" completes; the batch is split over
"dp", and the weight gradients are summed over "dp". Every process checks the loss and the updated
weights against a single-device numpy computation and prints ``RANK r OK ...``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import unimesh
from unimesh import P

BATCH, D_IN, HIDDEN, D_OUT, LR = 16, 8, 32, 4, 0.1


def step(x, t, w1, w2):  # type: ignore[no-untyped-def]
    """Runs on each device's blocks: x, t (batch/dp, ...), w1 (D_IN, HIDDEN/tp), w2 (HIDDEN/tp, ...)."""
    pre = x @ w1                                   # this device's hidden columns
    mask = pre > 0
    h = pre * mask                                 # relu
    y = unimesh.psum(h @ w2, "tp")                 # row-parallel layer: sum the partial outputs
    n = x.shape[0] * unimesh.axis_size("dp")       # the global batch
    diff = y - t
    loss = unimesh.psum((diff * diff).sum(), "dp") / n
    dy = diff * (2.0 / n)
    dw2 = unimesh.psum(h.T @ dy, "dp")
    dh = (dy @ w2.T) * mask
    dw1 = unimesh.psum(x.T @ dh, "dp")
    return loss, w1 - LR * dw1, w2 - LR * dw2


def reference(x, t, w1, w2):  # type: ignore[no-untyped-def]
    """The same step on one device, in float64 numpy."""
    x, t, w1, w2 = (a.astype(np.float64) for a in (x, t, w1, w2))
    pre = x @ w1
    h = np.maximum(pre, 0)
    diff = h @ w2 - t
    loss = (diff * diff).sum() / len(x)
    dy = diff * (2.0 / len(x))
    dw2 = h.T @ dy
    dw1 = x.T @ ((dy @ w2.T) * (pre > 0))
    return loss, w1 - LR * dw1, w2 - LR * dw2


def data() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    t = rng.standard_normal((BATCH, D_OUT)).astype(np.float32)
    w1 = (rng.standard_normal((D_IN, HIDDEN)) / np.sqrt(D_IN)).astype(np.float32)
    w2 = (rng.standard_normal((HIDDEN, D_OUT)) / np.sqrt(HIDDEN)).astype(np.float32)
    return x, t, w1, w2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=os.environ.get("UNIMESH_BACKEND"),
                        help="jax, keras, torch or mlx (default: $UNIMESH_BACKEND)")
    parser.add_argument("--devices", type=int, default=8,
                        help="devices to ask for where one process holds several (JAX)")
    args = parser.parse_args(argv)
    backend = unimesh.get_backend(args.backend)
    n = backend.prepare_devices(args.devices)      # JAX: CPU devices; torch/MLX: the world size
    mesh = unimesh.make_mesh({"dp": 2, "tp": n // 2})
    rank = next((int(os.environ[v]) for v in ("RANK", "OMPI_COMM_WORLD_RANK", "MLX_RANK")
                 if v in os.environ), 0)

    x, t, w1, w2 = data()
    program = unimesh.shard_map(
        step, mesh,
        in_specs=(P("dp", None), P("dp", None), P(None, "tp"), P("tp", None)),
        out_specs=(P(), P(None, "tp"), P("tp", None)),
        backend=backend)
    placed = [unimesh.distribute(a, unimesh.Layout(mesh, spec), backend=backend)
              for a, spec in ((x, P("dp", None)), (t, P("dp", None)),
                              (w1, P(None, "tp")), (w2, P("tp", None)))]
    loss, new_w1, new_w2 = program(*placed)

    want = reference(x, t, w1, w2)
    got = [unimesh.full_array(a, backend=backend) for a in (loss, new_w1, new_w2)]
    errors = [float(np.max(np.abs(np.asarray(g, np.float64) - w))) for g, w in zip(got, want)]
    ok = all(e <= 1e-5 for e in errors)
    print(f"RANK {rank} {'OK' if ok else 'FAIL'} backend={backend.name} mesh={mesh.to_string()} "
          f"loss={float(got[0]):.6f} reference={want[0]:.6f} max_errors={errors}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
