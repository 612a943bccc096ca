"""The base class every backend derives from, and the capabilities a backend may declare.

A backend only translates: it turns the neutral objects into its framework's objects and back.
Everything shared (coordinates, groups, shard blocks, the placements rule) comes from the core.
It must not import its framework at module import time, only inside its methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from .errors import UnsupportedError

if TYPE_CHECKING:
    from .mesh import Mesh

__all__ = ["CAPABILITIES", "CONCEPTS", "Backend"]

#: Capabilities a backend may declare, with what each promises.
CAPABILITIES: dict[str, str] = {
    "mesh": "Mesh <-> the framework's mesh object (to_native / from_native)",
    "layout": "Layout <-> the framework's sharding/layout object",
    "layout_map": "LayoutMap -> the framework's layout map",
    "distribute": "distribute(array, layout) gives a native distributed array",
    "uneven_shards": "layouts whose sharded dims do not divide evenly (torch.chunk blocks)",
    "tuple_axes": "one tensor dim split over several mesh axes (P(('dp', 'tp')))",
    "partial": "pending reductions (P(..., partial={axis: op}))",
    "axis_types": "auto / explicit / manual axis types round-trip",
    "axis_groups": "a communication group per mesh axis",
    "multi_process": "meshes spanning several processes",
    "shard_map": "unimesh.shard_map runs per-shard functions",
    "grad": "unimesh.value_and_grad differentiates programs (the global function's gradient)",
}

#: The concepts a backend maps to native APIs (:attr:`Backend.native_api`), with the neutral API
#: of each; the docs' cross-framework table is generated from these declarations.
CONCEPTS: dict[str, str] = {
    "mesh": "unimesh.Mesh",
    "layout": "unimesh.Layout (mesh + PartitionSpec)",
    "layout_map": "unimesh.LayoutMap",
    "distribute": "unimesh.distribute(array, layout)",
    "axis_group": "Mesh.groups(axis)",
    "shard_map": "unimesh.shard_map(f, mesh, in_specs, out_specs)",
    "psum": "unimesh.psum(x, axis)",
    "all_gather": "unimesh.all_gather(x, axis)",
    "psum_scatter": "unimesh.psum_scatter(x, axis)",
    "all_to_all": "unimesh.all_to_all(x, axis, split_axis, concat_axis)",
    "ppermute": "unimesh.ppermute(x, axis, perm)",
    "value_and_grad": "unimesh.value_and_grad(fn, argnums)",
    "axis_index": "unimesh.axis_index(axis)",
    "shard_params": "unimesh.shard_params(model, rules)",
    "launch": "Backend.launcher(n) / unimesh check",
}


class Backend:
    """Base class of a unimesh backend. Subclasses set the class attributes and override the
    translation methods for the capabilities they declare.

    Attributes:
        name: the backend's name (``"torch"``, ``"jax"``, ...), also its entry-point name.
        framework: the top-level module of the framework (checked with ``find_spec``, never
            imported by the core).
        extra: the pip extra that installs the framework: ``pip install "unimesh[extra]"``.
        capabilities: names from :data:`CAPABILITIES`.
        native_modules: top-level modules whose objects ``from_native`` accepts (default:
            ``(framework,)``).
        wraps: frameworks this one runs on (Keras: jax, tensorflow, torch); when both are
            imported, auto-detection picks this backend.
        native_api: for each concept of :data:`CONCEPTS` this backend implements, the native
            API it translates to (documentation; generates the cross-framework table).
        launcher_name: how :meth:`launcher` starts processes, in a few words for tables
            (``"torchrun, gloo"``); the launcher's program name when empty.
        requires: backends this one builds on (Keras: ``("jax",)``); they must be installed
            too.

    Everything the rest of the project knows about a backend comes from these declarations
    and the hooks below: the command line, the docs' tables and the conformance runner name
    no backend.
    """

    name: ClassVar[str] = ""
    framework: ClassVar[str] = ""
    extra: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[str]] = frozenset()
    native_modules: ClassVar[tuple[str, ...]] = ()
    wraps: ClassVar[tuple[str, ...]] = ()
    native_api: ClassVar[dict[str, str]] = {}
    launcher_name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()

    # -- facts, answered without importing the framework ----------------------------------------
    @property
    def pip_extra(self) -> str:
        return self.extra or self.name

    def install_hint(self) -> str:
        return f'pip install "unimesh[{self.pip_extra}]"'

    def available(self) -> bool:
        """True when the framework can be imported (it is not imported to find out)."""
        import importlib.util

        try:
            return importlib.util.find_spec(self.framework) is not None
        except (ImportError, ValueError):
            return False

    def framework_version(self) -> str | None:
        """The installed framework's distribution version, or None."""
        from importlib import metadata

        for dist in (self.framework, self.framework.replace("_", "-"), f"{self.framework}-cpu"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return None

    def supports(self, capability: str) -> bool:
        return capability in self.capabilities

    def require(self, capability: str, detail: str = "") -> None:
        """Raise :class:`UnsupportedError` unless ``capability`` is declared."""
        if capability not in self.capabilities:
            what = CAPABILITIES.get(capability, capability)
            raise UnsupportedError(
                f"backend {self.name!r} does not support {capability!r} ({what})"
                + (f": {detail}" if detail else "")
                + f"; it declares {sorted(self.capabilities)}",
                backend=self.name,
                capability=capability,
            )

    def reject_options(self, options: dict[str, Any], accepted: str = "") -> None:
        """Raise :class:`UnsupportedError` naming any option this backend does not take."""
        if options:
            takes = f"; it takes {accepted}" if accepted else ""
            raise UnsupportedError(
                f"unknown option(s) {sorted(options)} for the {self.name} backend{takes}",
                backend=self.name,
            )

    def owns(self, obj: object) -> bool:
        """True when ``obj``'s type comes from one of :attr:`native_modules` (no import)."""
        roots = self.native_modules or (self.framework,)
        return any(cls.__module__.split(".", 1)[0] in roots for cls in type(obj).__mro__)

    def native_code(self, mesh: Mesh) -> str | None:
        """The native Python that builds ``mesh`` by hand (``unimesh convert --code``, for
        porting), or None (the default) when the backend writes none. Imports nothing."""
        return None

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """``unimesh demo``'s check of the framework itself: the product of ``array`` (from
        :meth:`distribute`, 2-D) with the replicated numpy ``weight``, computed by the
        framework's own sharded operations, returned whole (numpy or array-like) in every
        process; None (the default) where the backend computes nothing."""
        return None

    def __repr__(self) -> str:
        return f"<unimesh backend {self.name!r} ({type(self).__module__}.{type(self).__name__})>"

    # -- translation, overridden by subclasses ---------------------------------------------------
    def _missing(self, capability: str) -> Any:
        raise UnsupportedError(
            f"backend {self.name!r} declares no {capability!r} translation",
            backend=self.name,
            capability=capability,
        )

    def mesh_to_native(self, mesh: Any, **options: Any) -> Any:
        """Neutral :class:`~unimesh.Mesh` -> the framework's mesh object."""
        return self._missing("mesh")

    def layout_to_native(self, layout: Any, **options: Any) -> Any:
        """Neutral :class:`~unimesh.Layout` -> the framework's sharding/layout object."""
        return self._missing("layout")

    def layout_map_to_native(self, layout_map: Any, **options: Any) -> Any:
        """Neutral :class:`~unimesh.LayoutMap` -> the framework's layout map."""
        return self._missing("layout_map")

    def from_native(self, obj: Any) -> Any:
        """A native object this backend :meth:`owns` -> Mesh, Layout or LayoutMap."""
        return self._missing("mesh")

    def distribute(self, array: Any, layout: Any, **options: Any) -> Any:
        """A native distributed array whose shards are ``layout``'s reference blocks."""
        return self._missing("distribute")

    def prepare_devices(self, count: int) -> int:
        """Ask for ``count`` logical devices in this process where the framework allows it
        (before its runtime starts), and return how many devices meshes may use here. Used by
        the conformance suite; the default claims nothing beyond one device."""
        return 1

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]] | None:
        """How to run Python in ``processes`` processes of this framework's distributed runtime:
        a command prefix that ``-m module args...`` completes, and environment additions. None
        (the default) when the backend runs in one process. Used by ``unimesh check`` and the
        demo."""
        return None

    def initialize(self, timeout: float) -> tuple[int, int]:
        """Start the framework's distributed runtime from the launcher's environment (once;
        later calls return the same), peers joining within ``timeout`` seconds. Returns (this
        process's index, the number of processes); the default is one process."""
        return 0, 1

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """Every process's ``payload``, in process order, through the framework's collective;
        :class:`~unimesh.MeshMismatchError` saying a peer is gone if one does not take part
        within ``timeout`` seconds (used by :func:`unimesh.verify`). Default: one process."""
        return [payload]

    def axis_groups(self, native_mesh: Any, axis: str) -> dict[int, tuple[int, ...]]:
        """For each of this process's devices in the native mesh, the members of its
        communication group along ``axis``, as the framework orders them (``axis_groups``)."""
        out: dict[int, tuple[int, ...]] = self._missing("axis_groups")
        return out

    def local_shards(self, array: Any) -> dict[int, Any]:
        """This process's shards of a native distributed array, as numpy arrays keyed by
        logical device id (the inverse view of :meth:`distribute`, for checks)."""
        out: dict[int, Any] = self._missing("distribute")
        return out

    def shard_map(self, body: Any, mesh: Any, ins: Any, outs: Any) -> Any:
        """A function of the global arguments that runs ``body(env, *blocks)`` on every device
        with an :class:`~unimesh.parallel.AxisEnv` ``env`` and returns the native distributed
        results (``shard_map``). ``ins`` and ``outs`` are :class:`~unimesh.parallel.SpecTree`
        (pytree prefixes of Layouts). Backends that run one device per process derive from
        :class:`unimesh.spmd.ProcessBackend`, which implements this."""
        return self._missing("shard_map")

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Any:
        """A function of ``fn``'s arguments returning ``(value, grads)`` with the framework's
        autodiff, ``grads`` a tuple with one tree per entry of ``argnums``, each gradient laid
        out like its argument (:func:`unimesh.value_and_grad`)."""
        return self._missing("shard_map")

    def full_array(self, array: Any) -> Any:
        """The whole global value of a native distributed array, as numpy, on every process."""
        return self._missing("distribute")

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """Every parameter of ``model`` laid out as ``resolve(path, shape)`` says (a
        :class:`~unimesh.Layout`); see :func:`unimesh.shard_params`."""
        return self._missing("distribute")
