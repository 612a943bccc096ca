"""A transformer MLP block with tensor and sequence parallelism over "tp" and data parallelism
over "dp" (Megatron-LM's sequence parallelism), forward and backward by autodiff.

Written once against unimesh; the same file runs on JAX, torch and MLX:

    python examples/tp_sp_block.py --backend jax                                 # dp=2, tp=4
    torchrun --standalone --nproc-per-node 4 examples/tp_sp_block.py --backend torch
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/tp_sp_block.py --backend mlx

Activations are split by sequence over "tp" outside the block. Inside, ``all_gather`` along the
sequence gives each device the whole sequence, the first weight is split by columns and the
second by rows over "tp" (each device computes a partial output), and ``psum_scatter`` sums the
partials and splits the sequence again; the residual adds the block's input. Autodiff turns
the gather into a reduce-scatter and the reduce-scatter into a gather. The weights are
replicated over "dp", so their gradients are summed over it. Every process checks the loss and
the weight gradients against float64 numpy and prints ``RANK r OK ...``.
"""

from __future__ import annotations

import sys

import numpy as np
from _example import place, report, split, start, value_and_grad, xp

import unimesh
from unimesh import P

BATCH, SEQ, D_MODEL, D_FF = 4, 8, 8, 32
SPECS = {"w1": P(None, "tp"), "w2": P("tp", None)}
ACTS = P("dp", "tp", None)  # (batch over dp, sequence over tp, model dim)


def loss(x, t, params):  # type: ignore[no-untyped-def]
    """Blocks: x, t (BATCH/dp, SEQ/tp, D_MODEL); w1 (D_MODEL, D_FF/tp); w2 (D_FF/tp, D_MODEL)."""
    whole = unimesh.all_gather(x, "tp", dim=1)  # (B/dp, SEQ, D): the sequence
    h = xp(x).tanh(whole @ params["w1"])  # column-parallel
    partial = h @ params["w2"]  # row-parallel: a partial sum
    y = unimesh.psum_scatter(partial, "tp", scatter_dimension=1, tiled=True)  # (B/dp, SEQ/tp, D)
    diff = x + y - t  # residual
    count = x.shape[0] * x.shape[1]
    return unimesh.pmean((diff * diff).sum() / count, ("dp", "tp"))  # mean over tokens


def reference(x, t, w1, w2):  # type: ignore[no-untyped-def]
    x, t, w1, w2 = (a.astype(np.float64) for a in (x, t, w1, w2))
    h = np.tanh(x @ w1)
    diff = x + h @ w2 - t
    count = x.shape[0] * x.shape[1]
    dy = 2.0 * diff / count
    g2 = np.einsum("bsf,bsd->fd", h, dy)
    g1 = np.einsum("bsd,bsf->df", x, (dy @ w2.T) * (1 - h * h))
    return (diff * diff).sum() / count, {"w1": g1, "w2": g2}


def main() -> int:
    backend, n, rank = start(__doc__.splitlines()[0])
    dp, tp = split(n, 2)
    mesh = unimesh.make_mesh({"dp": dp, "tp": tp})
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, SEQ, D_MODEL)).astype(np.float32)
    t = rng.standard_normal((BATCH, SEQ, D_MODEL)).astype(np.float32)
    w1 = (rng.standard_normal((D_MODEL, D_FF)) / np.sqrt(D_MODEL)).astype(np.float32)
    w2 = (rng.standard_normal((D_FF, D_MODEL)) / np.sqrt(D_FF)).astype(np.float32)

    program = unimesh.shard_map(
        loss, mesh, in_specs=(ACTS, ACTS, SPECS), out_specs=P(), backend=backend
    )
    xs, ts = place(x, ACTS, mesh, backend), place(t, ACTS, mesh, backend)
    params = place({"w1": w1, "w2": w2}, SPECS, mesh, backend)
    value, grads = value_and_grad(lambda p: program(xs, ts, p), backend)(params)
    want_value, want = reference(x, t, w1, w2)
    return report(rank, backend, mesh, value, grads, want_value, want)


if __name__ == "__main__":
    sys.exit(main())
