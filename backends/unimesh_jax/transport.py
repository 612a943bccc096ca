"""The JAX backend's array operations (:class:`JaxArrays`, ``jax.numpy``) and its reshard
transport (:class:`JaxTransport`): ``jax.device_put`` within a process, JAX's own collectives
(a jitted ``shard_map`` of ``ppermute``) between processes, XLA's compiled reshard where the
device list stays, DLPack to and from another framework. Keras's arrays are JAX's: Keras
returns this transport."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from unimesh import Layout
from unimesh.arrays import Arrays
from unimesh.transfer import same_blocks
from unimesh.transport import Transport

from .runtime import global_devices, import_jax
from .translate import JaxTranslator

__all__ = ["JAX_ARRAYS", "JaxArrays", "JaxTransport"]


class JaxArrays(Arrays):
    """``jax.numpy``'s array operations."""

    def asarray(self, value: Any) -> Any:
        return import_jax().numpy.asarray(value)

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        return import_jax().numpy.moveaxis(x, source, destination)

    def take(self, x: Any, index: list[int]) -> Any:
        return x[np.asarray(index)]

    def reduce(self, x: Any, op: str) -> Any:
        """``op`` over dim 0 in ``x``'s dtype."""
        return getattr(import_jax().numpy, op)(x, axis=0).astype(x.dtype)

    def zeros_like(self, x: Any) -> Any:
        return import_jax().numpy.zeros_like(x)

    def concatenate(self, parts: Sequence[Any], axis: int) -> Any:
        return import_jax().numpy.concatenate(list(parts), axis=axis)


#: the one instance (it holds nothing)
JAX_ARRAYS = JaxArrays()


