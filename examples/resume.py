"""Train, save, resume on another framework and mesh: the loss goes on where it stopped.

    python examples/resume.py --backend jax --steps 3 --save /tmp/ck              # dp=2 x tp=4
    torchrun --standalone --nproc-per-node 4 examples/resume.py --backend torch \\
        --dp 4 --resume /tmp/ck --steps 3 --save /tmp/ck2                        # dp=4 x tp=1
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/resume.py \\
        --backend mlx --dp 1 --resume /tmp/ck2 --steps 3                           # dp=1 x tp=4

The model is mlp_step's two-layer MLP (the first weight split by columns over "tp", the second
by rows); step k trains on batch k (drawn from a generator seeded with k) with SGD. The
checkpoint holds the weights and the step count. A resumed run loads the weights straight into
its own mesh's layouts (``unimesh.load`` with a tree of Layouts: each process reads only its
blocks) and goes on from the saved step. Every process prints ``RANK r STEP k LOSS v REF w`` per
step, ``REF`` being the same training in float64 numpy from step 1 without a stop, then
``RANK r OK ...`` if every loss matched it to 1e-5.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from _example import full_float32_matmuls
from mlp_step import BATCH, D_IN, D_OUT, SPECS, data, loss, reference, sgd

import unimesh
from unimesh import Layout, P


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    return x, rng.standard_normal((BATCH, D_OUT)).astype(np.float32)


def reference_losses(steps: int) -> list[float]:
    """The loss of every step from 1 to ``steps``, trained without a stop in float64."""
    _, _, w1, w2 = data()
    out = []
    for step in range(1, steps + 1):
        value, w1, w2 = reference(*batch(step), w1, w2)
        out.append(float(value))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=os.environ.get("UNIMESH_BACKEND"))
    parser.add_argument("--devices", type=int, default=8, help="JAX: CPU devices to ask for")
    parser.add_argument("--dp", type=int, default=2, help="size of the data-parallel axis")
    parser.add_argument("--steps", type=int, default=3, help="steps to train in this run")
    parser.add_argument("--resume", help="a checkpoint to go on from")
    parser.add_argument("--save", help="where to save the checkpoint at the end")
    args = parser.parse_args()
    try:
        backend = unimesh.get_backend(args.backend)
    except unimesh.UnimeshError as exc:  # no --backend, or one not installed: say how to run
        parser.error(f"{exc} (give --backend jax, keras, torch or mlx)")
    n = backend.prepare_devices(args.devices)
    full_float32_matmuls(backend)
    rank, _ = unimesh.initialize(backend)
    dp = args.dp if n % args.dp == 0 else 1
    mesh = unimesh.make_mesh({"dp": dp, "tp": n // dp})
    layouts = {k: Layout(mesh, spec) for k, spec in SPECS.items()}

    if args.resume:  # the weights straight into this mesh's layouts, the step from the host
        params = unimesh.load(args.resume, {"params": layouts}, backend=backend)["params"]
        done = int(unimesh.open_checkpoint(args.resume).read("step")[0])
    else:
        _, _, w1, w2 = data()
        params = {k: unimesh.distribute(w, layouts[k], backend) for k, w in (("w1", w1),
                  ("w2", w2))}  # fmt: skip
        done = 0

    program = unimesh.shard_map(
        loss, mesh, in_specs=(P("dp", None), P("dp", None), SPECS), out_specs=P(), backend=backend
    )
    update = unimesh.shard_map(sgd, mesh, in_specs=(SPECS, SPECS), out_specs=SPECS, backend=backend)
    want = reference_losses(done + args.steps)
    ok = True
    for step in range(done + 1, done + args.steps + 1):
        x, t = (unimesh.distribute(a, Layout(mesh, P("dp", None)), backend) for a in batch(step))
        step_loss = lambda p, x=x, t=t: program(x, t, p)  # noqa: E731
        value, grads = unimesh.value_and_grad(step_loss, backend=backend)(params)
        params = update(params, grads)
        got = float(unimesh.full_array(value, backend=backend))
        ok &= abs(got - want[step - 1]) <= 1e-5 * max(1.0, abs(want[step - 1]))
        print(f"RANK {rank} STEP {step} LOSS {got:.7f} REF {want[step - 1]:.7f}", flush=True)

    if args.save:
        unimesh.save(args.save, {"params": params, "step": np.array([done + args.steps])})
    print(
        f"RANK {rank} {'OK' if ok else 'FAIL'} backend={backend.name} mesh={mesh.to_string()} "
        f"steps={done + 1}..{done + args.steps}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
