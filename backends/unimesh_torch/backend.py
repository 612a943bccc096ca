"""The torch backend: neutral Mesh <-> ``DeviceMesh``, Layout <-> DTensor placements.

torch is imported inside the methods, never at module import. Device ids are torch ranks (one
device per process). The meaning of every object comes from the core; this module translates and
refuses, with :class:`unimesh.UnsupportedError`, what DTensor would silently do differently.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar, NamedTuple

import numpy as np

from unimesh import (
    ConversionError,
    LaunchError,
    Layout,
    Mesh,
    MeshMismatchError,
    Partial,
    Replicate,
    Shard,
    StridedShard,
    UnsupportedError,
)
from unimesh._validate import first_line, short
from unimesh.spmd import ProcessBackend

__all__ = ["TorchBackend", "TorchLayout", "axis_mesh"]

_REDUCE_OPS = ("sum", "avg", "max", "min")


class TorchLayout(NamedTuple):
    """A layout in torch's terms: the DeviceMesh, one DTensor placement per mesh dim, and the
    number of tensor dims the spec covers."""

    device_mesh: Any
    placements: tuple[Any, ...]
    ndim: int


def _torch() -> Any:
    import torch

    return torch


def _gather_texts(text: str, device: str) -> list[str]:
    """Every rank's ``text``, by fixed-size ``all_gather`` calls (gloo can abort at exit after
    ``all_gather_object``, so the byte strings travel padded to the longest one)."""
    torch, dist = _torch(), _dist()
    world = dist.get_world_size()
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(t.item()) for t in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [bytes(t[: int(n.item())].tolist()).decode() for t, n in zip(every, sizes)]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


_BROKEN = {"peer_gone": False}


def _finish_process_group() -> None:
    """At exit, for a process group this backend started: leave together, then destroy it (a
    rank gone early can make gloo abort the others). After a peer was found gone, no barrier:
    it would wait for that peer until the group's timeout."""
    dist = _dist()
    if dist.is_initialized():
        if not _BROKEN["peer_gone"]:
            dist.barrier()
        dist.destroy_process_group()


def _plain(mesh: Mesh) -> Mesh:
    """The mesh as torch can hold it: no axis types, no process layout (ranks are devices)."""
    if mesh.axis_types is None and mesh.devices_per_process is None:
        return mesh
    return Mesh(mesh.shape, mesh.axis_names, mesh.device_ids)


def _non_increasing_axes(mesh: Mesh, axes: tuple[str, ...]) -> list[str]:
    """Axes along which some group's ranks are not increasing."""
    bad = []
    for ax in axes:
        groups = mesh.groups_array(ax)
        if groups.shape[1] > 1 and not bool(np.all(np.diff(groups, axis=1) > 0)):
            bad.append(ax)
    return bad


