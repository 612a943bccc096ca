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
    Backend,
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
from unimesh.parallel import AxisEnv

__all__ = ["TorchAxisEnv", "TorchBackend", "TorchLayout", "axis_mesh"]

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


class TorchBackend(Backend):
    """PyTorch: ``DeviceMesh`` and DTensor placements (torch >= 2.6)."""

    name = "torch"
    framework = "torch"
    extra = "torch"
    native_modules = ("torch", "unimesh_torch")
    capabilities = frozenset({"mesh", "layout", "distribute", "uneven_shards", "tuple_axes",
                              "partial", "axis_groups", "multi_process", "shard_map"})
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

    # -- the runtime -------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        dist = _dist()
        if not dist.is_available() or not dist.is_initialized():
            raise MeshMismatchError(
                "torch.distributed is not initialized: run under torchrun and call "
                "unimesh.initialize() (or torch.distributed.init_process_group) before "
                "converting a mesh to torch")
        return dist.get_rank(), dist.get_world_size()

    def _device_type(self, device_type: str | None) -> str:
        if device_type is not None:
            if not isinstance(device_type, str) or not device_type:
                raise UnsupportedError(f"device_type must be a str like 'cpu' or 'cuda', got "
                                       f"{short(device_type)}", backend=self.name)
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
            "(unimesh_torch.axis_mesh(mesh, axes))")

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]]:
        """torchrun (``python -m torch.distributed.run --standalone``), gloo over loopback."""
        import os
        import sys

        return ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={processes}"],
                {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})

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
                    f"set {', '.join(needed)}")
            kind = "cpu:gloo,cuda:nccl" if _torch().cuda.is_available() else "gloo"
            try:
                dist.init_process_group(kind, timeout=timedelta(seconds=timeout))
            except (RuntimeError, ValueError) as exc:
                first = first_line(exc)
                raise LaunchError(
                    f"torch.distributed.init_process_group({kind!r}) failed for RANK="
                    f"{os.environ['RANK']} of WORLD_SIZE={os.environ['WORLD_SIZE']} at "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within "
                    f"{timeout:.0f} s (a peer process may be gone): {first}") from exc
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
                f"in the check within {timeout:.0f} s): {first_line(exc)}") from exc
        return [bytes.fromhex(t) for t in texts]

    def prepare_devices(self, count: int) -> int:
        """The world size: under a launcher (torchrun sets RANK/WORLD_SIZE) the gloo process
        group is started if it is not (:meth:`initialize`); with no launcher and no process
        group, a :class:`~unimesh.LaunchError` that names the launcher. ``count`` cannot change
        it: the launcher decides."""
        return self.initialize(1800.0)[1]

    # -- meshes --------------------------------------------------------------------------------
    def mesh_to_native(self, mesh: Mesh, *, device_type: str | None = None,
                       **options: Any) -> Any:
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
                f"(torchrun --nproc-per-node {top + 1}) or use a smaller mesh")
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
                    "the submeshes that contain it (mesh.submesh(axes, containing=rank))")
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

    def _checked(self, native: Any, axes: tuple[str, ...], flat_name: str | None,
                 target: Mesh, root: Mesh) -> Any:
        torch = _torch()
        order = [root.axis_names.index(a) for a in axes]
        if order != sorted(order):
            raise UnsupportedError(
                f"torch {torch.__version__} slices a DeviceMesh only with axes in mesh order; "
                f"{target!r} takes {axes} of {root!r} in another order. Use "
                f"{tuple(sorted(axes, key=root.axis_names.index))} (or transpose the whole mesh "
                "first and convert that)", backend=self.name, capability="mesh")
        sub = native[axes]
        if flat_name is not None:
            if not hasattr(sub, "_flatten"):  # pragma: no cover - torch < 2.6
                raise UnsupportedError(f"torch {torch.__version__} cannot flatten mesh dims",
                                       backend=self.name, capability="mesh")
            sub = sub._flatten(flat_name)
        got = self.mesh_from_native(sub)
        if got != target:  # pragma: no cover - would be a torch change; never hand it out
            raise MeshMismatchError(f"torch sliced {got!r} where unimesh expects {target!r}")
        return sub

    def mesh_from_native(self, device_mesh: Any) -> Mesh:
        names = device_mesh.mesh_dim_names or tuple(
            f"dim_{i}" for i in range(device_mesh.mesh.ndim))
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
                backend=self.name, capability="layout")

    def layout_to_native(self, layout: Layout, *, device_type: str | None = None,
                         **options: Any) -> TorchLayout:
        """``TorchLayout(device_mesh, placements, ndim)``: the DTensor placements of the
        layout (``Shard``, ``_StridedShard``, ``Replicate``, ``Partial``)."""
        self._check_order(layout)
        native_mesh = self.mesh_to_native(layout.mesh, device_type=device_type, **options)
        return TorchLayout(native_mesh, tuple(_to_torch(p) for p in layout.placements()),
                           len(layout.spec))

    def from_native(self, obj: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(obj, DeviceMesh):
            return self.mesh_from_native(obj)
        if isinstance(obj, TorchLayout):
            return Layout.from_placements(self.mesh_from_native(obj.device_mesh),
                                          [_from_torch(p) for p in obj.placements], obj.ndim)
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            return Layout.from_placements(self.mesh_from_native(obj.device_mesh),
                                          [_from_torch(p) for p in obj.placements], obj.ndim)
        raise ConversionError(
            f"the torch backend converts DeviceMesh, DTensor and TorchLayout, not {short(obj)} "
            f"({type(obj).__module__}.{type(obj).__qualname__})")

    def distribute(self, array: Any, layout: Layout, *, device_type: str | None = None,
                   src_data_rank: int | None = 0, **options: Any) -> Any:
        """A DTensor (``torch.distributed.tensor.distribute_tensor``) whose local tensor on each
        rank is the reference block ``layout.shard_slices(shape, rank)``."""
        torch = _torch()
        if not torch.is_tensor(array):
            array = torch.as_tensor(np.asarray(array))
        if layout.spec.partial:
            raise UnsupportedError(
                f"distribute() of a partial layout {layout.spec!r}: DTensor builds pending "
                "reductions only from computations; distribute the replicated value and "
                "compute the partial result", backend=self.name, capability="partial")
        shape = tuple(array.shape)
        for d, p in enumerate(layout.placements()):
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
                        backend=self.name, capability="uneven_shards")
        native = self.layout_to_native(layout, device_type=device_type, **options)
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(array, native.device_mesh, list(native.placements),
                                 src_data_rank=src_data_rank)

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


    # -- programs --------------------------------------------------------------------------------
    def _block(self, array: Any, layout: Layout, native: Any, rank: int) -> Any:
        """This rank's block of a shard_map argument: a DTensor's local tensor (redistributed
        to ``layout`` first when it is laid out otherwise), or the slice of a global tensor."""
        torch = _torch()
        from torch.distributed.tensor import DTensor

        if isinstance(array, DTensor):
            if array.device_mesh is native.device_mesh and \
                    tuple(array.placements) == native.placements:
                return array.to_local()  # the usual case, checked without conversions
            have = self.from_native(array)
            if have.mesh != layout.mesh:
                raise ConversionError(f"a shard_map argument is a DTensor on {have.mesh!r}, not "
                                      f"on the shard_map's {layout.mesh!r}")
            if have != layout:
                array = array.redistribute(native.device_mesh, list(native.placements))
            return array.to_local()
        if not torch.is_tensor(array):
            array = torch.as_tensor(np.asarray(array))
        if array.ndim < len(layout.spec):
            raise ConversionError(f"a shard_map argument of shape {tuple(array.shape)} has fewer "
                                  f"dims than its in_spec {layout.spec!r}")
        return array[layout.shard_slices(tuple(array.shape), rank)]

    def shard_map(self, body: Any, mesh: Mesh, in_layouts: tuple[Layout, ...],
                  out_layouts: tuple[Layout, ...], single_out: bool) -> Any:
        """Runs ``body`` on this rank's local tensors and wraps its results as DTensors
        (``DTensor.from_local``); the collectives are torch's functional collectives (they
        have autograd) over the DeviceMesh's per-axis groups. The DeviceMesh and placements
        are built on the first call (every rank calls together) and reused."""
        for layout in in_layouts + out_layouts:
            self._check_order(layout)
        state: list[Any] = []

        def setup() -> tuple[int, list[Any], list[Any], TorchAxisEnv]:
            rank = _dist().get_rank()
            if not (mesh.device_ids == rank).any():
                raise MeshMismatchError(f"rank {rank} is not a device of {mesh!r}; shard_map runs "
                                        "on the mesh's ranks: call it there only")
            ins = [self.layout_to_native(lay) for lay in in_layouts]
            outs = [self.layout_to_native(lay) for lay in out_layouts]
            env = TorchAxisEnv(mesh, rank, self.mesh_to_native(mesh))
            state.append((rank, ins, outs, env))
            return state[0]  # type: ignore[no-any-return]

        def run(*args: Any) -> Any:
            torch = _torch()
            from torch.distributed.tensor import DTensor

            rank, ins, outs, env = state[0] if state else setup()
            blocks = [self._block(a, lay, nat, rank) for a, lay, nat in zip(args, in_layouts, ins)]
            result = body(env, *blocks)
            results = (result,) if single_out else result
            wrapped = []
            for block, native, layout in zip(results, outs, out_layouts):
                block = block if torch.is_tensor(block) else torch.as_tensor(block)
                shape = layout.global_shape(tuple(block.shape))
                stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
                wrapped.append(DTensor.from_local(block, native.device_mesh,
                                                  list(native.placements), run_check=False,
                                                  shape=torch.Size(shape), stride=tuple(stride)))
            return wrapped[0] if single_out else tuple(wrapped)

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
            raise ConversionError(f"the torch backend shards the parameters of an nn.Module, "
                                  f"not {short(model)}")
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


