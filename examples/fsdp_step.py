"""An FSDP (ZeRO-3) training step: parameters sharded over "fsdp", gathered for the forward,
gradients reduce-scattered by autodiff, the SGD update applied to the shards.

Written once against unimesh; the same file runs on JAX, torch and MLX:

    python examples/fsdp_step.py --backend jax                                   # 8 CPU devices
    torchrun --standalone --nproc-per-node 4 examples/fsdp_step.py --backend torch
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/fsdp_step.py --backend mlx

Every device holds 1/n of each weight and 1/n of the batch. ``all_gather`` brings a whole weight
for the forward; its transpose, which autodiff applies, is a reduce-scatter, so each device
receives the summed gradient of its own shard only. Every process checks the loss, both
gradients and the updated weights against float64 numpy and prints ``RANK r OK ...``.
"""

from __future__ import annotations

import sys

import numpy as np
from _example import place, report, start, value_and_grad, xp

import unimesh
from unimesh import P

BATCH, D_IN, HIDDEN, D_OUT, LR = 32, 16, 32, 8, 0.1
SPECS = {"w1": P("fsdp", None), "w2": P("fsdp", None)}


def loss(x, t, params):  # type: ignore[no-untyped-def]
    """Each device's blocks: x, t (BATCH/n, ...); w1 (D_IN/n, HIDDEN), w2 (HIDDEN/n, D_OUT)."""
    w1 = unimesh.all_gather(params["w1"], "fsdp")  # the whole weight, for this layer only
    h = xp(x).tanh(x @ w1)
    w2 = unimesh.all_gather(params["w2"], "fsdp")
    diff = h @ w2 - t
    return unimesh.pmean((diff * diff).sum() / x.shape[0], "fsdp")  # mean over the batch


def sgd(params, grads):  # type: ignore[no-untyped-def]
    return {k: params[k] - LR * grads[k] for k in params}


def reference(x, t, w1, w2):  # type: ignore[no-untyped-def]
    """Loss, gradients and updated weights on one device, float64, derived by hand."""
    x, t, w1, w2 = (a.astype(np.float64) for a in (x, t, w1, w2))
    h = np.tanh(x @ w1)
    diff = h @ w2 - t
    value = (diff * diff).sum() / len(x)
    dy = 2.0 * diff / len(x)
    g2 = h.T @ dy
    g1 = x.T @ ((dy @ w2.T) * (1 - h * h))
    return value, {"w1": g1, "w2": g2, "new_w1": w1 - LR * g1, "new_w2": w2 - LR * g2}


def main() -> int:
    backend, n, rank = start(__doc__.splitlines()[0])
    mesh = unimesh.make_mesh({"fsdp": n})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    t = rng.standard_normal((BATCH, D_OUT)).astype(np.float32)
    w1 = (rng.standard_normal((D_IN, HIDDEN)) / np.sqrt(D_IN)).astype(np.float32)
    w2 = (rng.standard_normal((HIDDEN, D_OUT)) / np.sqrt(HIDDEN)).astype(np.float32)

    loss_program = unimesh.shard_map(
        loss, mesh, in_specs=(P("fsdp"), P("fsdp"), SPECS), out_specs=P(), backend=backend
    )
    update = unimesh.shard_map(sgd, mesh, in_specs=(SPECS, SPECS), out_specs=SPECS, backend=backend)
    xs, ts = place(x, P("fsdp"), mesh, backend), place(t, P("fsdp"), mesh, backend)
    params = place({"w1": w1, "w2": w2}, SPECS, mesh, backend)
    value, grads = value_and_grad(lambda p: loss_program(xs, ts, p), backend)(params)
    new = update(params, grads)

    want_value, want = reference(x, t, w1, w2)
    got = {**grads, "new_w1": new["w1"], "new_w2": new["w2"]}
    return report(rank, backend, mesh, value, got, want_value, want)


if __name__ == "__main__":
    sys.exit(main())
