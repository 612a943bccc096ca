"""The backend contract: three layers, and the capabilities that follow from them.

A backend only translates: it turns the neutral objects into its framework's objects and back.
Everything shared (coordinates, groups, shard blocks, the placements rule, the SPMD engine)
comes from the core. A backend must not import its framework at module import time.

The contract has three layers, each a set of hooks on :class:`Backend` (see :data:`LAYERS`):

- **translator** (required): ``mesh_to_native`` and ``from_native``, then optionally
  ``layout_to_native``, ``layout_map_to_native``, ``distribute`` with ``local_shards``;
- **runtime** (optional): ``initialize`` and ``exchange`` (several processes), ``launcher``,
  ``prepare_devices``, ``axis_groups``;
- **programs** (optional): ``shard_map`` with ``full_array``, ``value_and_grad``,
  ``shard_params``. A backend with one device per process gets ``shard_map`` from
  :class:`unimesh.spmd.ProcessBackend` by implementing the engine's primitives instead.

A backend's :attr:`Backend.capabilities` are not written by hand: each hook capability follows
from the hooks the class implements, and a backend declares only its :attr:`Backend.features`
(refinements of a capability it has, such as ``uneven_shards``); a derived capability
(:data:`DERIVED`: ``checkpoint``) follows from the capabilities it needs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .contract import (
    CAPABILITIES,
    CONCEPTS,
    DERIVED,
    FEATURES,
    HELPERS,
    HOOKS,
    LAYERS,
    MOVED,
    Hook,
    Layer,
    derive_capabilities,
    problems,
)
from .contract import hook_capability as _HOOK_CAPABILITY
from .errors import UnsupportedError

if TYPE_CHECKING:
    from .arrays import Arrays
    from .launchers import LauncherSign
    from .layout import Layout
    from .mesh import Mesh
    from .program import Body, SpecTree
    from .rules import LayoutMap
    from .transport import Transport

__all__ = [
    "CAPABILITIES",
    "CONCEPTS",
    "DERIVED",
    "FEATURES",
    "HELPERS",
    "HOOKS",
    "LAYERS",
    "Backend",
    "Hook",
    "Layer",
    "Reused",
]


class Backend:
    """Base class of a unimesh backend.

    The smallest backend sets :attr:`name` and :attr:`framework` and implements
    ``mesh_to_native`` and ``from_native``; each further hook it implements adds the capability
    :data:`LAYERS` names for it, and :attr:`features` adds declared refinements.

    Attributes:
        name: the backend's name (``"torch"``, ``"jax"``, ...), also its entry-point name.
        framework: the top-level module of the framework (checked with ``find_spec``, never
            imported by the core).
        distributions: the pip distributions that may carry the framework, for
            :meth:`framework_version` (default: ``framework``).
        extra: the pip extra that installs the framework: ``pip install "unimesh[extra]"``.
        features: names from :data:`FEATURES` this backend supports.
        native_modules: top-level modules whose objects ``from_native`` accepts (default:
            ``(framework,)``).
        wraps: frameworks this one runs on (Keras: jax, tensorflow, torch); when both are
            imported, auto-detection picks this backend.
        native_api: for each concept of :data:`CONCEPTS` this backend implements, the native
            API it translates to (documentation; generates the cross-framework table).
        launcher_name: how :meth:`launcher` starts processes, in a few words for tables
            (``"torchrun, gloo"``); the launcher's program name when empty.
        launcher_signs: the launchers that start this backend's runtime, each as the
            environment variables it sets (:class:`~unimesh.launchers.LauncherSign`):
            :func:`unimesh.detect_launcher` and backend detection read them.
        requires: backends this one builds on (Keras: ``("jax",)``); they must be installed
            too.
        max_simulated_devices: the most devices :meth:`prepare_devices` will ask the framework
            to simulate in one process (None: no limit); :meth:`request_devices` refuses more
            before the framework starts.

    Derived (never set by hand): :attr:`capabilities`, the hook capabilities of the hooks the
    class implements plus its :attr:`features`.

    Everything the rest of the project knows about a backend comes from these declarations
    and the hooks below: the command line, the docs' tables and the conformance runner name
    no backend.
    """

    name: ClassVar[str] = ""
    framework: ClassVar[str] = ""
    distributions: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str] = ""
    features: ClassVar[frozenset[str]] = frozenset()
    native_modules: ClassVar[tuple[str, ...]] = ()
    wraps: ClassVar[tuple[str, ...]] = ()
    native_api: ClassVar[dict[str, str]] = {}
    launcher_name: ClassVar[str] = ""
    launcher_signs: ClassVar[tuple[LauncherSign, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()
    max_simulated_devices: ClassVar[int | None] = None
    #: the most mesh axes the framework's mesh can hold (None: the core's limit, 64)
    max_mesh_axes: ClassVar[int | None] = None
    #: True when :meth:`layout_to_native` gives an immutable value that depends on the layout
    #: alone (JAX's NamedSharding, Keras's TensorLayout): the core then keeps it per layout
    native_layouts_immutable: ClassVar[bool] = False
    #: derived in ``__init_subclass__``: see the class docstring
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "capabilities" in cls.__dict__:
            # written by hand: registration refuses it with the fix (contract_problems)
            type.__setattr__(cls, "_hand_written_capabilities", cls.__dict__["capabilities"])
        cls.capabilities = derive_capabilities(cls.implements, cls.features)

    @classmethod
    def implements(cls, hook: str) -> bool:
        """Whether this class implements ``hook`` (overrides the base class's default)."""
        return getattr(cls, hook, None) is not getattr(Backend, hook, None)

    @classmethod
    def layers(cls) -> tuple[str, ...]:
        """The layers this class implements at least one hook of (the translator always
        counts: it is required)."""
        return tuple(
            layer.name
            for layer in LAYERS
            if layer.required or any(cls.implements(h) for h in layer.all_hooks)
        )

    def instance_problems(self) -> list[str]:
        """What this instance gets wrong (checked when it is registered), each with its fix:
        e.g. state a base class declares in ``__init__`` that a subclass never set up."""
        return []

    @classmethod
    def contract_problems(cls) -> list[str]:
        """What this class gets wrong about the contract (checked when it is registered), each
        with its fix; empty when nothing (:func:`unimesh.contract.problems`)."""
        found = problems(
            cls.implements,
            cls.features,
            cls.capabilities,
            cls.__dict__.get("_hand_written_capabilities"),
        )
        for old, new in MOVED.items():
            if hasattr(cls, old):
                found.append(f"defines {old}, which is no hook any more (ignored): now {new}")
        return found

    # -- facts, answered without importing the framework ----------------------------------------
    @property
    def pip_extra(self) -> str:
        return self.extra or self.name

    def install_hint(self) -> str:
        return f'pip install "unimesh[{self.pip_extra}]"'

    def available(self) -> bool:
        """True when the framework can be imported (it is not imported to find out)."""
        if self.framework in sys.modules:
            return True
        import importlib.util

        try:
            return importlib.util.find_spec(self.framework) is not None
        except (ImportError, ValueError):
            return False

    def framework_version(self) -> str | None:
        """The installed framework's distribution version (the first of
        :attr:`distributions` installed), or None."""
        from importlib import metadata

        for dist in self.distributions or (self.framework,):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return None

    # -- helpers: the core calls these; a backend uses them and does not override them ----------
    def supports(self, capability: str) -> bool:
        """Helper. Whether ``capability`` is one of :attr:`capabilities`."""
        return capability in self.capabilities

    def require(self, capability: str, detail: str = "") -> None:
        """Helper. Raise :class:`UnsupportedError` unless this backend has ``capability``."""
        if capability not in self.capabilities:
            what = CAPABILITIES.get(capability, capability)
            raise UnsupportedError(
                f"backend {self.name!r} does not support {capability!r} ({what})"
                + (f": {detail}" if detail else "")
                + f"; it supports {sorted(self.capabilities)}",
                backend=self.name,
                capability=capability,
            )

    def request_devices(self, count: int, processes: int = 1) -> int:
        """Helper (not a hook: override :meth:`prepare_devices`, which this wraps).
        :meth:`prepare_devices` for ``count`` devices over ``processes`` processes, refused
        with :class:`UnsupportedError` before any framework work when one process would have to
        simulate more than :attr:`max_simulated_devices` (a million simulated devices never
        finish starting). Returns how many devices meshes may use."""
        limit = self.max_simulated_devices
        per_process = -(-count // max(processes, 1))
        if limit is not None and per_process > limit:
            raise UnsupportedError(
                f"this needs {per_process} devices in one process, more than the {self.name} "
                f"backend simulates ({limit}); convert a part of the mesh (Mesh.submesh, "
                "Mesh.local_mesh), run more processes under the launcher, or build a device-free "
                "form where the framework has one (jax: to_native(mesh, 'jax', abstract=True))",
                backend=self.name,
                capability="mesh",
            )
        return self.prepare_devices(count)

    def reject_options(self, options: dict[str, Any], accepted: str = "") -> None:
        """Helper. Raise :class:`UnsupportedError` naming any option this backend does not take."""
        if options:
            takes = f"; it takes {accepted}" if accepted else ""
            raise UnsupportedError(
                f"unknown option(s) {sorted(options)} for the {self.name} backend{takes}",
                backend=self.name,
            )

    # -- facts a backend may refine --------------------------------------------------------------
    def owns(self, obj: object) -> bool:
        """True when ``obj``'s type comes from one of :attr:`native_modules` (no import)."""
        roots = self.native_modules or (self.framework,)
        return any(cls.__module__.split(".", 1)[0] in roots for cls in type(obj).__mro__)

    def native_code(self, of: Mesh | Layout) -> str | None:
        """The native Python that builds a mesh by hand (``unimesh convert --code``, for
        porting), or a layout on the ``mesh`` that a mesh's code defines (``--layout``); None
        (the default) when the backend writes none. Imports nothing."""
        return None

    def demo_compute(self, array: Any, weight: Any) -> Any:
        """``unimesh demo``'s check of the framework itself: the product of ``array`` (from
        :meth:`distribute`, 2-D) with the replicated numpy ``weight``, computed by the
        framework's own sharded operations, returned whole (numpy or array-like) in every
        process; None (the default) where the backend computes nothing."""
        return None

    def __repr__(self) -> str:
        return f"<unimesh backend {self.name!r} ({type(self).__module__}.{type(self).__name__})>"

    def _missing(self, hook: str) -> Any:
        cap = _HOOK_CAPABILITY.get(hook, hook)
        raise UnsupportedError(
            f"backend {self.name!r} does not implement {hook} (capability {cap!r})",
            backend=self.name,
            capability=cap,
        )

    # == layer 1, translator (required) ==========================================================
    def mesh_to_native(self, mesh: Mesh, **options: Any) -> Any:
        """Neutral :class:`~unimesh.Mesh` -> the framework's mesh object (``mesh``).

        Args:
            mesh: the neutral mesh; its device ids are logical (``process_devices`` says which
                this process holds).
            options: the caller's framework options (refuse unknown ones with
                :meth:`reject_options`).

        Returns:
            The framework's mesh object (``jax.sharding.Mesh``, torch ``DeviceMesh``, ...)."""
        return self._missing("mesh_to_native")

    def from_native(self, obj: Any) -> Mesh | Layout | LayoutMap:
        """A native object this backend :meth:`owns` -> Mesh, Layout or LayoutMap (``mesh``).

        Args:
            obj: a framework mesh, sharding/layout or layout map (a distributed array where
                the framework's array carries its layout, as a DTensor does).

        Returns:
            The neutral :class:`~unimesh.Mesh`, :class:`~unimesh.Layout` or
            :class:`~unimesh.LayoutMap`; :class:`~unimesh.ConversionError` for anything else."""
        out: Mesh | Layout | LayoutMap = self._missing("from_native")
        return out

    def layout_to_native(self, layout: Layout, **options: Any) -> Any:
        """Neutral :class:`~unimesh.Layout` -> the framework's sharding/layout object
        (``layout``).

        Args:
            layout: the neutral layout (the core has checked it against the backend's
                features and ``max_mesh_axes``).
            options: the caller's framework options.

        Returns:
            The framework's object (``NamedSharding``, DTensor placements, ``TensorLayout``)."""
        return self._missing("layout_to_native")

    def layout_map_to_native(self, layout_map: LayoutMap, **options: Any) -> Any:
        """Neutral :class:`~unimesh.LayoutMap` -> the framework's layout map
        (``layout_map``)."""
        return self._missing("layout_map_to_native")

    def distribute(self, array: Any, layout: Layout, **options: Any) -> Any:
        """A native distributed array whose shards are ``layout``'s reference blocks
        (``distribute``, with :meth:`local_shards`).

        Args:
            array: the global value (numpy, or the framework's own array), whole on every
                process.
            layout: where each block goes (:meth:`Layout.shard_slices` names each block).
            options: the caller's framework options.

        Returns:
            The framework's distributed array."""
        return self._missing("distribute")

    def local_shards(self, array: Any) -> dict[int, Any]:
        """This process's shards of a native distributed array (the inverse view of
        :meth:`distribute`; what a checkpoint save writes).

        Args:
            array: a distributed array of this framework.

        Returns:
            ``{logical device id: block}`` for each device of this process, each block numpy
            or array-like in the layout's block shape."""
        out: dict[int, Any] = self._missing("local_shards")
        return out

    def host_views(self, array: Any) -> dict[int, Any] | None:
        """This process's blocks of a native distributed array as writable numpy arrays over
        the array's own memory (C-order, each of its block's shape and item size), so that a
        load fills them in place; None (the default) where the framework's arrays are
        immutable (JAX, MLX) or not in host memory: a load then makes new arrays.

        Args:
            array: a distributed array of this framework.

        Returns:
            ``{logical device id: numpy view}``, or None."""
        return None

    def native_blocks(self, array: Any) -> dict[int, Any]:
        """This process's blocks of a native distributed array, ``{device id: native block}``,
        each on its device (no copy), for a reshard. Default: :meth:`local_shards` (numpy)."""
        return self.local_shards(array)

    def from_local(
        self,
        blocks: Mapping[int, Any],
        layout: Layout,
        shape: tuple[int, ...],
        dtype: Any = None,
        **options: Any,
    ) -> Any:
        """The native distributed array of global ``shape`` whose block on each of this
        process's devices is ``blocks[device id]`` (``from_local``; the core has checked every
        block's shape against ``layout``). ``dtype`` (None, or the user's) is for a process
        with no blocks. ``blocks`` may read each block when it is first asked for (a
        checkpoint load does): take each once, and do not hold host copies longer than the
        transfer needs.

        Args:
            blocks: ``{logical device id: numpy block}`` for each device of this process.
            layout: the layout the result has.
            shape: the global shape.
            dtype: the dtype where the process has no block (None: the blocks').
            options: the caller's framework options.

        Returns:
            The framework's distributed array, without a gather."""
        return self._missing("from_local")

    # == models (optional): unimesh.save / unimesh.load of a framework's model object ==========
    def model_state(self, model: Any) -> dict[str, Any] | None:
        """The named arrays of ``model`` when it is one of the framework's model objects (a
        torch ``nn.Module``, a Keras model, an ``mlx.nn.Module``): ``{name: distributed array,
        or numpy for an array held whole}``, names as the framework writes them (state_dict
        names, variable paths). None (the default): ``model`` is not a model this backend
        knows, and the core treats it as a pytree."""
        return None

    def model_assign(self, model: Any, values: dict[str, Any]) -> None:
        """Write loaded arrays into ``model`` in place, each in the layout
        :meth:`model_state` gave for its name (no gather)."""
        self._missing("model_assign")

    # == layer 2, runtime (optional; the defaults are one process with one device) ==============
    def prepare_devices(self, count: int) -> int:
        """Ask for ``count`` logical devices in this process where the framework allows it
        (before its runtime starts), and return how many devices meshes may use here. Used by
        the conformance suite; the default claims nothing beyond one device."""
        return 1

    def process_devices(self, mesh: Mesh) -> tuple[int, ...]:
        """The ids of ``mesh``'s devices this process holds, ascending (used by
        :func:`unimesh.from_local`). Default: one process holds them all."""
        return tuple(sorted(mesh.device_ids.ravel().tolist()))

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:
        """Start the framework's distributed runtime from the launcher's environment (once;
        later calls return the same), peers joining within ``timeout`` seconds. ``launch``
        (a :class:`unimesh.runtime.Launch`, or None) carries the coordinator address, process
        count and process id the user gave, which win over the environment. Returns (this
        process's index, the number of processes); the default is one process, and takes no
        launch parameters.

        Args:
            timeout: seconds to wait for every peer.
            launch: the user's launch parameters, or None (the environment's).

        Returns:
            ``(process index, process count)``."""
        if launch is not None:
            raise UnsupportedError(
                f"the {self.name} backend starts no multi-process runtime, so it takes no "
                f"launch parameters (got {launch}); drop coordinator_address/num_processes/"
                "process_id (and the KERAS_DISTRIBUTION_* variables)",
                backend=self.name,
                capability="multi_process",
            )
        return 0, 1

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """Every process's ``payload``, in process order, through the framework's collective;
        :class:`~unimesh.MeshMismatchError` saying a peer is gone if one does not take part
        within ``timeout`` seconds (used by :func:`unimesh.verify` and the checkpoint save's
        agreements). Default: one process.

        Args:
            payload: this process's bytes.
            timeout: seconds to wait for every peer.

        Returns:
            Every process's payload, in process order."""
        return [payload]

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]] | None:
        """How to run Python in ``processes`` processes of this framework's distributed runtime:
        a command prefix that ``-m module args...`` completes, and environment additions. None
        (the default) when the backend runs in one process. Used by ``unimesh check`` and the
        demo."""
        return None

    # -- live reshard -----------------------------------------------------------------------
    def arrays(self) -> Arrays:
        """The framework's array operations (:class:`unimesh.arrays.Arrays`), one object the
        engine and the reshard transport share. Default: numpy's."""
        from .arrays import NUMPY

        return NUMPY

    def transport(self) -> Transport:
        """The transport of this backend's reshards (:class:`unimesh.transport.Transport`:
        six operations only the framework can do). Default: one process, numpy blocks."""
        from .transport import Transport

        return Transport(self)

    def move_with_gradient(
        self,
        blocks: Mapping[int, Any],
        forward: Callable[[Mapping[int, Any]], dict[int, Any]],
        backward: Callable[[Mapping[int, Any]], dict[int, Any]],
        like: Any,
    ) -> dict[int, Any]:
        """``forward(blocks)`` (this process's target blocks from its source ``blocks``), as
        one step of the framework's autodiff where it records one: given the cotangents of
        the target blocks, ``backward`` gives those of the source blocks (it moves data too,
        so every process that took part in the forward must run it). ``like`` is the array
        moved. Default: ``forward(blocks)``, outside any autodiff."""
        return forward(blocks)

    def check_reshard(
        self, array: Any, source: Layout, target: Layout, shape: tuple[int, ...]
    ) -> None:
        """Refuse (``UnsupportedError``) a move this backend cannot make, before any array of
        the call moves; ``array`` None: the reverse move of a gradient (the cotangents), checked
        before it moves. Default: a move between processes needs a transport whose
        ``exchange`` moves data."""
        if not type(self.transport()).has("exchange") and self.initialize(300.0)[1] > 1:
            raise UnsupportedError(
                f"the {self.name} backend moves no data between processes, so it cannot "
                f"reshard {source!r} -> {target!r} across its {self.initialize(300.0)[1]} "
                "processes; save and load through a checkpoint instead",
                backend=self.name,
                capability="multi_process",
            )

    def axis_groups(self, native_mesh: Any, axis: str) -> dict[int, tuple[int, ...]]:
        """For each of this process's devices in the native mesh, the members of its
        communication group along ``axis``, as the framework orders them (``axis_groups``)."""
        out: dict[int, tuple[int, ...]] = self._missing("axis_groups")
        return out

    # == layer 3, programs (optional) ============================================================
    def shard_map(self, body: Body, mesh: Mesh, ins: SpecTree, outs: SpecTree) -> Any:
        """A function of the global arguments that runs ``body(env, *blocks)`` on every device
        with an :class:`~unimesh.program.AxisEnv` ``env`` and returns the native distributed
        results (``shard_map``, with :meth:`full_array`). ``ins`` and ``outs`` are pytree
        prefixes of Layouts. Backends that run one device per process derive from
        :class:`unimesh.spmd.ProcessBackend`, which implements this."""
        return self._missing("shard_map")

    def context_mesh(self) -> Mesh | None:
        """The mesh the framework's own context sets (``jax.set_mesh``), for ``shard_map``
        with ``mesh=None`` outside ``with mesh:``; None where there is none."""
        return None

    def full_array(self, array: Any) -> Any:
        """The whole global value of a native distributed array, as numpy, on every process."""
        return self._missing("full_array")

    def value_and_grad(
        self, fn: Callable[..., Any], argnums: tuple[int, ...], has_aux: bool
    ) -> Callable[..., Any]:
        """A function of ``fn``'s arguments returning ``(value, grads)`` with the framework's
        autodiff, ``grads`` a tuple with one tree per entry of ``argnums``, each gradient laid
        out like its argument (``grad``; :func:`unimesh.value_and_grad`)."""
        out: Callable[..., Any] = self._missing("value_and_grad")
        return out

    def shard_params(self, model: Any, resolve: Callable[[str, tuple[int, ...]], Layout]) -> Any:
        """Every parameter of ``model`` laid out as ``resolve(path, shape)`` says
        (``shard_params``; :func:`unimesh.shard_params`)."""
        return self._missing("shard_params")

    def compile(self, fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
        """``fn`` compiled by the framework's own compiler (:func:`unimesh.compile`), taking
        and returning what ``fn`` takes and returns; ``options`` go to that compiler."""
        missing: Callable[..., Any] = self._missing("compile")
        return missing

    def program_entry(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A :func:`unimesh.shard_map` program as the function a user calls, as the
        framework's compiler should meet it inside a compiled step; by default ``fn`` itself.
        torch gives one that ``torch.compile`` traces as a single call
        (``torch._dynamo.nonstrict_trace``), so that unimesh's own Python never cuts its
        graph."""
        return fn

    def stop_gradient(self, x: Any) -> Any:
        """``x`` with no gradient through it, in the framework's own autodiff
        (:func:`unimesh.stop_gradient`)."""
        return self._missing("stop_gradient")

    def describe_native(self, native: Any) -> str:
        """How ``unimesh convert`` prints a native mesh or layout: ``repr`` unless the
        framework's own is unreadable in a terminal."""
        return repr(native)

    def param_paths(self, model: Any) -> list[tuple[str, tuple[int, ...]]] | None:
        """The path and shape of each parameter :meth:`shard_params` lays out, in its
        spelling, without changing anything (so that rules are checked before a parameter is
        touched). None (the default): the core checks after placing instead."""
        return None


class Reused:
    """A hook a backend takes unchanged from a backend it builds on (one of its
    :attr:`Backend.requires`), as Keras 3's backends reuse each other's modules: in the
    class body, ``shard_map = Reused("_jax")``. ``source`` names a method of the backend that,
    given the hook's name, returns the backend to take it from (after any check of its own:
    Keras's, that it runs on JAX). For the contract the hook is implemented; its promise is
    the other backend's."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if self.name and self.name != name:
            raise TypeError(f"one Reused() per hook: {name} and {self.name} share one")
        self.name = name

    def __get__(self, obj: Backend | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.source)(self.name), self.name)
