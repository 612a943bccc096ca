"""One process of a real multi-process JAX run (jax.distributed over gloo CPU collectives, 2 CPU
devices each). Started by tests/test_jax_multiprocess.py:

    python tests/workers/jax_worker.py 127.0.0.1:PORT NUM_PROCESSES PROCESS_ID

It checks the neutral answers against JAX's own on this process, prints one line per check and
``PROCESS i OK n``, and exits non-zero on the first failure.
"""

from __future__ import annotations

import math
import sys

import _support  # noqa: F401 - tests/support on sys.path, before its modules are imported
import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")
address, n, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jax.distributed.initialize(address, num_processes=n, process_id=pid)

from unimesh_jax import global_devices
from worker_checks import Checks

import unimesh
from unimesh import Layout, Mesh, P, make_mesh

check = Checks(f"process {pid}")


devs = global_devices()
check(
    jax.process_index() == pid and len(devs) == 2 * n and jax.local_device_count() == 2,
    f"{len(devs)} global devices, 2 local, process {jax.process_index()}",
)
check(
    [d.process_index for d in devs] == [i // 2 for i in range(2 * n)],
    "logical order is by process, then local index",
)

# dp across processes, tp inside each one (JAX's hybrid layout)
hybrid = make_mesh({"dp": 1, "tp": 2}, dcn_axes={"dp": n})
# tp across processes, dp inside: each process holds a column
columns = Mesh((2, n), ("dp", "tp"), np.arange(2 * n).reshape(n, 2).T, devices_per_process=2)
for mesh in (hybrid, columns):
    jm = unimesh.to_native(mesh, "jax")
    check(
        list(jm.devices.ravel()) == [devs[i] for i in mesh.device_ids.ravel()],
        f"{mesh!r}: JAX mesh holds the devices at the logical positions",
    )
    check(unimesh.from_native(jm) == mesh, "from_native(to_native(mesh)) == mesh")
    local_ids = mesh.local_device_ids(pid)
    check(
        [devs[i] for i in local_ids] == [d for d in jm.devices.ravel() if d.process_index == pid],
        f"local_device_ids({pid}) = {local_ids} are this process's devices in mesh order",
    )
    local = mesh.local_mesh(pid)
    check(
        list(jm.local_mesh.devices.ravel()) == [devs[i] for i in local.device_ids.ravel()]
        and jm.local_mesh.devices.shape == local.shape,
        f"local_mesh({pid}) = {local!r} is JAX's local_mesh",
    )

    for spec, shape in [
        (P("dp", "tp"), (4 * n, 4 * n)),
        (P(("dp", "tp")), (4 * n,)),
        (P(("tp", "dp")), (4 * n,)),
        (P(None, "tp"), (3, 4 * n)),
    ]:
        x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
        lay = Layout(mesh, spec)
        arr = unimesh.distribute(x, lay, "jax")
        ok = len(arr.addressable_shards) == 2
        for shard in arr.addressable_shards:
            d = devs.index(shard.device)
            ok &= shard.device.process_index == pid
            ok &= bool(np.array_equal(np.asarray(shard.data), x[lay.shard_slices(shape, d)]))
        check(ok, f"distribute {spec} of {shape}: both local shards are the reference blocks")
        total = jax.jit(lambda a: (a * 2).sum())(arr)
        got = float(np.asarray(total.addressable_data(0)))
        check(
            got == float(x.sum() * 2),
            f"jitted reduction across processes: {got} == {float(x.sum() * 2)}",
        )
        # the inverse: from this process's blocks only (no process sees x in full)
        back = unimesh.from_local(unimesh.local_shards(arr), lay, shape, backend="jax")
        check(
            back.sharding == arr.sharding
            and all(
                np.array_equal(np.asarray(s.data), x[lay.shard_slices(shape, devs.index(s.device))])
                for s in back.addressable_shards
            ),
            f"from_local(local_shards) of {spec}: the same sharding and blocks",
        )

# a data loader's slice: each process loads only its rows of the batch (dp across processes)
batch_layout = Layout(hybrid, P("dp"))
rows = np.arange(8 * n * 3, dtype=np.float32).reshape(8 * n, 3)
mine = rows[8 * pid : 8 * (pid + 1)]
ours = unimesh.from_local(mine, batch_layout, rows.shape, backend="jax")
theirs = jax.make_array_from_process_local_data(
    unimesh.to_native(batch_layout, "jax"), mine, rows.shape
)
check(
    ours.sharding == theirs.sharding
    and all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for a, b in zip(ours.addressable_shards, theirs.addressable_shards)
    ),
    "from_local(process rows) == jax.make_array_from_process_local_data",
)
total = float(np.asarray(jax.jit(lambda a: a.sum())(ours).addressable_data(0)))
check(total == float(rows.sum()), f"a sum over the whole batch from per-process rows: {total}")

# unimesh.reshard across processes: JAX's compiled reshard on one device list, and the plan's
# pieces over JAX's collectives (ppermute between processes) onto another device list or a
# sub-mesh; every block bit for bit, bytes received the minimum (tests/support/reshard_cases.py)
import reshard_cases

mine_ids = {i for i, d in enumerate(devs) if d.process_index == pid}
for key, problem in sorted(reshard_cases.run_all("jax", 2 * n, mine_ids, subsets=True).items()):
    check(problem == 0.0, f"{key}: {problem}")

check.done(f"PROCESS {pid}")
jax.distributed.shutdown()
