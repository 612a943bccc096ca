"""The torch backend's translator layer: neutral Mesh <-> ``DeviceMesh``, Layout <-> DTensor
placements, ``distribute_tensor``, and the communication groups of a DeviceMesh."""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from unimesh import (
    ConversionError,
    Layout,
    LayoutError,
    Mesh,
    MeshMismatchError,
    Partial,
    Shard,
    StridedShard,
    UnsupportedError,
)
from unimesh.messages import short
from unimesh.placements import from_torch_placement

from .runtime import BUILD_LOCK, import_dist, import_torch
from .transport import TorchReshard

_REDUCE_OPS = ("sum", "avg", "max", "min")


class TorchLayout(NamedTuple):
    """A layout in torch's terms: the DeviceMesh, one DTensor placement per mesh dim, and the
    number of tensor dims the spec covers."""

    device_mesh: Any
    placements: tuple[Any, ...]
    ndim: int


def _plain(mesh: Mesh) -> Mesh:
    """The mesh as torch can hold it: no axis types, no process layout (ranks are devices)."""
    if mesh.axis_types is None and mesh.devices_per_process is None:
        return mesh
    return Mesh(mesh.shape, mesh.axis_names, mesh.device_ids)


@functools.lru_cache(maxsize=256)
def _non_increasing_axes(mesh: Mesh, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Axes along which some group's ranks are not increasing (kept per mesh and axes: every
    conversion of a layout asks)."""
    bad = []
    for ax in axes:
        groups = mesh.groups_array(ax)
        if groups.shape[1] > 1 and not bool(np.all(np.diff(groups, axis=1) > 0)):
            bad.append(ax)
    return tuple(bad)


@functools.lru_cache(maxsize=1024)
def _layout(mesh: Mesh, placements: tuple[Any, ...], ndim: int) -> Layout:
    """The Layout of DTensor ``placements`` (hashable, as torch's are) on ``mesh``."""
    return Layout.from_placements(mesh, [_from_torch(p) for p in placements], ndim)


#: the unimesh Mesh of each DeviceMesh read so far, by id, with a weak reference to it (a
#: DeviceMesh does not change; reading one builds its rank tensor and checks a new Mesh)
_FROM_NATIVE: dict[int, tuple[weakref.ref[Any], Mesh]] = {}


class TorchTranslator(TorchReshard):
    """The translator layer (and ``axis_groups``, the groups of a translated DeviceMesh)."""

    # -- meshes --------------------------------------------------------------------------------
    def mesh_to_native(
        self,
        mesh: Mesh,
        *,
        device_type: str | None = None,
        backend_override: Mapping[str | int, Any] | None = None,
        **options: Any,
    ) -> Any:
        """A ``DeviceMesh`` over the ranks in ``mesh.device_ids``.

        ``backend_override`` is ``init_device_mesh``'s: per mesh axis (name, or index), a
        process-group backend name (``"fake"`` for a size-1 axis, as torchtitan does), a
        ``Backend.Options``, or a ``(name, options)`` pair.

        A mesh already converted in this process is returned again. A submesh (or a flattened
        axis) of one that contains this rank is sliced from it with torch's own slicing, which
        creates no process group; any other mesh is built anew, which every rank must do with
        the same mesh (checked, so a disagreement is an error, not a hang).
        """
        self.reject_options(options, "device_type, backend_override")
        rank, world = self._world()
        top = mesh.size - 1 if mesh.is_default_order else int(mesh.device_ids.max())
        if top >= world:
            raise MeshMismatchError(
                f"{mesh!r} uses rank {top}, but the torch world has {world} ranks "
                f"(0..{world - 1}); start at least {top + 1} processes "
                f"(torchrun --nproc-per-node {top + 1}) or use a smaller mesh"
            )
        dtype = self._device_type(device_type)
        with BUILD_LOCK:  # threads converting at once get one DeviceMesh, its groups made once
            world_group = import_dist().group.WORLD
            if world_group is not self._world_group:
                self._meshes.clear()
                self._world_group = world_group
            plain = _plain(mesh)
            override = None if backend_override is None else self._override(plain, backend_override)
            key: Any = (dtype, plain) if override is None else (dtype, plain, override)
            try:
                if key in self._meshes:
                    return self._meshes[key]
            except TypeError:  # options that cannot be hashed: build, do not cache
                key = None
            # a mesh with its own process-group options gets its own groups, never a slice
            native = self._slice(plain, rank, dtype) if override is None else None
            if native is None:
                from torch.distributed.device_mesh import DeviceMesh

                self._agree(plain)
                ids = import_torch().from_numpy(plain.device_ids.astype(np.int32))
                native = DeviceMesh(
                    dtype, ids, mesh_dim_names=plain.axis_names, backend_override=override
                )
            if key is not None:
                self._meshes[key] = native
            return native

    def _override(self, mesh: Mesh, value: object) -> tuple[tuple[str | None, Any], ...]:
        """``backend_override`` as torch's per-dim ``(backend name, options)`` tuple."""
        from torch._C._distributed_c10d import Backend as C10dBackend

        forms = (
            "{axis name: backend}, the backend a name like 'gloo' or 'fake', a "
            "Backend.Options, or a (name, options) pair"
        )
        if not isinstance(value, Mapping):
            raise UnsupportedError(
                f"backend_override must be a dict {forms}; got {short(value)}",
                backend=self.name,
            )
        by_axis: dict[int, Any] = {}
        for k, v in value.items():
            if isinstance(k, str) and k in mesh.axis_names:
                i = mesh.axis_names.index(k)
            elif isinstance(k, int) and not isinstance(k, bool) and 0 <= k < mesh.ndim:
                i = k
            else:
                raise UnsupportedError(
                    f"backend_override names {short(k)}, which is not an axis of {mesh!r}; "
                    f"use one of {list(mesh.axis_names)} (or an index below {mesh.ndim})",
                    backend=self.name,
                )
            if i in by_axis:
                raise UnsupportedError(
                    f"backend_override gives axis {mesh.axis_names[i]!r} twice (by name and by "
                    "index); give it once",
                    backend=self.name,
                )
            by_axis[i] = v
        out: list[tuple[str | None, Any]] = []
        for i in range(mesh.ndim):
            v = by_axis.get(i)
            name, opts = v if isinstance(v, tuple) and len(v) == 2 else (v, None)
            if isinstance(name, C10dBackend.Options) and opts is None:
                name, opts = None, name
            good_name = name is None or (isinstance(name, str) and name != "")
            if not good_name or not (opts is None or isinstance(opts, C10dBackend.Options)):
                raise UnsupportedError(
                    f"backend_override for axis {mesh.axis_names[i]!r} is {short(v)}; give "
                    f"a backend name like 'gloo' or 'fake', a Backend.Options, or a (name, "
                    "options) pair",
                    backend=self.name,
                )
            if isinstance(name, str):
                self._check_pg_backend(name, mesh.axis_names[i])
            out.append((name if isinstance(name, str) else None, opts))
        return tuple(out)

    def _check_pg_backend(self, name: str, axis: str) -> None:
        """A backend name torch can build a group with here (torch itself fails later, on
        every rank, with a bare assertion)."""
        dist = import_dist()
        low = name.lower()
        available = getattr(dist, f"is_{low}_available", None)
        if low in ("gloo", "nccl", "mpi", "ucc", "xccl") and callable(available):
            ok = bool(available())
        else:
            ok = low.upper() in getattr(dist.Backend, "_plugins", {})
        if not ok:
            raise UnsupportedError(
                f"backend_override for axis {axis!r} names process-group backend {name!r}, "
                "which is not available in this process; use one that is (e.g. 'gloo') or "
                "register it first (torch.distributed.Backend.register_backend; importing "
                "torch.testing._internal.distributed.fake_pg registers 'fake')",
                backend=self.name,
            )

    def _slice(self, target: Mesh, rank: int, dtype: str) -> Any:
        """Slice ``target`` from a DeviceMesh built earlier, or None when it is no submesh (or
        flattened submesh) of one. The decision does not depend on the rank, so every rank
        takes the same path: members slice, non-members get an error, nobody waits."""
        anchor = int(target.device_ids.flat[0])
        for key, native in list(self._meshes.items()):
            if len(key) != 2:  # a mesh with a backend_override is no root to slice from
                continue
            d, root = key
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
        torch = import_torch()
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
        key = id(device_mesh)
        known = _FROM_NATIVE.get(key)
        if known is not None and known[0]() is device_mesh:
            return known[1]
        names = device_mesh.mesh_dim_names or tuple(
            f"dim_{i}" for i in range(device_mesh.mesh.ndim)
        )
        ids = device_mesh.mesh.detach().cpu().numpy()
        mesh = Mesh(ids.shape, tuple(names), ids)
        try:
            ref = weakref.ref(device_mesh, lambda _: _FROM_NATIVE.pop(key, None))
        except TypeError:  # pragma: no cover - a DeviceMesh that takes no weak reference
            return mesh
        _FROM_NATIVE[key] = (ref, mesh)
        return mesh

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
            return _layout(self.mesh_from_native(obj.device_mesh), tuple(obj.placements), obj.ndim)
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            return _layout(self.mesh_from_native(obj.device_mesh), tuple(obj.placements), obj.ndim)
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
        torch = import_torch()
        if not torch.is_tensor(array):
            array = from_host(np.asarray(array))  # ml_dtypes' bfloat16 / float8 too
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

    def process_devices(self, mesh: Mesh) -> tuple[int, ...]:
        self._world()  # a LaunchError outside torchrun, or the group started under it
        return super().process_devices(mesh)

    def from_local(
        self,
        blocks: Mapping[int, Any],
        layout: Layout,
        shape: tuple[int, ...],
        dtype: Any = None,
        *,
        device_type: str | None = None,
        **options: Any,
    ) -> Any:
        """``DTensor.from_local(block, device_mesh, placements, shape=..., stride=...)`` with
        this rank's block (a tensor keeps its autograd graph; numpy is wrapped, not copied)."""
        from torch.distributed.tensor import DTensor

        torch = import_torch()
        native = self.layout_to_native(layout, device_type=device_type, **options)
        rank, _ = self._world()
        block = blocks.get(rank)
        if block is None:  # a rank outside the mesh holds nothing, as distribute_tensor gives it
            if dtype is None or isinstance(dtype, torch.dtype):
                local = torch.empty(0, dtype=dtype)
            elif str(dtype).rsplit(".", 1)[-1] == "bfloat16":  # numpy has no bfloat16 of its own
                local = torch.empty(0, dtype=torch.bfloat16)
            else:  # numpy's spelling
                local = torch.from_numpy(np.empty(0, dtype=np.dtype(dtype)))
        elif isinstance(block, torch.Tensor):
            local = block
        else:
            local = from_host(np.asarray(block))
        return DTensor.from_local(
            local,
            native.device_mesh,
            native.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=global_stride(local, shape, native.device_mesh, native.placements),
        )

    def axis_groups(self, native_mesh: Any, axis: str) -> dict[int, tuple[int, ...]]:
        """``{rank: ranks of the process group along axis}`` (torch's order: by global rank)."""
        if native_mesh.get_coordinate() is None:
            return {}
        group = native_mesh.get_group(axis)
        return {import_dist().get_rank(): tuple(import_dist().get_process_group_ranks(group))}

    def local_shards(self, array: Any) -> dict[int, Any]:
        """``{rank: numpy block}``: this rank's local tensor of a DTensor (empty when the rank
        is outside its mesh)."""
        if array.device_mesh.get_coordinate() is None:
            return {}
        return {import_dist().get_rank(): to_host(array.to_local().detach().cpu())}

    def host_views(self, array: Any) -> dict[int, Any] | None:
        """``{rank: numpy over the local tensor's memory}`` of a DTensor whose local tensor is
        a contiguous CPU tensor (a load fills it in place, as ``dcp.load`` does); None for one
        on another device, or laid out in memory otherwise."""
        if array.device_mesh.get_coordinate() is None:
            return {}
        local = array.to_local().detach()
        if local.device.type != "cpu" or not local.is_contiguous():
            return None
        try:
            view = to_host(local)
        except (TypeError, RuntimeError, ConversionError):  # a dtype numpy cannot view
            return None
        return {import_dist().get_rank(): view}

    # -- live reshard: unimesh.reshard's transport on torch.distributed ------------------------
    def native_code(self, of: Mesh | Layout) -> str:
        """``init_device_mesh`` where the ranks are in the default order, else ``DeviceMesh``
        over the rank tensor; every rank runs it. A layout: :meth:`_layout_code`."""
        if isinstance(of, Layout):
            return self._layout_code(of)
        mesh = of
        head = (
            "# every rank runs this under torchrun, after torch.distributed.init_process_group\n"
            '# ("cpu" with gloo; "cuda" with nccl)\n'
        )
        names = tuple(mesh.axis_names)
        if mesh.is_default_order:
            return (
                "from torch.distributed.device_mesh import init_device_mesh\n\n"
                + head
                + f'mesh = init_device_mesh("cpu", {mesh.shape}, mesh_dim_names={names})'
            )
        return (
            "import torch\nfrom torch.distributed.device_mesh import DeviceMesh\n\n"
            + head
            + "# the ranks are not in row-major order, which init_device_mesh cannot express\n"
            f'mesh = DeviceMesh("cpu", torch.tensor({mesh.device_ids.tolist()}), '
            f"mesh_dim_names={names})"
        )

    def _layout_code(self, layout: Layout) -> str:
        """DTensor placements, one per mesh dim, for ``distribute_tensor``."""
        text = []
        for p in layout.placements():
            if isinstance(p, StridedShard):
                text.append(f"_StridedShard({p.dim}, split_factor={p.split_factor})")
            elif isinstance(p, Shard):
                text.append(f"Shard({p.dim})")
            elif isinstance(p, Partial):
                text.append(f"Partial({p.op!r})")
            else:
                text.append("Replicate()")
        used = [n for n in ("Partial", "Replicate", "Shard") if any(t.startswith(n) for t in text)]
        lines = ["from torch.distributed.tensor import " + ", ".join([*used, "distribute_tensor"])]
        if any(t.startswith("_StridedShard") for t in text):
            lines.append("from torch.distributed.tensor.placement_types import _StridedShard")
        lines += [
            "",
            f"# {layout.spec!r}: one placement per mesh dim {tuple(layout.mesh.axis_names)}",
            f"placements = ({', '.join(text)}{',' if len(text) == 1 else ''})",
            "# dtensor = distribute_tensor(tensor, mesh, placements)",
        ]
        return "\n".join(lines)

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """DTensor matmul with a replicated weight, then ``full_tensor()``."""
        torch = import_torch()
        from torch.distributed.tensor import Replicate, distribute_tensor

        device_mesh = array.device_mesh
        w = distribute_tensor(
            torch.from_numpy(weight), device_mesh, [Replicate()] * device_mesh.ndim
        )
        return (array @ w).full_tensor().numpy()


def global_stride(
    local: Any, shape: tuple[int, ...], mesh: Any, placements: Any
) -> tuple[int, ...]:
    """The DTensor's stride for this rank's ``local`` block: row-major for a contiguous block;
    for another (a permuted view), what ``DTensor.from_local`` derives from the local stride
    (torch's ``compute_global_tensor_info``: along each sharded mesh dim, every stride at
    least the sharded dim's grows by the mesh dim's size), so the two agree."""
    if local.is_contiguous() or local.dim() != len(shape) or local.numel() == 0:
        return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    stride = list(local.stride())
    for index, placement in enumerate(placements):
        if placement.is_shard() or type(placement).__name__ == "_StridedShard":
            dim = placement.dim
            size = mesh.size(index)
            stride = [
                s * size if i != dim and s >= stride[dim] else s for i, s in enumerate(stride)
            ]
    return tuple(stride)


#: torch dtypes numpy lacks; ml_dtypes has them under the same names (JAX's spelling)
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def to_host(t: Any) -> np.ndarray:
    """A CPU tensor as numpy; bfloat16 and float8 as ml_dtypes arrays over the same bytes."""
    name = str(t.dtype).rsplit(".", 1)[-1]
    if name not in _ML_DTYPES:
        return t.numpy()  # type: ignore[no-any-return]
    ml = _ml_dtypes(name)
    torch = import_torch()
    same = torch.int16 if t.element_size() == 2 else torch.uint8
    return t.contiguous().view(same).numpy().view(getattr(ml, name))  # type: ignore[no-any-return]


def from_host(a: np.ndarray) -> Any:
    """numpy as a tensor; ml_dtypes' bfloat16 and float8 as torch's, over the same bytes."""
    torch = import_torch()
    name = a.dtype.name
    if name not in _ML_DTYPES:
        return torch.as_tensor(a)
    same = np.int16 if a.dtype.itemsize == 2 else np.uint8
    return torch.from_numpy(np.ascontiguousarray(a).view(same)).view(getattr(torch, name))


def _ml_dtypes(name: str) -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise ConversionError(
            f"a {name} tensor becomes numpy through the ml_dtypes package (pip install "
            "ml_dtypes; JAX installs it)"
        ) from None
    return ml_dtypes


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
    try:
        out = from_torch_placement(p)
    except LayoutError as exc:
        raise UnsupportedError(str(exc), backend="torch", capability="layout") from None
    if out is None:
        raise UnsupportedError(
            f"DTensor placement {p!r} has no unimesh form", backend="torch", capability="layout"
        )
    if isinstance(out, Partial) and out.op not in _REDUCE_OPS:
        raise UnsupportedError(
            f"DTensor placement {p!r} reduces with {out.op!r}, which has no "
            f"unimesh form; unimesh knows {_REDUCE_OPS}",
            backend="torch",
            capability="partial",
        )
    return out


def axis_mesh(mesh: Mesh, axes: str | tuple[str, ...], *, device_type: str | None = None) -> Any:
    """This rank's DeviceMesh over ``axes`` of ``mesh`` (e.g. the 1-D "dp" mesh that
    ``DistributedDataParallel(device_mesh=...)`` takes), sliced from the whole mesh's DeviceMesh.

    Every rank calls it with the same ``mesh``; the whole mesh is converted first if needed.
    """
    import unimesh

    be = unimesh.get_backend("torch")
    assert isinstance(be, TorchTranslator)
    be.mesh_to_native(mesh, device_type=device_type)
    rank = import_dist().get_rank()
    return be.mesh_to_native(mesh.submesh(axes, containing=rank), device_type=device_type)