class TorchBackend(ProcessBackend):
    """PyTorch: ``DeviceMesh`` and DTensor placements (torch >= 2.6)."""

    name = "torch"
    launcher_name = "torchrun, gloo"
    framework = "torch"
    extra = "torch"
    native_modules = ("torch", "unimesh_torch")
    capabilities = frozenset(
        {
            "mesh",
            "layout",
            "distribute",
            "uneven_shards",
            "tuple_axes",
            "partial",
            "axis_groups",
            "multi_process",
            "shard_map",
            "grad",
        }
    )
    native_primitives = frozenset(
        {
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "permute",
            "broadcast",
            "split",
        }
    )
    typed = True  # TorchFunctionMode sees every operation: JAX's check_vma gradient rules
    native_api: ClassVar[dict[str, str]] = {
        "mesh": "torch.distributed.device_mesh.DeviceMesh",
        "layout": "DTensor placements: Shard(d), Replicate(), Partial(op), _StridedShard",
        "distribute": "torch.distributed.tensor.distribute_tensor",
        "axis_group": "DeviceMesh.get_group(axis)",
        "shard_map": "DTensor.to_local / DTensor.from_local around the function",
        "psum": "_functional_collectives.all_reduce(x, 'sum', group)",
        "all_gather": "_functional_collectives.all_gather_single (reordered to coordinates)",
        "axis_index": "the rank's mesh coordinate (like DeviceMesh.get_local_rank(axis))",
        "shard_params": "nn.Parameter(distribute_tensor(param, mesh, placements))",
        "launch": "torchrun --standalone --nproc-per-node N (gloo)",
    }

    def __init__(self) -> None:
        # DeviceMeshes built in this process under the current world group:
        # (device type, mesh) -> DeviceMesh. Sub-meshes are sliced from these, so that no
        # rank-dependent group is ever created. A new world group empties it.
        self._meshes: dict[tuple[str, Mesh], Any] = {}
        self._world_group: Any = None
        # (layout, global shape, dtype) -> DTensorSpec of shard_map results (wrap_result)
        self._specs: dict[tuple[Layout, tuple[int, ...], Any], Any] = {}

    # -- the runtime -------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        dist = _dist()
        if not dist.is_available() or not dist.is_initialized():
            raise MeshMismatchError(
                "torch.distributed is not initialized: run under torchrun and call "
                "unimesh.initialize() (or torch.distributed.init_process_group) before "
                "converting a mesh to torch"
            )
        return dist.get_rank(), dist.get_world_size()

    def _device_type(self, device_type: str | None) -> str:
        if device_type is not None:
            if not isinstance(device_type, str) or not device_type:
                raise UnsupportedError(
                    f"device_type must be a str like 'cpu' or 'cuda', got {short(device_type)}",
                    backend=self.name,
                )
            return device_type
        torch, dist = _torch(), _dist()
        pg_backend = str(dist.get_backend()).lower()
        if "nccl" in pg_backend and torch.cuda.is_available():
            return "cuda"
        return "cpu"

    def _agree(self, mesh: Mesh) -> None:
        """Before a collective group creation: every rank must be building the same mesh, or
        torch would hang. Raise MeshMismatchError on every rank instead (skipped under the fake
        process group, whose collectives carry no data)."""
        dist = _dist()
        if str(dist.get_backend()).lower() == "fake" or dist.get_world_size() == 1:
            return
        import hashlib

        torch = _torch()
        text = mesh.to_string()
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
        device = "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        if all(int(t.item()) == digest for t in every):
            return
        seen = _gather_texts(text, device)  # only now: to say how they differ
        rank = dist.get_rank()
        other = next(r for r, s in enumerate(seen) if s != text)
        raise MeshMismatchError(
            f"ranks disagree about the mesh to build: rank {rank} has {text!r}, rank {other} "
            f"has {seen[other]!r}. A DeviceMesh is created by every rank together; to get a "
            "rank's own submesh, convert the whole mesh first and then its submesh "
            "(unimesh_torch.axis_mesh(mesh, axes))"
        )

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]]:
        """torchrun (``python -m torch.distributed.run --standalone``), gloo over loopback."""
        import os
        import sys

        return (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={processes}",
            ],
            {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")},
        )

    def native_code(self, mesh: Mesh) -> str:
        """``DeviceMesh("cpu", ids, mesh_dim_names=...)``, run by every rank."""
        return (
            "import torch\nfrom torch.distributed.device_mesh import DeviceMesh\n\n"
            "# every rank runs this, after torch.distributed.init_process_group\n"
            f'mesh = DeviceMesh("cpu", torch.tensor({mesh.device_ids.tolist()}), '
            f"mesh_dim_names={tuple(mesh.axis_names)})"
        )

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """DTensor matmul with a replicated weight, then ``full_tensor()``."""
        torch = _torch()
        from torch.distributed.tensor import Replicate, distribute_tensor

        device_mesh = array.device_mesh
        w = distribute_tensor(
            torch.from_numpy(weight), device_mesh, [Replicate()] * device_mesh.ndim
        )
        return (array @ w).full_tensor().numpy()

    def initialize(self, timeout: float) -> tuple[int, int]:
        """``init_process_group`` (gloo; gloo + nccl when CUDA is there) from the launcher's
        ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, every rank joining within
        ``timeout`` seconds. A process group already started (by the user or torchrun code) is
        used as it is."""
        import os
        from datetime import timedelta

        dist = _dist()
        if not dist.is_initialized():
            needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            missing = [v for v in needed if v not in os.environ]
            if missing:
                raise LaunchError(
                    f"the torch backend needs a process group, and the launcher's "
                    f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: run "
                    "under torchrun (torchrun --standalone --nproc-per-node 4 script.py), or "
                    f"set {', '.join(needed)}"
                )
            kind = "cpu:gloo,cuda:nccl" if _torch().cuda.is_available() else "gloo"
            try:
                dist.init_process_group(kind, timeout=timedelta(seconds=timeout))
            except (RuntimeError, ValueError) as exc:
                first = first_line(exc)
                raise LaunchError(
                    f"torch.distributed.init_process_group({kind!r}) failed for RANK="
                    f"{os.environ['RANK']} of WORLD_SIZE={os.environ['WORLD_SIZE']} at "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within "
                    f"{timeout:.0f} s (a peer process may be gone): {first}"
                ) from exc
            import atexit

            atexit.register(_finish_process_group)
        return int(dist.get_rank()), int(dist.get_world_size())

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """A gloo ``monitored_barrier`` first (a rank that is gone or stuck is reported within
        ``timeout`` instead of hanging), then fixed-size ``all_gather`` calls."""
        from datetime import timedelta

        dist = _dist()
        rank, world = self.initialize(timeout)
        if world == 1 or str(dist.get_backend()).lower() == "fake":
            return [payload] * world
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
            texts = _gather_texts(payload.hex(), "cpu")
        except (RuntimeError, dist.DistError) as exc:
            _BROKEN["peer_gone"] = True
            raise MeshMismatchError(
                f"rank {rank} of {world}: a peer process is gone or stuck (it did not take part "
                f"in the check within {timeout:.0f} s): {first_line(exc)}"
            ) from exc
        return [bytes.fromhex(t) for t in texts]

    def prepare_devices(self, count: int) -> int:
        """The world size: under a launcher (torchrun sets RANK/WORLD_SIZE) the gloo process
        group is started if it is not (:meth:`initialize`); with no launcher and no process
        group, a :class:`~unimesh.LaunchError` that names the launcher. ``count`` cannot change
        it: the launcher decides."""
        return self.initialize(1800.0)[1]

    # -- meshes --------------------------------------------------------------------------------
    def mesh_to_native(self, mesh: Mesh, *, device_type: str | None = None, **options: Any) -> Any:
        """A ``DeviceMesh`` over the ranks in ``mesh.device_ids``.

        A mesh already converted in this process is returned again. A submesh (or a flattened
        axis) of one that contains this rank is sliced from it with torch's own slicing, which
        creates no process group; any other mesh is built anew, which every rank must do with
        the same mesh (checked, so a disagreement is an error, not a hang).
        """
        self.reject_options(options, "device_type")
        rank, world = self._world()
        top = mesh.size - 1 if mesh.is_default_order else int(mesh.device_ids.max())
        if top >= world:
            raise MeshMismatchError(
                f"{mesh!r} uses rank {top}, but the torch world has {world} ranks "
                f"(0..{world - 1}); start at least {top + 1} processes "
                f"(torchrun --nproc-per-node {top + 1}) or use a smaller mesh"
            )
        dtype = self._device_type(device_type)
        world_group = _dist().group.WORLD
        if world_group is not self._world_group:
            self._meshes.clear()
            self._world_group = world_group
        plain = _plain(mesh)
        key = (dtype, plain)
        if key in self._meshes:
            return self._meshes[key]
        native = self._slice(plain, rank, dtype)
        if native is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._agree(plain)
            ids = _torch().from_numpy(plain.device_ids.astype(np.int32))
            native = DeviceMesh(dtype, ids, mesh_dim_names=plain.axis_names)
        self._meshes[key] = native
        return native

    def _slice(self, target: Mesh, rank: int, dtype: str) -> Any:
        """Slice ``target`` from a DeviceMesh built earlier, or None when it is no submesh (or
        flattened submesh) of one. The decision does not depend on the rank, so every rank
        takes the same path: members slice, non-members get an error, nobody waits."""
        anchor = int(target.device_ids.flat[0])
        for (d, root), native in list(self._meshes.items()):
            if d != dtype or root.size <= target.size:
                continue
            names = target.axis_names
            axes: tuple[str, ...] | None = None
            flat_name = None
            if set(names) < set(root.axis_names) and anchor in root.device_ids:
                if root.submesh(names, containing=anchor) == target:
                    axes = names
            elif target.ndim == 1 and names[0] not in root.axis_names:
                axes = self._flattened_axes(root, target, anchor)
                flat_name = names[0]
            if axes is None:
                continue
            if rank not in target.device_ids:
                raise MeshMismatchError(
                    f"rank {rank} is not in {target!r}, a submesh of {root!r}: each rank converts "
                    "the submeshes that contain it (mesh.submesh(axes, containing=rank))"
                )
            return self._checked(native, axes, flat_name, target, root)
        return None

    @staticmethod
    def _flattened_axes(root: Mesh, target: Mesh, anchor: int) -> tuple[str, ...] | None:
        """The axes of ``root`` (in some order) whose flattening, at the submesh holding
        ``anchor``, is ``target``; None if there are none."""
        if anchor not in root.device_ids:
            return None
        name = target.axis_names[0]
        for k in range(2, root.ndim + 1):
            for axes in itertools.permutations(root.axis_names, k):
                if math.prod(root.axis_size(a) for a in axes) != target.size:
                    continue
                if root.flatten(axes, name).submesh(name, containing=anchor) == target:
                    return axes
        return None

    def _checked(
        self, native: Any, axes: tuple[str, ...], flat_name: str | None, target: Mesh, root: Mesh
    ) -> Any:
        torch = _torch()
        order = [root.axis_names.index(a) for a in axes]
        if order != sorted(order):
            raise UnsupportedError(
                f"torch {torch.__version__} slices a DeviceMesh only with axes in mesh order; "
                f"{target!r} takes {axes} of {root!r} in another order. Use "
                f"{tuple(sorted(axes, key=root.axis_names.index))} (or transpose the whole mesh "
                "first and convert that)",
                backend=self.name,
                capability="mesh",
            )
        sub = native[axes]
        if flat_name is not None:
            if not hasattr(sub, "_flatten"):  # pragma: no cover - torch < 2.6
                raise UnsupportedError(
                    f"torch {torch.__version__} cannot flatten mesh dims",
                    backend=self.name,
                    capability="mesh",
                )
            sub = sub._flatten(flat_name)
        got = self.mesh_from_native(sub)
        if got != target:  # pragma: no cover - would be a torch change; never hand it out
            raise MeshMismatchError(f"torch sliced {got!r} where unimesh expects {target!r}")
        return sub

    def mesh_from_native(self, device_mesh: Any) -> Mesh:
        names = device_mesh.mesh_dim_names or tuple(
            f"dim_{i}" for i in range(device_mesh.mesh.ndim)
        )
        ids = device_mesh.mesh.detach().cpu().numpy()
        return Mesh(ids.shape, tuple(names), ids)

    # -- layouts -------------------------------------------------------------------------------
    def _check_order(self, layout: Layout) -> None:
        bad = _non_increasing_axes(layout.mesh, layout.spec.axes())
        if bad:
            raise UnsupportedError(
                f"{layout!r} shards over axis {bad[0]!r}, along which the device order is not "
                "increasing. DTensor puts shard k on the k-th rank of the axis's process group, "
                "and torch orders a group's ranks by global rank, not by mesh coordinate; the "
                "shards would silently differ from the reference. Use a device order that "
                "increases along the sharded axes, or replicate over that axis",
                backend=self.name,
                capability="layout",
            )

    def layout_to_native(
        self, layout: Layout, *, device_type: str | None = None, **options: Any
    ) -> TorchLayout:
        """``TorchLayout(device_mesh, placements, ndim)``: the DTensor placements of the
        layout (``Shard``, ``_StridedShard``, ``Replicate``, ``Partial``)."""
        self._check_order(layout)
        native_mesh = self.mesh_to_native(layout.mesh, device_type=device_type, **options)
        return TorchLayout(
            native_mesh, tuple(_to_torch(p) for p in layout.placements()), len(layout.spec)
        )

    def from_native(self, obj: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(obj, DeviceMesh):
            return self.mesh_from_native(obj)
        if isinstance(obj, TorchLayout):
            return Layout.from_placements(
                self.mesh_from_native(obj.device_mesh),
                [_from_torch(p) for p in obj.placements],
                obj.ndim,
            )
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            return Layout.from_placements(
                self.mesh_from_native(obj.device_mesh),
                [_from_torch(p) for p in obj.placements],
                obj.ndim,
            )
        raise ConversionError(
            f"the torch backend converts DeviceMesh, DTensor and TorchLayout, not {short(obj)} "
            f"({type(obj).__module__}.{type(obj).__qualname__})"
        )

    def distribute(
        self,
        array: Any,
        layout: Layout,
        *,
        device_type: str | None = None,
        src_data_rank: int | None = 0,
        **options: Any,
    ) -> Any:
        """A DTensor (``torch.distributed.tensor.distribute_tensor``) whose local tensor on each
        rank is the reference block ``layout.shard_slices(shape, rank)``."""
        torch = _torch()
        if not torch.is_tensor(array):
            array = torch.as_tensor(np.asarray(array))
        if layout.spec.partial:
            raise UnsupportedError(
                f"distribute() of a partial layout {layout.spec!r}: DTensor builds pending "
                "reductions only from computations; distribute the replicated value and "
                "compute the partial result",
                backend=self.name,
                capability="partial",
            )
        shape = tuple(array.shape)
        for _d, p in enumerate(layout.placements()):
            if isinstance(p, StridedShard):
                entry = layout.spec[p.dim]
                assert isinstance(entry, tuple)
                parts = math.prod(layout.mesh.axis_size(a) for a in entry)
                if shape[p.dim] % parts:
                    raise UnsupportedError(
                        f"tensor dim {p.dim} of size {shape[p.dim]} is split over {entry} (not in "
                        f"mesh order) into {parts} uneven parts: torch's _StridedShard does not "
                        "give the reference blocks there (its offsets overlap). Pad the dim to a "
                        f"multiple of {parts}, or list the axes in mesh order",
                        backend=self.name,
                        capability="uneven_shards",
                    )
        native = self.layout_to_native(layout, device_type=device_type, **options)
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            array, native.device_mesh, list(native.placements), src_data_rank=src_data_rank
        )

    def axis_groups(self, native_mesh: Any, axis: str) -> dict[int, tuple[int, ...]]:
        """``{rank: ranks of the process group along axis}`` (torch's order: by global rank)."""
        if native_mesh.get_coordinate() is None:
            return {}
        group = native_mesh.get_group(axis)
        return {_dist().get_rank(): tuple(_dist().get_process_group_ranks(group))}

    def local_shards(self, array: Any) -> dict[int, Any]:
        """``{rank: numpy block}``: this rank's local tensor of a DTensor (empty when the rank
        is outside its mesh)."""
        if array.device_mesh.get_coordinate() is None:
            return {}
        return {_dist().get_rank(): array.to_local().detach().cpu().numpy()}

    # -- programs: the core's per-process engine on gloo/NCCL process groups -----------------------
    def process_index(self) -> int:
        return int(_dist().get_rank())

    def world_group(self) -> Any:
        return _TorchGroup(_dist().group.WORLD, tuple(range(_dist().get_world_size())))

    def group_cache_key(self) -> Any:
        return _dist().group.WORLD

    def split_group(self, mesh: Mesh, axes: tuple[str, ...], rows: np.ndarray, row: int) -> Any:
        """The DeviceMesh's own group along ``axes`` (``get_group``; for several axes the
        group of the dims flattened with ``_flatten``), so torch makes and names it as for
        any DeviceMesh."""
        device_mesh = self.mesh_to_native(mesh)
        ordered = tuple(sorted(axes, key=mesh.axis_names.index))
        if len(ordered) == 1:
            pg = device_mesh.get_group(ordered[0])
        else:
            pg = device_mesh[ordered]._flatten("unimesh_" + "_".join(ordered)).get_group()
        return _TorchGroup(pg, tuple(int(m) for m in rows[row]))

    def group_all_reduce(self, x: Any, group: Any, op: str) -> Any:
        dist = _dist()
        out = x.detach().clone(memory_format=_torch().contiguous_format)
        dist.all_reduce(out, op=_OPS[op](), group=group.pg)
        return out

    def group_all_gather(self, x: Any, group: Any) -> Any:
        torch = _torch()
        flat = x.detach().contiguous().reshape(-1)  # gloo gathers into one flat buffer
        out = torch.empty(group.size * flat.numel(), dtype=x.dtype, device=x.device)
        dist = _dist()  # all_gather_into_tensor is deprecated from torch 2.13 on
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, flat, group=group.pg)
        out = out.reshape((group.size,) + tuple(x.shape))
        return out if group.order is None else out[group.order]

    def group_reduce_scatter(self, x: Any, group: Any) -> Any:
        torch = _torch()
        x = x.detach()
        if group.inverse is not None:
            x = x[group.inverse]
        flat = x.contiguous().reshape(-1)
        out = torch.empty(flat.numel() // group.size, dtype=x.dtype, device=x.device)
        dist = _dist()  # reduce_scatter_tensor is deprecated from torch 2.13 on
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(
            out, flat, group=group.pg
        )
        return out.reshape(tuple(x.shape[1:]))

    def group_all_to_all(self, x: Any, group: Any) -> Any:
        torch = _torch()
        x = x.detach()
        if group.inverse is not None:
            x = x[group.inverse]
        x = x.contiguous()
        out = torch.empty_like(x)
        _dist().all_to_all_single(out, x, group=group.pg)
        return out if group.order is None else out[group.order]

    def group_permute(self, x: Any, group: Any, sources: tuple[int | None, ...]) -> Any:
        """Point to point: ``x`` sent to the member that takes it, the source's received
        (``batch_isend_irecv``; only the pairs of the permutation talk)."""
        torch = _torch()
        dist = _dist()
        me = group.members.index(group.rank)
        dest = next((i for i, s in enumerate(sources) if s == me), None)
        src = sources[me]
        if src == me:
            return x.detach().clone()
        ops = []
        if dest is not None:
            ops.append(
                dist.P2POp(dist.isend, x.detach().contiguous(), group.members[dest], group.pg)
            )
        out = (
            torch.empty_like(x, memory_format=torch.contiguous_format)
            if src is not None
            else torch.zeros_like(x)
        )
        if src is not None:
            ops.append(dist.P2POp(dist.irecv, out, group.members[src], group.pg))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        return out

    def group_broadcast(self, x: Any, group: Any, root: int) -> Any:
        out = x.detach().clone(memory_format=_torch().contiguous_format)
        _dist().broadcast(out, src=group.members[root], group=group.pg)
        return out

    def as_array(self, value: Any) -> Any:
        torch = _torch()
        return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)

    def moveaxis(self, x: Any, source: int, destination: int) -> Any:
        return _torch().movedim(x, source, destination)

    def take(self, x: Any, index: list[int]) -> Any:
        return x[index]

    def reduce_stack(self, x: Any, op: str) -> Any:
        return x.sum(0) if op == "sum" else x.amax(0) if op == "max" else x.amin(0)

    def zeros_like(self, x: Any) -> Any:
        return _torch().zeros_like(x)

    def to_host(self, x: Any) -> np.ndarray:
        return x.detach().cpu().numpy()  # type: ignore[no-any-return]

    def needs_grad(self, x: Any) -> bool:
        return bool(x.requires_grad) and _torch().is_grad_enabled()

    def typing(self, env: Any) -> Any:
        """A ``TorchFunctionMode`` that tags every result with the union of its arguments'
        axes of variation and passes a gradient-carrying argument that lacks some of them
        through ``env.pvary`` (JAX inserts the same pvary)."""
        return _vma_mode()(env)

    def vma_of(self, x: Any) -> frozenset[str]:
        return getattr(x, _VMA, _NONE)

    def tag(self, x: Any, vma: frozenset[str]) -> Any:
        setattr(x, _VMA, vma)
        return x

    def untyped(self, fn: Any, x: Any) -> Any:
        with _torch()._C.DisableTorchFunction():
            return fn(x)

    def custom_vjp(self, fwd: Any, bwd: Any) -> Any:
        function = _vjp_function()
        return lambda x: function.apply(x, fwd, bwd)

    def local_block(self, arg: Any, layout: Layout, device: int) -> tuple[Any, bool]:
        """A DTensor's local tensor (redistributed to ``layout`` first when it is laid out
        otherwise), or a global tensor (numpy and lists become tensors) for the engine to cut."""
        torch = _torch()
        from torch.distributed.tensor import DTensor

        if isinstance(arg, DTensor):
            native = self._native_layout(layout)
            if (
                arg.device_mesh is native.device_mesh and tuple(arg.placements) == native.placements
            ):  # the usual case, no conversions
                leaf = getattr(arg, _LEAF, None)
                if leaf is not None:  # a parameter value_and_grad differentiates
                    return leaf, False
                if arg.requires_grad and torch.is_grad_enabled():
                    return arg.to_local(), False
                local = arg._local_tensor  # what to_local() gives without autograd, as a new
                return local.view_as(local), False  # object (the engine tags it)
            have = self.from_native(arg)
            if have.mesh != layout.mesh:
                raise ConversionError(
                    f"a shard_map argument is a DTensor on {have.mesh!r}, not "
                    f"on the shard_map's {layout.mesh!r}"
                )
            if have != layout:
                arg = arg.redistribute(native.device_mesh, list(native.placements))
            return arg.to_local(), False
        if not torch.is_tensor(arg):
            arg = torch.as_tensor(np.asarray(arg))
        return arg, True

    def wrap_result(self, block: Any, layout: Layout, shape: tuple[int, ...]) -> Any:
        """A DTensor of the layout's placements and the global shape: what
        ``DTensor.from_local(block, ..., run_check=False, shape=..., stride=...)`` makes, with
        its spec built once per (layout, shape, dtype) instead of per call."""
        torch = _torch()

        native = self._native_layout(layout)  # a new world empties the spec cache too
        key = (layout, shape, block.dtype)
        spec = self._specs.get(key)
        if spec is None:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

            stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
            spec = self._specs[key] = DTensorSpec(
                native.device_mesh,
                tuple(native.placements),
                tensor_meta=TensorMeta(torch.Size(shape), stride, block.dtype),
            )
        if block.requires_grad and torch.is_grad_enabled():
            out = _from_local_function().apply(block, spec)
        else:
            out = _dtensor(block.view_as(block), spec, requires_grad=False)
        setattr(out, _BLOCK, block)
        return out

    def _native_layout(self, layout: Layout) -> TorchLayout:
        cache: dict[Layout, TorchLayout] = self.__dict__.setdefault("_native_layouts", {})
        if self._world_group is not _dist().group.WORLD:  # a new world: rebuild everything
            cache.clear()
            self._specs.clear()
        native = cache.get(layout)
        if native is None:  # layout_to_native records the world it was built in
            native = cache[layout] = self.layout_to_native(layout)
        return native

    def prepare_program(self, mesh: Mesh, layouts: tuple[Layout, ...]) -> None:
        """The DeviceMesh and placements of every in/out layout, built by every rank together
        before the first run (DTensor needs them; building one is collective)."""
        for layout in layouts:
            self._check_order(layout)
        for layout in layouts:
            self._native_layout(layout)

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Any:
        """torch autograd: the differentiated leaves are detached copies that require grad;
        ``torch.autograd.grad`` of the scalar value gives their gradients (DTensors for DTensor
        arguments).

        A DTensor leaf also carries a plain tensor leaf for its local block, which shard_map
        takes as the block (no ``to_local``/``from_local`` round trip through autograd); its
        gradient is added to whatever reaches the DTensor itself through DTensor operations.
        """
        import optree

        torch = _torch()
        from torch.distributed.tensor import DTensor

        def fresh_leaf(leaf: Any) -> tuple[Any, Any]:
            """(the copy the function gets, its block leaf or None)."""
            if isinstance(leaf, DTensor):
                local = leaf._local_tensor.detach()
                copy = _dtensor(local, leaf._spec, requires_grad=True)
                block = local.view_as(local).requires_grad_(True)
                setattr(copy, _LEAF, block)
                return copy, block
            return leaf.detach().requires_grad_(True), None

        def run(*given: Any) -> Any:
            args = list(given)
            leaves: list[Any] = []
            trees = []
            for i in argnums:
                flat, treedef = optree.tree_flatten(args[i])
                fresh = [
                    fresh_leaf(leaf)
                    if torch.is_tensor(leaf) and (leaf.is_floating_point() or leaf.is_complex())
                    else (leaf, False)
                    for leaf in flat
                ]
                trees.append((treedef, fresh))
                for copy, block in fresh:
                    if block is not False:
                        leaves += [copy] if block is None else [copy, block]
                args[i] = optree.tree_unflatten(treedef, [copy for copy, _ in fresh])
            with torch.enable_grad():
                out = fn(*args)
                value, aux = out if has_aux else (out, None)
                scalar = value
                if isinstance(value, DTensor):
                    if any(not p.is_replicate() for p in value.placements):
                        scalar = value.full_tensor()
                    else:  # a shard_map result: its block, else the local tensor
                        scalar = getattr(value, _BLOCK, None)
                        scalar = value.to_local() if scalar is None else scalar
                if not torch.is_tensor(scalar) or scalar.numel() != 1:
                    raise ConversionError(
                        f"value_and_grad needs {getattr(fn, '__name__', 'fn')} to return a "
                        f"scalar, got {short(value)}"
                    )
                found = torch.autograd.grad(scalar.reshape(()), leaves, allow_unused=True)
            by_id = {id(leaf): g for leaf, g in zip(leaves, found)}

            def grad_of(copy: Any, block: Any) -> Any:
                if block is False:
                    return None
                whole = by_id.get(id(copy))
                if block is not None and by_id.get(id(block)) is not None:
                    local = by_id[id(block)]
                    if local.dtype != copy.dtype:  # pragma: no cover - autograd keeps dtypes
                        local = local.to(copy.dtype)
                    part = _dtensor(local, copy._spec, requires_grad=False)
                    whole = part if whole is None else whole + part
                return torch.zeros_like(copy) if whole is None else whole

            grads = tuple(
                optree.tree_unflatten(treedef, [grad_of(c, b) for c, b in fresh])
                for treedef, fresh in trees
            )
            value = value.detach()
            return ((value, aux) if has_aux else value), grads

        return run

    def full_array(self, array: Any) -> Any:
        """numpy of a DTensor's whole value (``full_tensor()``, a collective) or of a tensor."""
        from torch.distributed.tensor import DTensor

        if isinstance(array, DTensor):
            array = array.full_tensor()
        return array.detach().cpu().numpy()

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """Every parameter of an ``nn.Module`` becomes a DTensor parameter laid out as
        ``resolve(name, shape)`` says (names from ``named_parameters``; tied parameters stay
        tied). In place; returns the module."""
        torch = _torch()
        if not isinstance(model, torch.nn.Module):
            raise ConversionError(
                f"the torch backend shards the parameters of an nn.Module, not {short(model)}"
            )
        new: dict[int, Any] = {}
        for path, param in model.named_parameters():
            layout = resolve(path, tuple(param.shape))
            placed = self.distribute(param.detach(), layout)
            new[id(param)] = torch.nn.Parameter(placed, requires_grad=param.requires_grad)
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) in new:
                    module.register_parameter(name, new[id(param)])
        return model


