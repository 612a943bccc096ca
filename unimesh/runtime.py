"""The distributed runtime: start it from the launcher's environment (:func:`initialize`) and
check that every process describes the same mesh (:func:`verify`) before a collective can hang
on a disagreement. Framework-free; each backend exchanges the bytes with its own collective."""

from __future__ import annotations

from typing import Any

from .errors import LayoutError, MeshMismatchError, UnimeshError
from .mesh import Mesh
from .messages import short

__all__ = ["fingerprint", "initialize", "verify"]

#: The fields compared by :func:`verify`, in the order a mismatch message names them.
FIELDS = ("shape", "axis_names", "device_order", "axis_types", "devices_per_process", "layout")


def _timeout(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UnimeshError(f"{what} must be a number of seconds > 0, got {short(value)}")
    return float(value)


def initialize(backend: Any = None, *, timeout: float = 300.0) -> tuple[int, int]:
    """Start the framework's distributed runtime from the launcher's environment, once.

    torch: ``init_process_group`` from torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
    ``MASTER_PORT``; JAX: ``jax.distributed.initialize`` from ``JAX_COORDINATOR_ADDRESS``/
    ``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID`` (none of them: one process); MLX:
    ``mx.distributed.init()``, checked against the process count the launcher
    (``mlx.launch``/``mpirun``) says it started. A second call returns the same answer.

    Returns ``(this process's index, the number of processes)``. Raises
    :class:`~unimesh.LaunchError` naming a missing variable, or when peers do not join within
    ``timeout`` seconds.
    """
    from .registry import get_backend

    return get_backend(backend).initialize(_timeout(timeout, "timeout"))


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

    from .registry import get_backend

    seconds = _timeout(timeout, "timeout")
    mine = fingerprint(mesh, layout)
    be = get_backend(backend)
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
    need = int(mesh.device_ids.max()) + 1
    have = be.request_devices(need, world)
    if have < need:
        raise MeshMismatchError(
            f"{mesh!r} uses device {need - 1}, but the {be.name} runtime has {have} devices "
            f"over {world} processes; start the launcher with more processes (or, for CPU "
            "devices, ask for more before the framework starts)"
        )
