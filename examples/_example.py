"""What the example programs share: picking the backend, the array module, placing arrays, and
checking the loss and every gradient against a float64 numpy reference."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

import unimesh


def start(description: str) -> tuple[unimesh.Backend, int, int]:
    """(backend, number of devices, this process's rank) from ``--backend`` / ``--devices``."""
    parser = argparse.ArgumentParser(description=description)
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
    args = parser.parse_args()
    COMPILE[:] = [] if args.compile is None else [args.compile]
    try:
        backend = unimesh.get_backend(args.backend)
    except unimesh.UnimeshError as exc:  # no --backend, or one not installed: say how to run
        parser.error(f"{exc} (give --backend jax, keras, torch or mlx)")
    n = backend.prepare_devices(args.devices)  # JAX: CPU devices; torch/MLX: the world size
    full_float32_matmuls(backend)
    rank = next(
        (
            int(os.environ[v])
            for v in ("RANK", "OMPI_COMM_WORLD_RANK", "MLX_RANK")
            if v in os.environ
        ),
        0,
    )
    return backend, n, rank


#: set from ``--compile``: empty when the step runs eagerly, else [torch's compiler backend or ""]
COMPILE: list[str] = []


def add_compile_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        nargs="?",
        const="",
        default=None,
        metavar="TORCH_BACKEND",
        help="run the step compiled by unimesh.compile (jax.jit, torch.compile, mx.compile); "
        "for torch, optionally its compiler backend (aot_eager: no C++ build)",
    )


def value_and_grad(fn: Any, backend: unimesh.Backend) -> Any:
    """``unimesh.value_and_grad(fn)``, compiled by the framework's compiler with ``--compile``
    (``unimesh.compile``: the same line on every backend)."""
    step = unimesh.value_and_grad(fn, backend=backend)
    if not COMPILE:
        return step
    if backend.name != "torch":
        return unimesh.compile(step, backend=backend)
    # torch: one graph, no graph breaks (fullgraph=True), by the compiler backend asked for
    options = {"backend": COMPILE[0]} if COMPILE[0] else {}
    return unimesh.compile(step, backend=backend, compiler_options=options, fullgraph=True)


def full_float32_matmuls(backend: unimesh.Backend) -> None:
    """The checks compare with float64 to 1e-5, so matrix products must be full float32: JAX
    on an NVIDIA GPU multiplies float32 in TF32 by default (errors near 4e-4 here); torch
    does not unless asked."""
    if backend.name in ("jax", "keras"):
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")


def split(n: int, first: int) -> tuple[int, int]:
    """Sizes for a two-axis mesh over ``n`` devices: ``first`` for the first axis where ``n``
    divides by it (else 1, e.g. one GPU), the rest for the second."""
    a = first if n % first == 0 else 1
    return a, n // a


def arange(like: Any, n: int) -> Any:
    """0..n-1 where ``like`` lives (torch makes it on the CPU unless told the GPU)."""
    ops = xp(like)
    return ops.arange(n, device=like.device) if ops.__name__ == "torch" else ops.arange(n)


def xp(x: Any) -> Any:
    """The array module of ``x`` (torch, jax.numpy or mlx.core) for the few elementwise
    functions the operators do not cover (tanh, exp, argmax, arange)."""
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        return torch
    if module.startswith("mlx"):
        import mlx.core as mx

        return mx
    import jax.numpy as jnp

    return jnp


def place(tree: Any, specs: Any, mesh: unimesh.Mesh, backend: unimesh.Backend) -> Any:
    """numpy arrays (a dict of them with a dict of specs, or one with one spec) distributed."""
    if isinstance(tree, Mapping):
        return {k: place(v, specs[k], mesh, backend) for k, v in tree.items()}
    return unimesh.distribute(tree, unimesh.Layout(mesh, specs), backend=backend)


def report(
    rank: int,
    backend: unimesh.Backend,
    mesh: unimesh.Mesh,
    value: Any,
    grads: Any,
    want_value: float,
    want_grads: Mapping[str, np.ndarray],
) -> int:
    """Compare the loss and each gradient (gathered whole) with the reference, to 1e-5
    (relative where the reference exceeds 1); print ``RANK r OK|FAIL ...``; exit status."""
    got = {"loss": np.asarray(unimesh.full_array(value, backend=backend), np.float64)}
    for name, g in grads.items():
        got[name] = np.asarray(unimesh.full_array(g, backend=backend), np.float64)
    want = {"loss": np.asarray(want_value, np.float64), **want_grads}
    errors = {
        k: float(np.max(np.abs(got[k] - w) / np.maximum(1.0, np.abs(w)), initial=0.0))
        for k, w in want.items()
    }
    ok = all(e <= 1e-5 for e in errors.values()) and set(got) == set(want)
    worst = max(errors.values())
    print(
        f"RANK {rank} {'OK' if ok else 'FAIL'} backend={backend.name} mesh={mesh.to_string()} "
        f"loss={float(got['loss']):.6f} reference={float(want['loss']):.6f} "
        f"max_error={worst:.2e}",
        flush=True,
    )
    return 0 if ok else 1