class _TorchGroup:
    """A process group with its members in the neutral order. torch has its own order of a
    group's ranks (by global rank), so ``order`` / ``inverse`` re-index the pieces when the
    two differ."""

    __slots__ = ("inverse", "members", "order", "pg", "rank", "ranks", "size")

    def __init__(self, pg: Any, members: tuple[int, ...]) -> None:
        self.pg = pg
        self.members = members
        self.size = len(members)
        self.ranks = tuple(int(r) for r in _dist().get_process_group_ranks(pg))
        if sorted(self.ranks) != sorted(members):  # pragma: no cover - a torch change
            raise MeshMismatchError(
                f"torch's group has ranks {self.ranks}, unimesh expects {members}"
            )
        self.rank = int(_dist().get_rank())
        if self.ranks == members:
            self.order: list[int] | None = None
            self.inverse: list[int] | None = None
        else:  # piece k in torch's order is member ranks[k]
            self.order = [self.ranks.index(m) for m in members]
            self.inverse = [members.index(r) for r in self.ranks]


_VMA = "_unimesh_vma"
_LEAF = "_unimesh_leaf"  # on a DTensor value_and_grad made: the plain leaf of its local block
_BLOCK = "_unimesh_block"  # on a shard_map result: the block it was made from
_NONE: frozenset[str] = frozenset()
_MODE: list[Any] = []


