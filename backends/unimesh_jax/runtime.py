"""The JAX backend's runtime layer: the global device order, simulated CPU devices, and
``jax.distributed`` started from the launcher's environment (or JAX's cluster detection), with
the exchange that :func:`unimesh.verify` uses. jax is imported inside the functions."""

from __future__ import annotations

from typing import Any

import numpy as np

from unimesh import Backend, LaunchError, MeshMismatchError
from unimesh.messages import first_line

from .rendezvous import leave_without_peers, processes, rendezvous


def import_jax() -> Any:
    import jax

    return jax


def global_devices() -> list[Any]:
    """JAX's devices in unimesh's logical order: by process, then by id within the process."""
    return list(device_array())


_DEVICES: list[Any] = []  # [(device count, object array in logical order)]


def device_array() -> np.ndarray:
    """:func:`global_devices` as an object array, sorted once per device set (JAX's device
    list is fixed once its runtime has started)."""
    count = import_jax().device_count()
    if _DEVICES and _DEVICES[0][0] == count:
        cached: np.ndarray = _DEVICES[0][1]
        return cached
    devs = sorted(import_jax().devices(), key=lambda d: (d.process_index, d.id))
    arr = np.fromiter(devs, dtype=object, count=len(devs))  # no per-object inspection
    _DEVICES[:] = [(count, arr)]
    return arr


def request_cpu_devices(count: int) -> None:
    """Ask XLA for ``count`` virtual CPU devices (XLA_FLAGS). Only possible before jax is
    imported, and only when nobody has asked already; otherwise it does nothing."""
    import os
    import sys

    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


_EXCHANGES = [0]


def _absent(client: Any, key: str, others: range) -> list[int]:
    """Which of ``others`` have not set their part of the exchange ``key`` (asked without
    waiting; a service that is gone answers for none)."""
    failed = import_jax().errors.JaxRuntimeError
    out = []
    for other in others:
        try:
            client.key_value_try_get_bytes(f"{key}{other}")
        except failed:  # NOT_FOUND, or the service is unreachable
            out.append(other)
    return out


def _detected_cluster() -> str | None:
    """The name of the cluster JAX's ``jax.distributed.initialize()`` would detect from the
    environment (SLURM, Open MPI, Cloud TPU, Kubernetes), or None. Asks JAX's own list of
    cluster kinds; an internal it no longer has means no detection (one process)."""
    try:
        from jax._src import clusters

        kinds = list(clusters.ClusterEnv._cluster_types)
        for kind in kinds:
            if not getattr(kind, "opt_in_only_method", False) and kind.is_env_present():
                return str(getattr(kind, "name", kind.__name__))
    except Exception:  # noqa: BLE001 - a JAX internal: any failure means "none detected"
        return None
    return None


