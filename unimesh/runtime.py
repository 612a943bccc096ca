"""The distributed runtime: start it from the launcher's environment (:func:`initialize`) and
check that every process describes the same mesh (:func:`verify`) before a collective can hang
on a disagreement. Framework-free; each backend exchanges the bytes with its own collective."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from .errors import (
    BackendNotFoundError,
    LaunchError,
    LayoutError,
    MeshMismatchError,
    UnimeshError,
    UnsupportedError,
)
from .launchers import Launcher, find_launcher
from .mesh import Mesh
from .messages import short
from .registry import ENV_VAR, REGISTRY, get_backend

__all__ = [
    "Launch",
    "Launcher",
    "detect_launcher",
    "fingerprint",
    "initialize",
    "started",
    "verify",
]


def detect_launcher(environ: Mapping[str, str] | None = None) -> Launcher | None:
    """The launcher that started this process, read from its environment (``os.environ``
    unless ``environ`` is given), or None outside one.

    Each installed backend declares the launchers that start its runtime, as the variables
    that mark their processes (``Backend.launcher_signs``: torchrun's ``TORCHELASTIC_RUN_ID``,
    mpirun's ``OMPI_COMM_WORLD_SIZE`` ...); the core keeps no list of them. A launcher of one
    framework wins over a generic one (an MPI environment around it); two frameworks'
    launchers at once are a :class:`~unimesh.LaunchError`. Loads the backends' plugin
    modules, no framework.
    """
    env = os.environ if environ is None else environ
    if not isinstance(env, Mapping):
        raise LaunchError(
            f"detect_launcher() reads a mapping of environment variables (like os.environ), "
            f"got {short(environ)}"
        )
    return find_launcher(REGISTRY.all_loaded(), env)


def _runtime_backend(backend: Any) -> Any:
    """The backend to start: the one given (or in ``UNIMESH_BACKEND``), else the launcher's,
    else the one detected from the imported frameworks."""
    if backend is not None or os.environ.get(ENV_VAR, "").strip():
        return get_backend(backend)  # given, or named by UNIMESH_BACKEND: that one
    launcher = detect_launcher()
    if launcher is None:
        return get_backend(None)
    try:
        be = get_backend(launcher.backend)
    except BackendNotFoundError as exc:
        raise LaunchError(
            f"found the launcher {launcher}, which starts the {launcher.backend} backend, but "
            f"that backend cannot be used here ({exc}); install it (pip install "
            f'"unimesh[{launcher.backend}]") or pass backend=...'
        ) from None
    import logging

    logging.getLogger("unimesh").info("found %s: starting the %s backend", launcher, be.name)
    return be


#: The fields compared by :func:`verify`, in the order a mismatch message names them.
FIELDS = ("shape", "axis_names", "device_order", "axis_types", "devices_per_process", "layout")


def _timeout(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UnimeshError(f"{what} must be a number of seconds > 0, got {short(value)}")
    return float(value)


class Launch(NamedTuple):
    """Where the processes of a job meet, as :func:`initialize` was told (by its arguments or
    Keras's ``KERAS_DISTRIBUTION_*`` variables); None where not said (the backend's launcher
    environment, or its cluster detection, says it)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


#: Keras's names for the launch parameters (``keras.distribution.initialize`` reads them)
KERAS_VARS = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)


def _count(value: object, what: str, lowest: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value.strip()) if len(value.strip()) < 10 else value
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value < 2**31:
        raise LaunchError(f"{what} must be an int >= {lowest}, got {short(value)}")
    return value


