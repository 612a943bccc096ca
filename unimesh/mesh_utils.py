"""``make_mesh``: a mesh built from axis sizes, as JAX's ``mesh_utils`` builds device meshes
(``create_device_mesh``; ``create_hybrid_device_mesh`` for the axes across processes, DCN,
around those inside one, ICI), and as MaxText and torchtitan infer one size of -1."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ._validate import MAX_DEVICES, check_int, check_size, fail
from .mesh import Mesh
from .mesh_input import resolve_sizes
from .messages import short

__all__ = ["make_mesh"]


def make_mesh(
    axes: Mapping[str, int],
    num_devices: int | None = None,
    *,
    devices_per_process: int | None = None,
    dcn_axes: Mapping[str, int] | None = None,
    axis_types: Sequence[str] | None = None,
) -> Mesh:
    """Build a mesh from ``{name: size}``.

    One size may be -1 and is inferred from ``num_devices`` (as MaxText and torchtitan allow).
    With ``dcn_axes`` (JAX ``create_hybrid_device_mesh``): ``axes`` is the part of the mesh inside
    one process and ``dcn_axes`` (name -> size, names from ``axes``) how processes tile it; axis i
    of the result has size ``axes[i] * dcn_axes.get(i, 1)``, each process's devices form one
    contiguous block, and ``devices_per_process`` is the product of ``axes``. One dcn size may be
    -1 (MaxText's ``dcn_data_parallelism: -1``): the number of processes is ``num_devices`` over
    the in-process product (or ``devices_per_process``), and the -1 axis takes what is left.
    """
    if not isinstance(axes, Mapping) or not axes:
        fail(f"make_mesh() takes a non-empty mapping axis name -> size, got {short(axes)}")
    if num_devices is not None:
        num_devices = check_int(num_devices, "num_devices", minimum=1)
    if dcn_axes is None:
        sizes = resolve_sizes(axes, num_devices, f"num_devices={num_devices}")
        return Mesh(
            tuple(sizes.values()),
            tuple(sizes),
            axis_types=axis_types,
            devices_per_process=devices_per_process,
        )
    if not isinstance(dcn_axes, Mapping):
        fail(f"dcn_axes must be a mapping axis name -> number of processes, got {short(dcn_axes)}")
    for n in dcn_axes:
        if n not in axes:
            fail(
                f"dcn axis {short(n)} is not one of the mesh axes {tuple(axes)}; dcn_axes must "
                "name axes of `axes`"
            )
    dcn_raw = {n: check_int(dcn_axes.get(n, 1), f"dcn size of axis {n!r}") for n in axes}
    if -1 in dcn_raw.values():
        # MaxText's dcn_*_parallelism: -1: the number of processes is num_devices over the
        # devices each process holds, and the -1 axis takes what the other dcn axes leave.
        if num_devices is None:
            fail(
                "a dcn axis of size -1 is inferred from num_devices; pass num_devices (e.g. "
                "len(jax.devices())) or give every dcn size"
            )
        if devices_per_process is not None:
            in_process = check_int(
                devices_per_process, "devices_per_process", minimum=1, maximum=MAX_DEVICES
            )
        elif -1 in axes.values():
            fail(
                "both axes and dcn_axes have a size -1, so the devices per process are "
                "unknown; pass devices_per_process (e.g. jax.local_device_count()) or give "
                "the in-process sizes"
            )
        else:
            in_process = math.prod(resolve_sizes(axes, None, "the in-process axes").values())
        if num_devices % in_process:
            fail(
                f"num_devices={num_devices} is not a multiple of the {in_process} devices each "
                "process holds, so the number of processes cannot be inferred"
            )
        procs = num_devices // in_process
        dcn = resolve_sizes(dcn_raw, procs, f"the {procs} processes")
    else:
        dcn = {n: check_int(v, f"dcn size of axis {n!r}", minimum=1) for n, v in dcn_raw.items()}
    n_proc = math.prod(dcn.values())
    per_proc_total = None
    if num_devices is not None:
        if num_devices % n_proc:
            fail(
                f"num_devices={num_devices} is not a multiple of the {n_proc} processes that "
                f"dcn_axes {dict(dcn_axes)} asks for"
            )
        per_proc_total = num_devices // n_proc
    ici = resolve_sizes(
        axes, per_proc_total, f"each of the {n_proc} processes (num_devices={num_devices})"
    )
    per_proc = math.prod(ici.values())
    if (
        devices_per_process is not None
        and check_int(devices_per_process, "devices_per_process", minimum=1) != per_proc
    ):
        fail(
            f"devices_per_process={devices_per_process} but axes {ici} put {per_proc} devices "
            "on each process; leave devices_per_process out or make them agree"
        )
    shape = tuple(ici[n] * dcn[n] for n in ici)
    check_size(shape)
    proc = np.arange(n_proc, dtype=np.int64).reshape(tuple(dcn.values())) * per_proc
    local = np.arange(per_proc, dtype=np.int64).reshape(tuple(ici.values()))
    nd = len(shape)
    grid = np.add.outer(proc, local)  # axes: dcn axes..., then in-process axes...
    interleave = [k for i in range(nd) for k in (i, nd + i)]
    ids = grid.transpose(interleave).reshape(shape)
    return Mesh(shape, tuple(ici), ids, axis_types=axis_types, devices_per_process=per_proc)