class JaxRuntime(Backend):
    """The runtime layer: devices and processes."""

    def prepare_devices(self, count: int) -> int:
        """Before jax is imported: ``count`` virtual CPU devices (XLA_FLAGS), shared out over
        the processes when ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
        ``JAX_PROCESS_ID`` ask for a multi-process run, which is then started with
        ``jax.distributed.initialize`` over gloo CPU collectives. Returns the number of global
        devices."""
        import os

        procs = os.environ.get("JAX_NUM_PROCESSES")
        multi = all(os.environ.get(v) for v in JAX_ENV)
        request_cpu_devices(max(1, count // int(procs)) if multi and procs else count)
        self.initialize(300.0)
        return len(global_devices())

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:
        """``jax.distributed.initialize`` (gloo CPU collectives) from ``JAX_COORDINATOR_ADDRESS``,
        ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (``launch``'s values win over them), every
        process joining within ``timeout`` seconds (checked first by
        :func:`~unimesh_jax.runtime.rendezvous`, which names a process that never came); a
        peer that stops sending heartbeats for ``timeout`` seconds (at least 10, at most JAX's
        default 100) is gone, and JAX ends the others. Where none of the three is known, JAX's
        own cluster detection (SLURM, Open MPI, Cloud TPU, Kubernetes) starts the job, as
        ``jax.distributed.initialize()`` does; no cluster found: one process."""
        import os

        given: dict[str, str | None] = {v: os.environ.get(v) or None for v in JAX_ENV}
        if launch is not None:
            for var, value in zip(JAX_ENV, launch):
                if value is not None:
                    given[var] = str(value)
        missing = [v for v, value in given.items() if not value]
        jax = import_jax()
        if jax.distributed.is_initialized():
            return int(jax.process_index()), int(jax.process_count())
        cluster = _detected_cluster() if missing else None
        if cluster is not None:
            return self._start_detected(cluster, given, timeout)
        if len(missing) not in (0, len(JAX_ENV)):
            raise LaunchError(
                f"a multi-process JAX run needs {', '.join(JAX_ENV)} (or initialize("
                "coordinator_address=..., num_processes=..., process_id=...)); "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (the others "
                "are) and no cluster JAX detects (SLURM, Open MPI, Cloud TPU) is around: set "
                "them on every process (process ids 0..N-1), or none for one process"
            )
        if not missing:
            address = str(given["JAX_COORDINATOR_ADDRESS"])
            try:
                procs, pid = int(str(given["JAX_NUM_PROCESSES"])), int(str(given["JAX_PROCESS_ID"]))
            except ValueError:
                raise LaunchError(
                    f"JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers, got "
                    f"{given['JAX_NUM_PROCESSES']!r} and "
                    f"{given['JAX_PROCESS_ID']!r}"
                ) from None
            if not 0 <= pid < procs:
                raise LaunchError(
                    f"JAX_PROCESS_ID={pid} must be in 0..JAX_NUM_PROCESSES-1 "
                    f"(JAX_NUM_PROCESSES={procs})"
                )
            rendezvous(address, procs, pid, timeout)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            try:
                # a peer silent for longer than this is gone (JAX's default: 100 s), and the
                # exit barrier waits no longer for it
                patience = max(10, min(100, int(timeout)))
                jax.distributed.initialize(
                    address,
                    num_processes=procs,
                    process_id=pid,
                    initialization_timeout=max(1, int(timeout)),
                    heartbeat_timeout_seconds=patience,
                    shutdown_timeout_seconds=patience,
                )
            except RuntimeError as exc:
                if "once" not in str(exc):
                    first = first_line(exc)
                    raise LaunchError(
                        f"jax.distributed.initialize({address!r}, num_processes={procs}, "
                        f"process_id={pid}) failed within {timeout:.0f} s (a peer process may "
                        f"be gone, or JAX already ran a computation): {first}"
                    ) from exc
        return int(jax.process_index()), int(jax.process_count())

    def _start_detected(
        self, cluster: str, given: dict[str, str | None], timeout: float
    ) -> tuple[int, int]:
        """``jax.distributed.initialize`` with what is known; JAX's detection of ``cluster``
        fills in the rest."""
        jax = import_jax()
        procs, pid = given["JAX_NUM_PROCESSES"], given["JAX_PROCESS_ID"]
        try:
            jax.distributed.initialize(
                given["JAX_COORDINATOR_ADDRESS"],
                num_processes=None if procs is None else int(procs),
                process_id=None if pid is None else int(pid),
                initialization_timeout=max(1, int(timeout)),
            )
        except (RuntimeError, ValueError) as exc:
            raise LaunchError(
                f"jax.distributed.initialize() found a {cluster} job but could not start it "
                f"within {timeout:.0f} s: {first_line(exc)}; pass coordinator_address, "
                "num_processes and process_id to unimesh.initialize, or set JAX_COORDINATOR_"
                "ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"
            ) from exc
        return int(jax.process_index()), int(jax.process_count())

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """Through the ``jax.distributed`` coordination service's key-value store: each process
        sets its payload, then reads every other one with a deadline."""
        import time

        from jax._src import distributed

        index, count = self.initialize(timeout)
        if count == 1:
            return [payload]
        client: Any = distributed.global_state.client
        _EXCHANGES[0] += 1
        key = f"unimesh/exchange/{_EXCHANGES[0]}/"
        client.key_value_set_bytes(f"{key}{index}", payload)
        deadline = time.monotonic() + timeout
        out = []
        for other in range(count):
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                out.append(bytes(client.blocking_key_value_get_bytes(f"{key}{other}", left)))
            except Exception as exc:  # JaxRuntimeError: deadline exceeded, service gone
                absent = [other, *_absent(client, key, range(other + 1, count))]
                leave_without_peers()
                first = first_line(exc)
                raise MeshMismatchError(
                    f"process {index} of {count}: {processes(absent)} did not take part in the "
                    f"check within {timeout:.0f} s; a peer process is gone or stuck "
                    f"({first[:200]})"
                ) from exc
        return out
