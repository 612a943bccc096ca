"""A torch trainer hands its weights to a JAX server after every step (``unimesh.link``).

``python examples/trainer_to_server.py`` starts both jobs on this machine: the trainer under
``torchrun`` (2 processes, the weights as DTensors sharded over ``tp``) and the server (one
JAX process with 2 CPU devices, its own mesh and layouts, bfloat16 weights). The model is a
bigram language model (an embedding and an output projection) trained on one sentence; after
each step the server receives the new weights, checks the version, and generates a greedy
continuation from them. Each job prints its generations; the trainer's come from its own
weights cast to bfloat16 by torch, so the two must agree.
"""

from __future__ import annotations

import os
import subprocess
import sys

TEXT = "the weights go from the trainer to the server and the server writes the words"
STEPS, DIM, PORT_VAR = 4, 16, "EXAMPLE_LINK_PORT"


def vocabulary() -> list[str]:
    return sorted(set(TEXT.split()))


def generate(embed, out, start: int, argmax, n: int = 6) -> list[int]:
    """Greedy continuation: the next word is the argmax of ``embed[word] @ out``."""
    words = [start]
    for _ in range(n):
        words.append(int(argmax(embed[words[-1]] @ out)))
    return words


def trainer(address: str) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    import unimesh
    from unimesh import Layout, Mesh, P

    rank, _ = unimesh.initialize("torch")
    vocab = vocabulary()
    ids = torch.tensor([vocab.index(w) for w in TEXT.split()])
    torch.manual_seed(0)
    mesh = Mesh((2,), ("tp",))
    embed = unimesh.distribute(torch.randn(len(vocab), DIM) * 0.1, Layout(mesh, P(None, "tp")))
    out = unimesh.distribute(torch.randn(DIM, len(vocab)) * 0.1, Layout(mesh, P("tp")))
    with unimesh.link(address, job="trainer", peer="server", timeout=120) as link:
        for step in range(STEPS):
            for p in (embed, out):
                p.requires_grad_(True)
            logits = embed.full_tensor()[ids[:-1]] @ out.full_tensor()  # a small model
            loss = torch.nn.functional.cross_entropy(logits, ids[1:])
            grads = torch.autograd.grad(loss, [embed, out])
            with torch.no_grad():
                embed = (embed - 2.0 * grads[0]).detach()
                out = (out - 2.0 * grads[1]).detach()
            link.send({"embed": embed, "out": out}, version=step)
            e16 = embed.full_tensor().to(torch.bfloat16).float()
            o16 = out.full_tensor().to(torch.bfloat16).float()
            words = generate(e16, o16, ids[0].item(), torch.argmax)
            if rank == 0:
                print(f"trainer step {step} loss {loss.item():.3f}: "
                      + " ".join(vocab[w] for w in words), flush=True)  # fmt: skip
    assert isinstance(embed, DTensor)


def server(address: str) -> None:
    import jax
    import jax.numpy as jnp

    import unimesh
    from unimesh import Layout, Mesh, P

    unimesh.initialize("jax")
    vocab = vocabulary()
    mesh = Mesh((2,), ("model",))
    target = {"embed": Layout(mesh, P("model")), "out": Layout(mesh, P(None, "model"))}
    with unimesh.link(address, job="server", peer="trainer", timeout=120) as link:
        for step in range(STEPS):
            stats: dict[str, int] = {}
            weights = link.receive(target, version=step, dtype="bfloat16", stats=stats)
            assert isinstance(weights["embed"], jax.Array) and link.version == step
            embed, out = (weights[k].astype(jnp.float32) for k in ("embed", "out"))
            words = generate(embed, out, vocab.index(TEXT.split()[0]), jnp.argmax)
            print(f"server step {step} ({stats['bytes_received']} bytes): "
                  + " ".join(vocab[w] for w in words), flush=True)  # fmt: skip


def main() -> None:
    if len(sys.argv) == 3:
        {"trainer": trainer, "server": server}[sys.argv[1]](sys.argv[2])
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    jobs = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", __file__, "trainer", address], env=env),
        subprocess.Popen([sys.executable, __file__, "server", address],
                         env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2")),
    ]  # fmt: skip
    codes = [job.wait(timeout=300) for job in jobs]
    sys.exit(max(abs(c) for c in codes))


if __name__ == "__main__":
    main()