def _vma_mode() -> Any:
    """The TorchFunctionMode class of :meth:`TorchBackend.typing` (made once, on first use)."""
    if _MODE:
        return _MODE[0]
    torch = _torch()
    from torch.overrides import TorchFunctionMode

    tensor = torch.Tensor
    grad_enabled = torch.is_grad_enabled

    def scan(values: Any, acc: list[Any]) -> None:
        """Into ``acc`` = [union of the tensors' axes, the first tensor's axes, whether two
        tensors differ, whether one needs a gradient], for tensors in lists/tuples too."""
        for v in values:
            if isinstance(v, tensor):
                have = getattr(v, _VMA, _NONE)
                if acc[1] is None:
                    acc[1] = have
                elif have != acc[1]:
                    acc[2] = True
                if have:
                    acc[0] = acc[0] | have
                if v.requires_grad:
                    acc[3] = True
            elif isinstance(v, (list, tuple)):
                scan(v, acc)

    class VmaMode(TorchFunctionMode):
        def __init__(self, env: Any) -> None:
            super().__init__()
            self.env = env

        def lift(self, v: Any, vma: frozenset[str]) -> Any:
            """``v`` (or the tensors in a list/tuple) made varying along all of ``vma``."""
            if isinstance(v, tensor):
                have = getattr(v, _VMA, _NONE)
                if have != vma and v.requires_grad:
                    return self.env.pvary(v, vma - have)
                return v
            if isinstance(v, (list, tuple)):
                return type(v)(self.lift(u, vma) for u in v)
            return v

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            acc: list[Any] = [_NONE, None, False, False]
            scan(args, acc)
            if kwargs:
                scan(kwargs.values(), acc)
            else:
                kwargs = {}
            vma = acc[0]
            if not vma:
                return func(*args, **kwargs)
            if acc[2] and acc[3] and grad_enabled():  # a pvary is needed somewhere
                args = tuple(self.lift(a, vma) for a in args)
                kwargs = {k: self.lift(v, vma) for k, v in kwargs.items()}
            out = func(*args, **kwargs)
            if isinstance(out, tensor):
                setattr(out, _VMA, vma)
            elif isinstance(out, (list, tuple)):
                for o in out:
                    if isinstance(o, tensor):
                        setattr(o, _VMA, vma)
            return out

    _MODE.append(VmaMode)
    return VmaMode