def _launch(
    coordinator_address: object,
    job_addresses: object,
    num_processes: object,
    process_id: object,
    env: Mapping[str, str],
) -> Launch | None:
    """The launch parameters from the arguments, else Keras's variables; None if none."""
    if coordinator_address is not None and job_addresses is not None:
        raise LaunchError(
            "initialize() takes coordinator_address (JAX's name) or job_addresses (Keras's), "
            "not both: the coordinator is the first job address"
        )
    address = coordinator_address if coordinator_address is not None else job_addresses
    if address is None:
        address = env.get(KERAS_VARS[0]) or None
    jobs: list[str] | None = None
    if address is not None:
        if not isinstance(address, str) or not address.strip(" ,"):
            raise LaunchError(
                f"coordinator_address/job_addresses must be 'host:port' (job addresses: "
                f"comma-separated, the first one the coordinator), got {short(address)}"
            )
        if "," in address and coordinator_address is None:  # Keras's list of jobs
            jobs = [a.strip() for a in address.split(",")]
        address = address.split(",")[0].strip()
    procs = _count(
        num_processes if num_processes is not None else env.get(KERAS_VARS[1]) or None,
        "num_processes (KERAS_DISTRIBUTION_NUM_PROCESSES)",
        1,
    )
    if jobs is not None and procs is not None and procs != len(jobs):
        # keras.distribution.initialize refuses this at once; waiting for a process that
        # the job list does not have would only end at the timeout
        raise LaunchError(
            f"The provided job_addresses {jobs} has {len(jobs)} jobs, but num_processes is "
            f"{procs}: list one address per process (KERAS_DISTRIBUTION_JOB_ADDRESSES) or set "
            f"num_processes (KERAS_DISTRIBUTION_NUM_PROCESSES) to {len(jobs)}"
        )
    pid = _count(
        process_id if process_id is not None else env.get(KERAS_VARS[2]) or None,
        "process_id (KERAS_DISTRIBUTION_PROCESS_ID)",
        0,
    )
    if procs is not None and pid is not None and pid >= procs:
        raise LaunchError(f"process_id={pid} must be in 0..num_processes-1 ({procs} processes)")
    if address is None and procs is None and pid is None:
        return None
    return Launch(address, procs, pid)


def initialize(
    backend: Any = None,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    job_addresses: str | None = None,
    timeout: float = 300.0,
) -> tuple[int, int]:
    """Start the framework's distributed runtime from the launcher's environment, once.

    torch: ``init_process_group`` from torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
    ``MASTER_PORT``; JAX: ``jax.distributed.initialize`` from ``JAX_COORDINATOR_ADDRESS``/
    ``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, else JAX's own cluster detection (SLURM, Open
    MPI, Cloud TPU, Kubernetes), else one process; MLX: ``mx.distributed.init()``, checked
    against the process count the launcher (``mlx.launch``/``mpirun``) says it started. A
    second call returns the same answer.

    The launch parameters may also be given as ``jax.distributed.initialize`` and
    ``keras.distribution.initialize`` take them: ``coordinator_address`` ("host:port") or
    ``job_addresses`` (Keras's comma-separated list, the first the coordinator),
    ``num_processes``, ``process_id``; unset ones are read from Keras's
    ``KERAS_DISTRIBUTION_JOB_ADDRESSES``/``_NUM_PROCESSES``/``_PROCESS_ID``. They win over
    the launcher's variables (JAX, Keras on JAX, torch); MLX's launchers start the processes
    themselves and take none.

    With no ``backend``, the launcher found in the environment (:func:`detect_launcher`) says
    which framework to start, so nothing needs importing first; outside a launcher, the backend
    of the framework already imported runs as one process.

    Returns ``(this process's index, the number of processes)``. Raises
    :class:`~unimesh.LaunchError` naming a missing variable, or when peers do not join within
    ``timeout`` seconds.
    """
    seconds = _timeout(timeout, "timeout")
    launch = _launch(coordinator_address, job_addresses, num_processes, process_id, os.environ)
    be = _runtime_backend(backend)
    if launch is None:
        started: tuple[int, int] = be.initialize(seconds)
    else:
        import inspect

        if "launch" not in inspect.signature(be.initialize).parameters:
            raise UnsupportedError(
                f"the {be.name} backend's initialize takes no launch parameters (got {launch}); "
                "start its processes with its launcher instead",
                backend=be.name,
                capability="multi_process",
            )
        started = be.initialize(seconds, launch=launch)
    _STARTED[:] = [(be, started)]
    return started


#: the backend :func:`initialize` started in this process, and its answer (what a link between
#: two jobs reads to know this process's place in its job)
_STARTED: list[tuple[Any, tuple[int, int]]] = []


