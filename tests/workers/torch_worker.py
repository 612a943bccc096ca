"""One rank of a real torch run (torchrun, gloo). Started by tests/test_torch_multiprocess.py.

    torchrun --standalone --nproc-per-node N tests/workers/torch_worker.py MESH_SPEC [crash]

Each check compares what torch does on this rank with the neutral answer; the rank prints one
line per check and a final ``RANK r OK n`` line, and exits non-zero on the first failure.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import _support  # noqa: F401 - tests/support on sys.path, before its modules are imported
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from unimesh_torch import axis_mesh
from unimesh_torch.runtime import finish_process_group
from worker_checks import Checks

import unimesh
from unimesh import Layout, Mesh, P, UnsupportedError


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    check = Checks(f"rank {rank}")
    if len(sys.argv) > 2 and sys.argv[2] == "crash":
        if rank == 1:
            os._exit(3)
        dist.barrier()  # the others wait for a peer that is gone
        return
    if len(sys.argv) > 2 and sys.argv[2] == "disagree":
        spec = (
            sys.argv[1]
            if rank
            else sys.argv[1] + ";ids=" + ",".join(map(str, reversed(range(world))))
        )
        try:
            unimesh.to_native(Mesh.from_string(spec))
            check(False, "ranks building different meshes must raise")
        except unimesh.MeshMismatchError as exc:
            check("ranks disagree about the mesh" in str(exc), f"disagreement raised: {exc}")
        dist.barrier()  # leave together: a rank gone early makes gloo abort the others
        check.done(f"RANK {rank}")
        # gloo's teardown after this path sometimes aborts ("terminate called without an active
        # exception", about 1 run in 10 on 2 cores): every check has printed, so leave without it
        os._exit(0)
    mesh = Mesh.from_string(sys.argv[1])
    check(mesh.size == world, f"mesh {mesh!r} fills the world of {world}")
    check(unimesh.get_backend().name == "torch", "the backend is detected from the import")

    dm = unimesh.to_native(mesh)
    check(
        dm.get_coordinate() == tuple(mesh.coords(rank).values()),
        f"coordinate {dm.get_coordinate()} == {mesh.coords(rank)}",
    )

    # an all_reduce over each axis group gives the sum of the neutral group
    for i, axis in enumerate(mesh.axis_names):
        (group,) = [g for g in mesh.groups(axis) if rank in g]
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=dm.get_group(i))
        check(
            int(t.item()) == sum(group), f"all_reduce over {axis!r}: {int(t.item())} == sum{group}"
        )

    # backend_override per axis (torch's init_device_mesh spelling): a size-1 axis on the fake
    # backend, as torchtitan does, and gloo with its own options on the others
    from datetime import timedelta

    a = mesh.axis_names[0]
    try:
        unimesh.to_native(mesh, backend_override={a: "fake"})
        check(False, "an unregistered backend in backend_override must be refused")
    except UnsupportedError as exc:
        check("'fake', which is not available" in str(exc), f"unregistered 'fake' refused: {exc}")
    importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers "fake"

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=123)
    with_one = Mesh((*mesh.shape, 1), (*mesh.axis_names, "solo"), mesh.device_ids[..., None])
    over = unimesh.to_native(with_one, backend_override={"solo": "fake", a: ("gloo", opts)})
    check(
        str(dist.get_backend(over.get_group("solo"))) == "fake"
        and str(dist.get_backend(over.get_group(a))) == "gloo",
        f"backend_override: solo group on {dist.get_backend(over.get_group('solo'))}, {a!r} on "
        f"{dist.get_backend(over.get_group(a))}",
    )
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=over.get_group(a))
    (group_a,) = [g for g in mesh.groups(a) if rank in g]
    check(int(t.item()) == sum(group_a), f"all_reduce over overridden {a!r} == sum{group_a}")
    check(
        unimesh.to_native(with_one, backend_override={"solo": "fake", a: ("gloo", opts)}) is over,
        "the same mesh and override give the same DeviceMesh back",
    )
    try:
        unimesh.to_native(with_one, backend_override={"zz": "fake"})
        check(False, "an override for an unknown axis must be refused")
    except UnsupportedError as exc:
        check("'zz', which is not an axis" in str(exc), f"unknown override axis refused: {exc}")

    # distribute: every local tensor is the reference block
    a, b, last = mesh.axis_names[0], mesh.axis_names[1], mesh.axis_names[-1]
    cases = [(P(a, b), (5, 6)), (P((a, b)), (9,)), (P((b, a)), (8,)), (P(None, last), (3, 7))]
    if mesh.ndim > 2:
        cases.append((P((last, a), b), (8, 3)))
    for spec, shape in cases:
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        lay = Layout(mesh, spec)
        dt = unimesh.distribute(x, lay)
        want = x[lay.shard_slices(shape, rank)]
        check(
            torch.equal(dt.to_local(), want),
            f"distribute {spec} of {shape}: local {tuple(dt.to_local().shape)} is the "
            f"reference block {lay.shard_slices(shape, rank)}",
        )
        check(unimesh.from_native(dt) == lay, f"from_native(DTensor) == {lay!r}")
        check(torch.equal(dt.full_tensor(), x), f"full_tensor of {spec} is the original")
        back = unimesh.from_local(want.clone(), lay, shape)  # this rank's block only
        check(
            torch.equal(back.full_tensor(), x) and back.placements == dt.placements,
            f"from_local of this rank's block of {spec}: full_tensor is the original",
        )

    # a device order that decreases along the last axis: Shard there is refused on every rank
    ids = mesh.device_ids[..., ::-1].copy()
    perm = Mesh(mesh.shape, mesh.axis_names, ids)
    try:
        unimesh.distribute(torch.zeros(8), Layout(perm, P(last)))
        check(False, "Shard over a decreasing axis must be refused")
    except UnsupportedError as exc:
        check("not increasing" in str(exc), "Shard over a decreasing axis is refused")
    lay = Layout(perm, P(a))
    x = torch.arange(8.0)
    dt = unimesh.distribute(x, lay)
    check(
        torch.equal(dt.to_local(), x[lay.shard_slices((8,), rank)]),
        f"on {perm!r} P({a!r}) gives rank {rank} at {perm.coords(rank)} the reference block",
    )

    # a DDP step on the "dp" axis mesh: gradients are the mean over the dp group
    dp_axis = "dp" if "dp" in mesh.axis_names else a
    dp_mesh = axis_mesh(mesh, dp_axis)
    (dp_group,) = [g for g in mesh.groups(dp_axis) if rank in g]
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, device_mesh=dp_mesh)

    def batch(r: int) -> torch.Tensor:
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) / (r + 1)

    (ddp(batch(rank)) ** 2).sum().backward()
    grads = [torch.zeros_like(p) for p in reference.parameters()]
    for r in dp_group:
        reference.zero_grad()
        (reference(batch(r)) ** 2).sum().backward()
        for g, p in zip(grads, reference.parameters()):
            g += p.grad / len(dp_group)
    ok = all(torch.allclose(p.grad, g, atol=1e-5) for p, g in zip(model.parameters(), grads))
    check(
        ok,
        f"DDP gradient on {dp_axis!r} mesh {tuple(dp_mesh.mesh.tolist())} is the mean over "
        f"{dp_group}",
    )
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with torch.no_grad():
        expected = [p - 0.1 * g for p, g in zip(reference.parameters(), grads)]
    check(
        all(torch.allclose(p, e, atol=1e-5) for p, e in zip(model.parameters(), expected)),
        "SGD step after DDP matches the single-process reference",
    )

    # parameter sharding by rule: Megatron column/row split over the last axis
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    before = {name: p.detach().clone() for name, p in mlp.named_parameters()}
    rules = unimesh.LayoutMap(
        mesh, {r"0\.weight": P(last, None), r"0\.bias": P(last), r"2\.weight": P(None, last)}
    )
    unimesh.shard_params(mlp, rules)
    for name, param in mlp.named_parameters():
        lay = rules.get(name) or Layout(mesh, P())
        want = before[name][lay.shard_slices(tuple(before[name].shape), rank)]
        shape = tuple(before[name].shape)
        have = unimesh.from_native(param.data)
        check(
            isinstance(param, nn.Parameter)
            and torch.equal(param.to_local(), want)
            and have.device_slices(shape) == lay.device_slices(shape),
            f"shard_params: {name} is a DTensor parameter laid out {lay.spec!r} holding the "
            "reference block",
        )
    x = torch.arange(24.0).reshape(3, 8) / 10
    with torch.no_grad():
        want = x @ before["0.weight"].T + before["0.bias"]
        want = torch.relu(want) @ before["2.weight"].T + before["2.bias"]
        from torch.distributed.tensor import DTensor, Replicate

        got = mlp(
            DTensor.from_local(x, mlp[0].weight.device_mesh, [Replicate()] * mesh.ndim)
        ).full_tensor()
    check(torch.allclose(got, want, atol=1e-5), "the sharded MLP computes the unsharded output")
    try:
        unimesh.shard_params(nn.Linear(3, 5), unimesh.LayoutMap(mesh, {"weight": P(a, None, None)}))
        check(False, "a layout with more dims than the parameter must raise")
    except unimesh.LayoutError as exc:
        check("'weight'" in str(exc), f"shard_params names the parameter: {exc}")

    check.done(f"RANK {rank}")
    finish_process_group()  # two barriers, then destroy: no teardown abort


if __name__ == "__main__":
    main()
