"""A mixture-of-experts layer with expert parallelism over "ep": top-1 routing, ``all_to_all``
dispatch to the experts' devices and ``all_to_all`` combine, forward and backward by autodiff.

Written once against unimesh; the same file runs on JAX, torch and MLX:

    python examples/moe_layer.py --backend jax                                   # ep=8
    torchrun --standalone --nproc-per-node 4 examples/moe_layer.py --backend torch
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/moe_layer.py --backend mlx

Tokens are split over "ep", and so are the experts (two per device). Each device routes its
tokens with a replicated router (softmax gate, top-1 expert), lays them out per expert, and one
``all_to_all`` sends every expert its tokens from all devices; the experts run where their
weights are, and a second ``all_to_all`` brings the outputs back to the tokens' devices, where
the gate weighs them. (Every token keeps a slot in every expert here, masked: capacity is the
number of local tokens, so none is dropped.) The router's gradient is summed over "ep"; each
expert's gradient stays on its device. Every process checks the loss, the router's and the
experts' gradients against float64 numpy and prints ``RANK r OK ...``.
"""

from __future__ import annotations

import sys

import numpy as np
from _example import arange, place, report, start, value_and_grad, xp

import unimesh
from unimesh import P

TOKENS_PER_DEVICE, D_MODEL, EXPERTS_PER_DEVICE = 8, 8, 2
SPECS = {"router": P(), "experts": P("ep")}


def loss(x, t, params):  # type: ignore[no-untyped-def]
    """Blocks: x, t (tokens/ep, D); router (D, E) whole; experts (E/ep, D, D)."""
    ops = xp(x)
    n_experts = params["router"].shape[1]
    logits = x @ params["router"]  # (tokens, E)
    probs = ops.exp(logits) / ops.exp(logits).sum(-1)[:, None]  # softmax
    choice = ops.argmax(logits, -1)  # top-1 (no gradient)
    onehot = (choice[:, None] == arange(x, n_experts)[None, :]) * 1.0
    gate = (probs * onehot).sum(-1)  # (tokens,)
    slots = onehot.T[:, :, None] * x[None, :, :]  # (E, tokens, D)
    arrived = unimesh.all_to_all(slots, "ep", 0, 1, tiled=True)  # (E/ep, ep*tokens, D)
    done = ops.tanh(arrived @ params["experts"])  # the local experts
    back = unimesh.all_to_all(done, "ep", 1, 0, tiled=True)  # (E, tokens, D)
    out = (back * (onehot.T * gate[None, :])[:, :, None]).sum(0)  # (tokens, D)
    diff = out - t
    return unimesh.pmean((diff * diff).sum() / x.shape[0], "ep")  # mean over all tokens


def reference(x, t, router, experts):  # type: ignore[no-untyped-def]
    x, t, router, experts = (a.astype(np.float64) for a in (x, t, router, experts))
    logits = x @ router
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    choice = logits.argmax(-1)
    rows = np.arange(len(x))
    gate = probs[rows, choice]
    y = np.tanh(np.einsum("td,tde->te", x, experts[choice]))
    out = gate[:, None] * y
    diff = out - t
    dout = 2.0 * diff / len(x)
    dpre = gate[:, None] * dout * (1 - y * y)
    g_experts = np.zeros_like(experts)
    np.add.at(g_experts, choice, np.einsum("td,te->tde", x, dpre))
    dprobs = np.zeros_like(probs)
    dprobs[rows, choice] = (dout * y).sum(-1)
    dlogits = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    return (diff * diff).sum() / len(x), {"router": x.T @ dlogits, "experts": g_experts}


def main() -> int:
    backend, n, rank = start(__doc__.splitlines()[0])
    mesh = unimesh.make_mesh({"ep": n})
    experts_total = EXPERTS_PER_DEVICE * n
    rng = np.random.default_rng(2)
    x = rng.standard_normal((TOKENS_PER_DEVICE * n, D_MODEL)).astype(np.float32)
    t = rng.standard_normal((TOKENS_PER_DEVICE * n, D_MODEL)).astype(np.float32)
    router = rng.standard_normal((D_MODEL, experts_total)).astype(np.float32)
    experts = (rng.standard_normal((experts_total, D_MODEL, D_MODEL)) / np.sqrt(D_MODEL)).astype(
        np.float32
    )

    program = unimesh.shard_map(
        loss, mesh, in_specs=(P("ep"), P("ep"), SPECS), out_specs=P(), backend=backend
    )
    xs, ts = place(x, P("ep"), mesh, backend), place(t, P("ep"), mesh, backend)
    params = place({"router": router, "experts": experts}, SPECS, mesh, backend)
    value, grads = value_and_grad(lambda p: program(xs, ts, p), backend)(params)
    want_value, want = reference(x, t, router, experts)
    return report(rank, backend, mesh, value, grads, want_value, want)


if __name__ == "__main__":
    sys.exit(main())
