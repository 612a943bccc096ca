"""The MLX backend's runtime layer: ``mx.distributed.init`` checked against the launcher
(mlx.launch, mpirun), and the exchange ``unimesh.verify`` uses, both under the watchdog; the
process's state (the world, split groups released at exit, sign-ins, the watchdog) is
:data:`.process.PROCESS`."""

from __future__ import annotations

from typing import Any

import numpy as np

from unimesh import ConversionError, MeshMismatchError, UnsupportedError
from unimesh.spmd import ProcessBackend

from .process import PROCESS


def import_mx() -> Any:
    """``mlx.core``, imported on first use."""
    return PROCESS.mx()


#: numpy dtypes MLX holds under another name (numpy's own name for the rest)
_MX_DTYPES = (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "bfloat16", "complex64",
)  # fmt: skip


def host_to_mx(value: Any) -> Any:
    """A numpy array (or array-like) as an ``mx.array`` of the same dtype. ``mx.array`` alone
    turns float64 into float32 without a word; MLX's CPU holds float64, so it is kept (MLX's
    own float64 ``sin``/``exp`` are only float32-accurate: that is MLX's). A dtype MLX lacks
    (complex128, strings, objects) is a ConversionError naming it."""
    mx = import_mx()
    host = np.asarray(value)
    name = str(host.dtype)
    if name == "bfloat16":  # ml_dtypes' bfloat16: the same bytes
        return mx.array(host.view(np.uint16)).view(mx.bfloat16)
    if name not in _MX_DTYPES:
        raise ConversionError(
            f"MLX has no dtype {name}: MLX holds "
            f"{', '.join(_MX_DTYPES)}; cast it first (e.g. .astype(np.complex64))"
        )
    return mx.array(host, dtype=getattr(mx, "bool_" if name == "bool" else name))


def mx_to_host(x: Any) -> np.ndarray:
    """An ``mx.array`` as numpy of the same dtype (bfloat16 as ml_dtypes' bfloat16, over the
    same bytes: numpy has none of its own)."""
    mx = import_mx()
    if x.dtype == mx.bfloat16:
        import ml_dtypes

        return np.array(x.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(x)


class MLXRuntime(ProcessBackend):
    """The runtime layer: MLX's distributed world, one device per process."""

    def _world(self) -> Any:
        PROCESS.engines.add(self)  # its programs' pending results: let go at exit
        return PROCESS.start(300.0)

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:
        """``mx.distributed.init()`` within ``timeout`` seconds, checked against the process
        count the launcher says it started (:meth:`.process.MLXProcess.start`). MLX's
        launchers start the processes and tell them where to meet: launch parameters are
        refused."""
        if launch is not None:
            raise UnsupportedError(
                f"the mlx backend takes no launch parameters (got {launch}): mlx.launch and "
                "mpirun start MLX's processes and tell them where to meet; run the script "
                "under `mlx.launch -n N -- python ...` or `mpirun -np N python ...`",
                backend=self.name,
                capability="multi_process",
            )
        world = PROCESS.start(timeout)
        return int(world.rank()), int(world.size())

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """``mx.distributed.all_gather`` of the lengths, then of the padded bytes, over the
        world group, under the watchdog (:meth:`.process.MLXProcess.watch`)."""
        mx = import_mx()
        rank, world_size = self.initialize(timeout)
        if world_size == 1:
            return [payload]
        world = PROCESS.world
        PROCESS.checks += 1
        with PROCESS.watch(
            timeout,
            f"the mesh check on rank {rank} of {world_size}",
            f"check{PROCESS.checks}",
            str(rank),
        ):
            try:
                sizes = mx.distributed.all_gather(
                    mx.array([len(payload)], dtype=mx.int32), group=world
                )
                longest = int(mx.max(sizes).item())
                mine = np.zeros(longest, dtype=np.int32)
                mine[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
                every = mx.distributed.all_gather(mx.array(mine), group=world)
                mx.eval(every)
            except RuntimeError as exc:
                raise MeshMismatchError(
                    f"rank {rank} of {world_size}: a peer process is gone ({exc})"
                ) from exc
        rows = np.array(every).reshape(world_size, longest)
        return [bytes(rows[r, : int(n)].astype(np.uint8)) for r, n in enumerate(np.array(sizes))]

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]]:
        """``mlx.launch -n N --backend ring -- python`` (the ring backend needs no MPI)."""
        import sys
        from pathlib import Path

        launch = Path(sys.executable).with_name("mlx.launch")
        return [str(launch), "-n", str(processes), "--backend", "ring", "--", sys.executable], {}

    def prepare_devices(self, count: int) -> int:
        return self.initialize(300.0)[1]
