"""One rank of a torchrun run: a unimesh program made before ``torch._dynamo`` is imported
compiles as one graph when the user calls ``torch.compile(..., fullgraph=True)`` directly (not
``unimesh.compile``), and gives the eager program's values.

    torchrun --standalone --nproc-per-node 4 tests/workers/torch_compile_worker.py
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from unimesh_torch.runtime import finish_process_group

import unimesh
from unimesh import Layout, P


def main() -> None:
    backend = unimesh.get_backend("torch")
    backend.prepare_devices(4)
    rank = torch.distributed.get_rank()
    mesh = unimesh.make_mesh({"dp": 2, "tp": 2})
    loaded = "torch._dynamo" in sys.modules  # the case under test needs it not loaded yet
    program = unimesh.shard_map(
        lambda x, w: unimesh.psum(x @ w, "tp"),
        mesh,
        (P("dp", "tp"), P("tp", None)),
        P("dp", None),
        backend=backend,
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3)).astype(np.float32)
    xs = unimesh.distribute(torch.as_tensor(x), Layout(mesh, P("dp", "tp")), backend=backend)
    ws = unimesh.distribute(torch.as_tensor(w), Layout(mesh, P("tp", None)), backend=backend)
    compiled = torch.compile(
        lambda a, b: program(a, b).full_tensor(), backend="aot_eager", fullgraph=True
    )
    got = compiled(xs, ws).numpy()  # first: no eager call has given the program its twin
    eager = program(xs, ws).full_tensor().numpy()
    want = x.astype(np.float64) @ w.astype(np.float64)
    ok = (
        not loaded
        and np.allclose(got, want, rtol=1e-5, atol=1e-5)
        and np.allclose(got, eager, rtol=1e-6, atol=1e-6)
    )
    print(
        f"RANK {rank} {'OK' if ok else 'FAIL'} dynamo loaded before the program: {loaded}; "
        f"compiled max error {np.abs(got - want).max():.2e}",
        flush=True,
    )
    finish_process_group()  # two barriers, then destroy: no teardown abort


if __name__ == "__main__":
    main()