class TorchAxisEnv(AxisEnv):
    """Axis collectives on this rank's groups of the DeviceMesh (one group per mesh axis); a
    tuple of axes runs one axis after another."""

    def __init__(self, mesh: Mesh, device: int, device_mesh: Any) -> None:
        super().__init__(mesh, device)
        self.device_mesh = device_mesh

    def reduce_one(self, x: Any, axis: str, op: str) -> Any:
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(_torch().as_tensor(x), op, self.device_mesh.get_group(axis))

    def _gather_one(self, x: Any, axis: str) -> list[Any]:
        """Every member's ``x`` along ``axis``, in coordinate order (torch's group order is by
        global rank, which a permuted mesh does not follow)."""
        from torch.distributed import _functional_collectives as funcol

        group = self.device_mesh.get_group(axis)
        x = _torch().as_tensor(x).contiguous()
        ranks = list(_dist().get_process_group_ranks(group))
        gathered = funcol.all_gather_single(x.unsqueeze(0), 0, group)
        rows = self.mesh.groups_array(axis)
        row = rows[(rows == self.device).any(axis=1)][0]
        return [gathered[ranks.index(int(m))] for m in row]

    def all_gather(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        torch = _torch()
        out = x
        for k, axis in enumerate(reversed(axes)):  # minor axis first: row-major over axes
            pieces = self._gather_one(out, axis)
            if tiled:
                out = torch.cat(pieces, dim)
            else:
                out = torch.stack(pieces, dim)
                if k:
                    out = out.flatten(dim, dim + 1)
        return out


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
            raise UnsupportedError(f"DTensor placement {p!r} reduces with {op!r}, which has no "
                                   f"unimesh form; unimesh knows {_REDUCE_OPS}",
                                   backend="torch", capability="partial")
        return Partial(op)
    raise UnsupportedError(f"DTensor placement {p!r} has no unimesh form", backend="torch",
                           capability="layout")


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
