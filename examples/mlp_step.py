"""One SGD step of a 2-layer MLP, data-parallel over "dp" and tensor-parallel over "tp".

Written once against unimesh; the same file runs on every backend that declares shard_map:

    python examples/mlp_step.py --backend jax                         # 8 CPU devices
    torchrun --standalone --nproc-per-node 4 examples/mlp_step.py --backend torch
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/mlp_step.py --backend mlx

The first layer's weight is split by columns over "tp" and the second's by rows (Megatron), so
each device computes a partial output that a psum over "tp" completes; the batch is split over
"dp". Only the loss is written: ``unimesh.value_and_grad`` differentiates it with the backend's
own autodiff (the weight gradients come back sharded like the weights, summed over "dp"), and a
second small program applies the SGD update. Every process checks the loss and the updated
weights against a single-device numpy computation (float64, hand-derived gradients) and prints
``RANK r OK ...``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from _example import COMPILE, add_compile_flag, value_and_grad

import unimesh
from unimesh import P

BATCH, D_IN, HIDDEN, D_OUT, LR = 16, 8, 32, 4, 0.1


SPECS = {"w1": P(None, "tp"), "w2": P("tp", None)}


def loss(x, t, params):  # type: ignore[no-untyped-def]
    """Runs on each device's blocks: x, t (batch/dp, ...), w1 (D_IN, HIDDEN/tp),
    w2 (HIDDEN/tp, ...)."""
    pre = x @ params["w1"]  # this device's hidden columns
    h = pre * (pre > 0)  # relu
    y = unimesh.psum(h @ params["w2"], "tp")  # row-parallel layer: sum the partial outputs
    diff = y - t
    return unimesh.pmean((diff * diff).sum() / x.shape[0], "dp")  # the mean over the global batch


def sgd(params, grads):  # type: ignore[no-untyped-def]
    return {k: params[k] - LR * grads[k] for k in params}


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
    parser.add_argument(
        "--backend",
        default=os.environ.get("UNIMESH_BACKEND"),
        help="jax, keras, torch or mlx (default: $UNIMESH_BACKEND)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=8,
        help="devices to ask for where one process holds several (JAX)",
    )
    add_compile_flag(parser)
    args = parser.parse_args(argv)
    COMPILE[:] = [] if args.compile is None else [args.compile]
    try:
        backend = unimesh.get_backend(args.backend)
    except unimesh.UnimeshError as exc:  # no --backend, or one not installed: say how to run
        parser.error(f"{exc} (give --backend jax, keras, torch or mlx)")
    n = backend.prepare_devices(args.devices)  # JAX: CPU devices; torch/MLX: the world size
    dp = 2 if n % 2 == 0 else 1  # one GPU: dp=1, tp=1
    mesh = unimesh.make_mesh({"dp": dp, "tp": n // dp})
    if backend.name == "jax":  # the 1e-5 check needs full float32 products, not TF32 (GPUs)
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
    rank = next(
        (
            int(os.environ[v])
            for v in ("RANK", "OMPI_COMM_WORLD_RANK", "MLX_RANK")
            if v in os.environ
        ),
        0,
    )

    x, t, w1, w2 = data()
    loss_program = unimesh.shard_map(
        loss, mesh, in_specs=(P("dp", None), P("dp", None), SPECS), out_specs=P(), backend=backend
    )
    update = unimesh.shard_map(sgd, mesh, in_specs=(SPECS, SPECS), out_specs=SPECS, backend=backend)

    def place(array, spec):  # type: ignore[no-untyped-def]
        return unimesh.distribute(array, unimesh.Layout(mesh, spec), backend=backend)

    xs, ts = place(x, P("dp", None)), place(t, P("dp", None))
    params = {"w1": place(w1, SPECS["w1"]), "w2": place(w2, SPECS["w2"])}
    value, grads = value_and_grad(lambda p: loss_program(xs, ts, p), backend)(params)
    params = update(params, grads)
    loss_value, new_w1, new_w2 = value, params["w1"], params["w2"]

    want = reference(x, t, w1, w2)
    got = [unimesh.full_array(a, backend=backend) for a in (loss_value, new_w1, new_w2)]
    errors = [float(np.max(np.abs(np.asarray(g, np.float64) - w))) for g, w in zip(got, want)]
    ok = all(e <= 1e-5 for e in errors)
    print(
        f"RANK {rank} {'OK' if ok else 'FAIL'} backend={backend.name} mesh={mesh.to_string()} "
        f"loss={float(got[0]):.6f} reference={want[0]:.6f} largest differences: "
        f"loss {errors[0]:.1e}, w1 {errors[1]:.1e}, w2 {errors[2]:.1e}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
