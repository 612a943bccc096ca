"""A pipeline of 4 stages over "pp" (GPipe schedule, microbatches handed on with ``ppermute``),
data-parallel over "dp" where there are devices to spare; forward and backward by autodiff.

Written once against unimesh; the same file runs on JAX, torch and MLX:

    python examples/pipeline.py --backend jax                                    # pp=4, dp=2
    torchrun --standalone --nproc-per-node 4 examples/pipeline.py --backend torch    # pp=4
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/pipeline.py --backend mlx

Stage s holds layer s. At every tick the first stage takes the next microbatch, each stage
applies its layer, the last stage scores the microbatch it finished, and ``ppermute`` hands
every stage's activations to the next one. Autodiff runs the schedule backwards (the transpose
of ``ppermute`` sends cotangents to the previous stage). Every process checks the loss and each
stage's gradient against float64 numpy and prints ``RANK r OK ...``.
"""

from __future__ import annotations

import sys

import numpy as np
from _example import place, report, start, value_and_grad, xp

import unimesh
from unimesh import P

STAGES, MICROBATCHES, MICROBATCH, D_MODEL = 4, 4, 4, 8
DATA = P(None, "dp", None)  # (microbatch, rows over dp, model dim)


def loss(x, t, w):  # type: ignore[no-untyped-def]
    """Blocks: x, t (MICROBATCHES, MICROBATCH/dp, D); w (1, D, D): this stage's layer."""
    stage = unimesh.axis_index("pp")
    stages = unimesh.axis_size("pp")
    first = (stage == 0) * 1.0
    last = (stage == stages - 1) * 1.0
    to_next = [(s, s + 1) for s in range(stages - 1)]
    state = x[0] * 0.0
    total = 0.0
    for tick in range(MICROBATCHES + stages - 1):
        if tick < MICROBATCHES:  # the first stage takes microbatch tick
            state = first * x[tick] + (1.0 - first) * state
        state = xp(x).tanh(state @ w[0])  # this stage's layer
        done = tick - (stages - 1)  # the microbatch the last stage finished
        if done >= 0:
            diff = state - t[done]
            total = total + last * (diff * diff).sum()
        state = unimesh.ppermute(state, "pp", to_next)  # on to the next stage
    count = MICROBATCHES * x.shape[1]
    return unimesh.pmean(unimesh.psum(total, "pp") / count, "dp")


def reference(x, t, w):  # type: ignore[no-untyped-def]
    x, t, w = (a.astype(np.float64) for a in (x, t, w))
    count = x.shape[0] * x.shape[1]
    value, grad = 0.0, np.zeros_like(w)
    for m in range(len(x)):
        hs = [x[m]]
        for s in range(len(w)):
            hs.append(np.tanh(hs[-1] @ w[s]))
        diff = hs[-1] - t[m]
        value += (diff * diff).sum() / count
        d = 2.0 * diff / count
        for s in reversed(range(len(w))):
            d = d * (1 - hs[s + 1] ** 2)
            grad[s] += hs[s].T @ d
            d = d @ w[s].T
    return value, {"w": grad}


def main() -> int:
    backend, n, rank = start(__doc__.splitlines()[0])
    if n % STAGES:
        print(
            f"pipeline.py needs a multiple of {STAGES} devices (one per stage); this run has {n}. "
            f"On one GPU: torchrun --nproc-per-node {STAGES} (gloo, on the CPU) or "
            "JAX_PLATFORMS=cpu with --devices 8",
            file=sys.stderr,
        )
        return 2
    mesh = unimesh.make_mesh({"pp": STAGES, "dp": n // STAGES})
    rng = np.random.default_rng(3)
    x = rng.standard_normal((MICROBATCHES, MICROBATCH, D_MODEL)).astype(np.float32)
    t = rng.standard_normal((MICROBATCHES, MICROBATCH, D_MODEL)).astype(np.float32)
    w = (rng.standard_normal((STAGES, D_MODEL, D_MODEL)) / np.sqrt(D_MODEL)).astype(np.float32)

    program = unimesh.shard_map(
        loss, mesh, in_specs=(DATA, DATA, P("pp")), out_specs=P(), backend=backend
    )
    xs, ts = place(x, DATA, mesh, backend), place(t, DATA, mesh, backend)
    ws = place(w, P("pp"), mesh, backend)
    value, grad = value_and_grad(lambda w: program(xs, ts, w), backend)(ws)
    want_value, want = reference(x, t, w)
    return report(rank, backend, mesh, value, {"w": grad}, want_value, want)


if __name__ == "__main__":
    sys.exit(main())