def started() -> tuple[Any, int, int] | None:
    """``(backend, this process's index, process count)`` of the runtime :func:`initialize`
    started in this process, or None before it ran."""
    if not _STARTED:
        return None
    be, (rank, world) = _STARTED[0]
    return be, rank, world


def fingerprint(mesh: Mesh, layout: Any = None) -> dict[str, Any]:
    """What :func:`verify` compares across processes: small, whatever the mesh's size."""
    import hashlib

    if not isinstance(mesh, Mesh):
        raise MeshMismatchError(f"verify() needs a unimesh.Mesh, got {short(mesh)}")
    ids = mesh.device_ids
    order = hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()[:16]
    out: dict[str, Any] = {
        "shape": list(mesh.shape),
        "axis_names": list(mesh.axis_names),
        "device_order": f"{short(ids.ravel().tolist(), 40)} (sha256 {order})",
        "axis_types": list(mesh.axis_types) if mesh.axis_types else None,
        "devices_per_process": mesh.devices_per_process,
        "layout": None,
    }
    if layout is not None:
        from .layout import Layout

        if not isinstance(layout, Layout):
            raise LayoutError(f"verify(layout=...) needs a unimesh.Layout, got {short(layout)}")
        if layout.mesh != mesh:
            raise LayoutError(f"the layout is on {layout.mesh!r}, not on {mesh!r}")
        out["layout"] = repr(layout.spec)
    return out


def _describe(prints: list[dict[str, Any]]) -> str:
    """Which processes differ from the largest group of agreeing ones, field by field."""
    import json

    groups: dict[str, list[int]] = {}
    for rank, fp in enumerate(prints):
        groups.setdefault(json.dumps(fp, sort_keys=True), []).append(rank)
    ordered = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    base = ordered[0]
    parts = []
    for ranks in ordered[1:]:
        diffs = [
            f"{field} {prints[ranks[0]][field]!r} where processes {_ranks(base)} have "
            f"{prints[base[0]][field]!r}"
            for field in FIELDS
            if prints[ranks[0]][field] != prints[base[0]][field]
        ]
        parts.append(f"processes {_ranks(ranks)} have " + "; ".join(diffs))
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return short(ranks, 60)


def verify(mesh: Mesh, backend: Any = None, *, layout: Any = None, timeout: float = 60.0) -> None:
    """Check, before any collective, that every process describes the same mesh (and layout).

    Every process contributes a fingerprint (shape, axis names, device order, axis types,
    process layout, layout spec) through the backend's own collective. On a disagreement
    every process raises :class:`~unimesh.MeshMismatchError` naming the processes that differ
    and how. A peer that is gone or stuck raises within ``timeout`` seconds instead of
    hanging (MLX, whose collectives cannot be interrupted, ends the process with a message).
    Also checks that the runtime has every device the mesh uses. Starts the runtime with
    :func:`initialize` if needed.
    """
    import json

    seconds = _timeout(timeout, "timeout")
    mine = fingerprint(mesh, layout)
    be = _runtime_backend(backend)
    need = int(mesh.device_ids.max()) + 1
    if be.framework not in sys.modules:
        # simulated devices are asked for before the framework starts (JAX's XLA_FLAGS)
        launcher = detect_launcher()
        be.request_devices(need, (launcher.processes if launcher else None) or 1)
    rank, world = be.initialize(seconds)
    payloads = be.exchange(json.dumps(mine, sort_keys=True).encode(), seconds)
    if len(payloads) != world:
        raise MeshMismatchError(
            f"the {be.name} backend exchanged {len(payloads)} fingerprints for {world} processes"
        )
    prints = [json.loads(p) for p in payloads]
    if any(p != mine for p in prints):
        raise MeshMismatchError(
            f"processes disagree about the mesh (this is process {rank} of {world}): "
            f"{_describe(prints)}. Build the mesh from the same spec on every process."
        )
    have = be.request_devices(need, world)
    if have < need:
        raise MeshMismatchError(
            f"{mesh!r} uses device {need - 1}, but the {be.name} runtime has {have} devices "
            f"over {world} processes; start the launcher with more processes (or, for CPU "
            "devices, ask for more before the framework starts)"
        )