class JaxTransport(Transport):
    """A reshard's pieces on JAX (logical device ids are positions in ``jax.devices()``)."""

    backend: JaxTranslator

    def processes(self, device_ids: Any) -> list[int]:
        """``jax.Device.process_index`` of each logical device."""
        devices = global_devices()
        return [int(devices[i].process_index) for i in device_ids]

    def exchange(self, sends: Any, counts: Any, dtype: Any) -> dict[int, Any]:
        """Between processes, on JAX's own collectives: each process's buffers for a peer are
        joined on its first device, the message sizes are shared (one small
        ``process_allgather``), and one jitted ``shard_map`` over the processes' first devices
        moves every message with ``ppermute``, one permutation per distance between sender
        and receiver (each padded to that distance's longest message; pairs without a
        message take no part)."""
        jax = import_jax()
        count = jax.process_count()
        if count == 1:
            return {}
        from jax.experimental import multihost_utils

        jnp = jax.numpy
        me = jax.process_index()
        devices = global_devices()
        lead = [next(d for d in devices if d.process_index == p) for p in range(count)]
        mine = lead[me]
        wide = jnp.dtype(dtype) == jnp.bool_  # the wire carries bytes for booleans
        packed = {}
        row = np.zeros(count, np.int64)
        for q, buffers in sends.items():
            flat = [jax.device_put(p, mine) for p in buffers]
            packed[q] = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
            if wide:
                packed[q] = packed[q].astype(jnp.uint8)
            row[q] = packed[q].size
        sizes = np.asarray(multihost_utils.process_allgather(row)).reshape(count, count)
        shifts = [
            s for s in range(1, count) if any(sizes[i, (i + s) % count] for i in range(count))
        ]
        if not shifts:
            return {q: jnp.zeros((0,), dtype) for q in counts}
        widths = [int(max(sizes[i, (i + s) % count] for i in range(count))) for s in shifts]
        perms = tuple(
            tuple((i, (i + s) % count) for i in range(count) if sizes[i, (i + s) % count])
            for s in shifts
        )
        mesh = jax.sharding.Mesh(np.array(lead), ("_process",))
        layout = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("_process"))
        wire = jnp.uint8 if wide else dtype
        inputs = []
        for s, width in zip(shifts, widths):
            message = packed.get((me + s) % count)
            if message is None:
                block = jnp.zeros((1, width), wire, device=mine)
            else:
                block = jnp.pad(message, (0, width - message.size))[None]
            inputs.append(jax.make_array_from_single_device_arrays((count, width), layout, [block]))
        outs = _permuter(mesh, perms)(*inputs)
        got = {}
        for s, out in zip(shifts, outs):
            src = (me - s) % count
            if src in counts:
                data = out.addressable_shards[0].data.reshape(-1)[: int(sizes[src, me])]
                got[src] = data.astype(jnp.bool_) if wide else data
        return got

    def native(
        self, array: Any, source: Layout | None, target: Layout, shape: tuple[int, ...]
    ) -> tuple[Any, dict[str, int] | None] | None:
        """One device list (the same devices in the same order): XLA's compiled reshard,
        ``jax.jit`` of the identity with the target as ``out_shardings`` (what ``jax.reshard``
        does inside ``jit``), never through the host. Its bytes are the plan's (None): what
        must move (XLA's SPMD partitioner moves more where it warns of a rematerialization).
        Another device list: None (the plan: device-to-device copies in one process, and
        :meth:`exchange` between processes). A tracer: JAX's differentiable moves to
        the target's ``NamedSharding``: eagerly (``grad`` outside ``jit``) ``jax.device_put``, whose
        cotangent goes back to the argument's sharding; under ``jit``
        ``with_sharding_constraint`` (XLA's reshard; the target must be on the jitted
        function's devices, JAX's own error otherwise). An object with ``__jax_array__`` (a
        Keras variable) is moved as the array it stands for."""
        jax = import_jax()
        if not isinstance(array, jax.Array) and hasattr(array, "__jax_array__"):
            array = array.__jax_array__()
        if source is None:
            if not isinstance(array, jax.core.Tracer):
                return None
            sharding = self.backend.layout_to_native(target)
            value = array
            while isinstance(value, jax.core.Tracer):  # an eager transform holds a value
                value = getattr(value, "primal", None)
            if isinstance(value, jax.Array):  # eager: the cotangent goes back to its devices
                return jax.device_put(array, sharding), {}
            return jax.lax.with_sharding_constraint(array, sharding), {}  # XLA's, under jit
        if same_blocks(source, target) and isinstance(array, jax.Array):
            return array, {}  # nothing moves: the array, as jax.device_put to its sharding
        if source.mesh.device_ids.ravel().tolist() != target.mesh.device_ids.ravel().tolist():
            return None  # the plan
        return _identity(self.backend.layout_to_native(target))(array), None

    def empty(self, dtype: Any, shape: tuple[int, ...], device_id: int | None = None) -> Any:
        """Zeros (JAX's arrays are immutable: the core joins the pieces instead)."""
        block = import_jax().numpy.zeros(shape, dtype=dtype)
        return block if device_id is None else self.take(block, device_id)

    def take(self, block: Any, device_id: int | None) -> Any:
        """A ``jax.Array`` onto the device with ``jax.device_put`` (device to device, never
        through the host; as it is where it is there already); another framework's block
        through ``jax.dlpack.from_dlpack`` first (shared memory where JAX can; a cast where
        JAX keeps another dtype: int64 without x64). ``device_id`` None: where it is."""
        jax = import_jax()
        if not isinstance(block, jax.Array):
            block = jax.dlpack.from_dlpack(block)
        if device_id is None:
            return block
        device = global_devices()[device_id]
        if block.devices() == {device}:
            return block
        return jax.device_put(block, device)


@functools.lru_cache(maxsize=64)
def _permuter(mesh: Any, perms: tuple[tuple[tuple[int, int], ...], ...]) -> Any:
    """The jitted ``shard_map`` over ``mesh`` (one device per process) applying one
    ``ppermute`` per permutation to its argument of the same position."""
    jax = import_jax()
    spec = jax.sharding.PartitionSpec("_process")

    def body(*rows: Any) -> Any:
        return tuple(jax.lax.ppermute(r, "_process", list(p)) for r, p in zip(rows, perms))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(perms),
                           out_specs=(spec,) * len(perms))  # fmt: skip
    return jax.jit(mapped)


@functools.lru_cache(maxsize=64)
def _identity(sharding: Any) -> Any:
    """The jitted identity whose output is laid out as ``sharding``."""
    return import_jax().jit(lambda a: a, out_shardings=sharding)