_OPS = {
    "sum": lambda: _dist().ReduceOp.SUM,
    "max": lambda: _dist().ReduceOp.MAX,
    "min": lambda: _dist().ReduceOp.MIN,
}
_VJP: list[Any] = []


def _vjp_function() -> Any:
    """One ``torch.autograd.Function`` running a forward and a backward given per call."""
    if not _VJP:
        torch = _torch()

        class Vjp(torch.autograd.Function):  # type: ignore[name-defined,misc]
            @staticmethod
            def forward(ctx: Any, x: Any, fwd: Any, bwd: Any) -> Any:
                ctx.bwd = bwd
                y = fwd(x)
                return y.view_as(y) if y is x else y

            @staticmethod
            def backward(ctx: Any, ct: Any) -> Any:
                return ctx.bwd(ct), None, None

        _VJP.append(Vjp)
    return _VJP[0]


_FROM_LOCAL: list[Any] = []


def _dtensor(local: Any, spec: Any, requires_grad: bool) -> Any:
    """The DTensor of ``local`` with a spec built in advance: the constructor
    ``DTensor.from_local`` ends in, without building the spec on every call."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=requires_grad)  # type: ignore[no-untyped-call]


def _from_local_function() -> Any:
    """``DTensor.from_local``'s autograd function for a spec built in advance: the gradient
    of the block is the cotangent's local tensor, laid out as the result (a Partial result's
    cotangent is made Replicate, as ``from_local`` does)."""
    if not _FROM_LOCAL:
        torch = _torch()
        from torch.distributed.tensor import DTensor, Replicate

        class FromLocal(torch.autograd.Function):  # type: ignore[name-defined,misc]
            @staticmethod
            def forward(ctx: Any, block: Any, spec: Any) -> Any:
                ctx.spec = spec
                ctx.set_materialize_grads(False)
                return _dtensor(block.view_as(block), spec, requires_grad=block.requires_grad)

            @staticmethod
            def backward(ctx: Any, ct: Any) -> Any:
                if isinstance(ct, DTensor):
                    want = tuple(Replicate() if p.is_partial() else p for p in ctx.spec.placements)
                    if tuple(ct.placements) != want:
                        ct = ct.redistribute(ctx.spec.mesh, want)
                    ct = ct.to_local()
                return ct, None

        _FROM_LOCAL.append(FromLocal)
    return _FROM_LOCAL[0]


def _to_torch(p: Any) -> Any:
    from torch.distributed.tensor.placement_types import Partial as TPartial
    from torch.distributed.tensor.placement_types import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return TShard(p.dim)
    if isinstance(p, Partial):
        return TPartial(p.op)
    return TReplicate()


def _from_torch(p: Any) -> Any:
    from torch.distributed.tensor.placement_types import Partial as TPartial
    from torch.distributed.tensor.placement_types import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # before Shard: older torch derives it from Shard
        return StridedShard(int(p.dim), int(p.split_factor))
    if isinstance(p, TShard):
        return Shard(int(p.dim))
    if isinstance(p, TReplicate):
        return Replicate()
    if isinstance(p, TPartial):
        op = str(p.reduce_op)
        if op not in _REDUCE_OPS:
            raise UnsupportedError(
                f"DTensor placement {p!r} reduces with {op!r}, which has no "
                f"unimesh form; unimesh knows {_REDUCE_OPS}",
                backend="torch",
                capability="partial",
            )
        return Partial(op)
    raise UnsupportedError(
        f"DTensor placement {p!r} has no unimesh form", backend="torch", capability="layout"
    )


def axis_mesh(mesh: Mesh, axes: str | tuple[str, ...], *, device_type: str | None = None) -> Any:
    """This rank's DeviceMesh over ``axes`` of ``mesh`` (e.g. the 1-D "dp" mesh that
    ``DistributedDataParallel(device_mesh=...)`` takes), sliced from the whole mesh's DeviceMesh.

    Every rank calls it with the same ``mesh``; the whole mesh is converted first if needed.
    """
    import unimesh

    be = unimesh.get_backend("torch")
    assert isinstance(be, TorchBackend)
    be.mesh_to_native(mesh, device_type=device_type)
    rank = _dist().get_rank()
    return be.mesh_to_native(mesh.submesh(axes, containing=rank), device_type=device_type)
