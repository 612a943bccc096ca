"""Finding backends (pluggy, entry points): by name, from the imported frameworks, from the
launcher, or as the owner of a native object.

Listing backends reads entry-point metadata only; a plugin module is imported when its backend
is first asked for, and a framework only when a backend method needs it.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import TYPE_CHECKING, Any

from .backend import CONCEPTS, Backend
from .errors import (
    BackendNotFoundError,
    BackendRegistrationError,
    BackendUnavailableError,
    ConversionError,
    UnimeshError,
)
from .launchers import LauncherSign, find_launcher
from .messages import close_match, short

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    import pluggy

__all__ = [
    "backends",
    "get_backend",
    "load_backend",
    "owner_of",
    "refresh_backends",
    "register_backend",
    "unregister_backend",
]

ENV_VAR = "UNIMESH_BACKEND"
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")


class _Registry:
    """Backends as pluggy plugins: an installed backend is the plugin that pluggy's plugin
    manager loads from its entry point (``load_setuptools_entrypoints``, one name at a time,
    so that a plugin module is imported only when its backend is first asked for); a backend
    registered in this process is an :class:`~unimesh.plugin.InProcessPlugin`. Either way the
    backend is what the ``unimesh_backend`` hook (``firstresult``) of the plugins under its
    name returns, the latest registration first."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pm: pluggy.PluginManager | None = None
        self._eps: dict[str, EntryPoint] | None = None
        #: the hook's answer per name, validated (a cache: cleared on every registration)
        self._loaded: dict[str, Backend] = {}
        #: every backend that loads, in name order (a cache: cleared with ``_loaded``, and on
        #: refresh); asked on every call that finds an array's backend
        self._all: list[Backend] | None = None

    # pluggy is imported on first use, not with `import unimesh`
    @property
    def pm(self) -> pluggy.PluginManager:
        if self._pm is None:
            import pluggy

            from .plugin import PROJECT, HookSpecs

            pm = pluggy.PluginManager(PROJECT)
            pm.add_hookspecs(HookSpecs)
            self._pm = pm
        return self._pm

    def entry_points(self) -> dict[str, EntryPoint]:
        """The installed backends' entry points (metadata only: nothing is imported)."""
        if self._eps is None:
            from importlib.metadata import entry_points

            from .plugin import ENTRY_POINT_GROUP

            self._eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        return self._eps

    def _in_process(self) -> set[str]:
        if self._pm is None:
            return set()
        names = (name for name, _ in self._pm.list_name_plugin() if name)
        return {n.removeprefix(_IN_PROCESS) for n in names if n.startswith(_IN_PROCESS)}

    def names(self) -> list[str]:
        with self._lock:
            return sorted(set(self.entry_points()) | self._in_process())

    def load(self, name: str) -> Backend:
        loaded = self._loaded.get(name) if isinstance(name, str) else None
        if loaded is not None:  # the common case, without the lock (a dict read is atomic)
            return loaded
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            pm = self.pm
            ep = self.entry_points().get(name)
            here = name in self._in_process()  # registered in this process: it wins
            if ep is not None and not here and pm.get_plugin(name) is None:
                self._load_entry_point(pm, ep)
            elif ep is None and not here:
                choices = self.names()
                raise BackendNotFoundError(
                    f"no backend named {short(name)}{close_match(name, choices)}; "
                    "installed backends: "
                    f"{', '.join(choices) or 'none'}"
                )
            found = self._hook_of(pm, name)()
            if getattr(found, "name", None) != name:
                plugin = pm.get_plugin(name)
                if plugin is not None:
                    pm.unregister(plugin)
                raise BackendNotFoundError(
                    f"entry point {name!r} ({getattr(ep, 'value', '?')}) provides no backend "
                    f"named {name!r} (its unimesh_backend hook returned {short(found)})"
                )
            backend = _validated(found)
            self._loaded[name] = backend
            return backend

    @staticmethod
    def _hook_of(pm: pluggy.PluginManager, name: str) -> Any:
        """The ``unimesh_backend`` hook of the plugins named for ``name`` only: the one
        registered in this process (called first, as the later registration) and the entry
        point's. The hook is ``firstresult``: the first backend answers."""
        own = {_IN_PROCESS + name, name}
        others = [plugin for key, plugin in pm.list_name_plugin() if key not in own]
        return pm.subset_hook_caller("unimesh_backend", remove_plugins=others)

    def _load_entry_point(self, pm: pluggy.PluginManager, ep: EntryPoint) -> None:
        """The plugin manager loads ``ep`` (and only it) and registers its plugin."""
        from .plugin import ENTRY_POINT_GROUP

        try:
            count = pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
        except ImportError as exc:
            raise BackendUnavailableError(
                f"backend {ep.name!r} is installed but its plugin {ep.value!r} failed to import "
                f"({exc}); reinstall the distribution that provides it"
                f"{_dist_hint(ep)}"
            ) from exc
        except Exception as exc:
            raise BackendNotFoundError(
                f"backend {ep.name!r}: loading entry point {ep.value!r} raised {exc!r}"
            ) from exc
        if not count:  # listed in the metadata read earlier, gone since (uninstalled)
            raise BackendNotFoundError(
                f"backend {ep.name!r}: its entry point {ep.value!r} is no longer installed; "
                "call unimesh.refresh_backends() after installing or removing a backend"
            )

    def all_loaded(self) -> list[Backend]:
        """Every installed backend, loading plugin modules (not frameworks) as needed; one
        that fails to load is left out (until :func:`unimesh.refresh_backends`)."""
        found = self._all
        if found is not None:
            return list(found)
        with self._lock:  # (a registration meanwhile waits, then clears it)
            out = []
            for name in self.names():
                try:
                    out.append(self.load(name))
                except UnimeshError:
                    continue
            self._all = out
            return list(out)

    def register(self, backend: Backend, replace: bool) -> None:
        backend = _validated(backend)
        with self._lock:
            if backend.name in self.names() and not replace:
                raise BackendRegistrationError(
                    f"a backend named {backend.name!r} is already registered; pass replace=True "
                    "to replace it, or call unimesh.unregister_backend() first"
                )
            pm = self.pm
            old = pm.get_plugin(_IN_PROCESS + backend.name)
            if old is not None:
                pm.unregister(old)
            from .plugin import InProcessPlugin

            pm.register(InProcessPlugin(backend), name=_IN_PROCESS + backend.name)
            self._loaded.clear()
            self._all = None

    def unregister(self, name: str) -> None:
        with self._lock:
            pm = self.pm
            plugins = [pm.get_plugin(key) for key in (_IN_PROCESS + name, name)]
            if not any(p is not None for p in plugins) and name not in self._loaded:
                raise BackendNotFoundError(
                    f"no registered backend named {short(name)}; registered: "
                    f"{sorted(set(self._loaded) | self._in_process())}"
                )
            for plugin in plugins:
                if plugin is not None:
                    pm.unregister(plugin)
            self._loaded.clear()
            self._all = None

    def refresh(self) -> None:
        with self._lock:
            self._eps = None
            self._all = None


#: the plugin-manager name of a backend registered in this process (entry points: their name)
_IN_PROCESS = "inprocess:"


def _dist_hint(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None)
    return f": pip install --force-reinstall {name}" if name else ""


def _validated(backend: object) -> Backend:
    if not isinstance(backend, Backend):
        raise BackendRegistrationError(
            f"a backend must be an instance of unimesh.Backend, got {short(backend)} "
            f"({type(backend).__name__})"
        )
    name = backend.name
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise BackendRegistrationError(
            f"backend name {short(name)} must be a non-empty identifier-like str"
        )
    if not isinstance(backend.framework, str) or not backend.framework:
        raise BackendRegistrationError(
            f"backend {name!r} must set `framework` to its top-level module name"
        )
    problems = type(backend).contract_problems() + backend.instance_problems()
    if problems:
        raise BackendRegistrationError(
            f"backend {name!r} ({type(backend).__qualname__}) does not keep the backend "
            "contract (docs/writing-a-backend.md): " + "; ".join(problems)
        )
    if not isinstance(backend.launcher_name, str):
        raise BackendRegistrationError(
            f"backend {name!r}: launcher_name must be a str, got {short(backend.launcher_name)}"
        )
    signs = backend.launcher_signs
    if not isinstance(signs, tuple) or not all(isinstance(x, LauncherSign) for x in signs):
        raise BackendRegistrationError(
            f"backend {name!r}: launcher_signs must be a tuple of unimesh.launchers.LauncherSign, "
            f"got {short(signs)}"
        )
    needs = backend.requires
    if not isinstance(needs, tuple) or not all(isinstance(n, str) for n in needs):
        raise BackendRegistrationError(
            f"backend {name!r}: requires must be a tuple of backend names, got {short(needs)}"
        )
    api = backend.native_api
    if not isinstance(api, dict) or not all(isinstance(v, str) for v in api.values()):
        raise BackendRegistrationError(
            f"backend {name!r}: native_api must map concept names to str, got {short(api)}"
        )
    unknown = sorted(set(api) - set(CONCEPTS))
    if unknown:
        raise BackendRegistrationError(
            f"backend {name!r} maps unknown concepts {unknown} in "
            f"native_api; known concepts are {sorted(CONCEPTS)}"
        )
    return backend


REGISTRY = _Registry()


# -- public calls ---------------------------------------------------------------------------------
def backends() -> list[str]:
    """Names of the installed (entry points) and registered backends. Imports no framework."""
    return REGISTRY.names()


def refresh_backends() -> None:
    """Forget the cached entry points, e.g. after pip-installing a backend in this process."""
    REGISTRY.refresh()


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Register a :class:`Backend` instance in this process (tests, notebooks) and return it."""
    REGISTRY.register(backend, replace)
    return backend


def unregister_backend(name: str) -> None:
    """Forget a backend registered or loaded in this process."""
    REGISTRY.unregister(name)


def load_backend(name: str) -> Backend:
    """The backend named ``name`` as its plugin declares it, whether or not its framework is
    installed: for its facts (extra, launcher, native code), never for work. Imports the plugin
    module, not the framework."""
    return REGISTRY.load(name)


def _check_available(backend: Backend) -> Backend:
    if not backend.available():
        raise BackendUnavailableError(
            f"backend {backend.name!r} needs {backend.framework!r}, which is not installed; "
            f"install it with: {backend.install_hint()}"
        )
    return backend


def get_backend(name: str | Backend | None = None) -> Backend:
    """The backend to use.

    ``name`` given: that backend. None: the ``UNIMESH_BACKEND`` environment variable if set,
    else the one backend whose framework is already imported (``sys.modules``; a framework that
    another imported one runs on, like jax under keras, yields to it), else the backend of the
    launcher that started this process (:func:`unimesh.detect_launcher`), else an error listing
    the choices. Raises :class:`BackendUnavailableError` when the framework is not installed.
    """
    if isinstance(name, Backend):
        return _check_available(name)
    if name is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            try:
                return _check_available(REGISTRY.load(env))
            except BackendNotFoundError as exc:
                raise BackendNotFoundError(f"{ENV_VAR}={env!r}: {exc}") from exc
        return _detect()
    if not isinstance(name, str):
        raise BackendNotFoundError(
            f"backend must be a name (str) or a Backend, got {short(name)}; installed backends: "
            f"{backends()}"
        )
    return _check_available(REGISTRY.load(name))


def _detect() -> Backend:
    loaded = REGISTRY.all_loaded()
    live = [b for b in loaded if b.framework in sys.modules]
    live = [b for b in live if not any(b.framework in o.wraps for o in live if o is not b)]
    if len(live) == 1:
        return live[0]
    names = [b.name for b in loaded]
    if not live:
        launcher = find_launcher(loaded, os.environ)
        if launcher is not None and launcher.backend in names:
            return _check_available(REGISTRY.load(launcher.backend))
        raise BackendNotFoundError(
            "no backend given and none detected: no installed backend's framework is imported "
            f"yet. Pass backend=NAME or set {ENV_VAR}; installed backends: {names or 'none'}"
        )
    raise BackendNotFoundError(
        f"no backend given and several frameworks are imported ({[b.name for b in live]}); pass "
        f"backend=NAME or set {ENV_VAR}"
    )


def owner_of(obj: Any) -> Backend:
    """The loaded backend whose framework made ``obj`` (no import), else ConversionError."""
    loaded = REGISTRY.all_loaded()
    owners = [be for be in loaded if be.owns(obj)]
    # a backend that wraps another (keras over jax) yields to the framework's own backend
    owners = [b for b in owners if not any(o is not b and o.framework in b.wraps for o in owners)]
    if owners:
        return owners[0]
    raise ConversionError(
        f"got {short(obj)} ({type(obj).__module__}.{type(obj).__qualname__}), which no installed "
        f"backend owns (installed: {[b.name for b in loaded]}); pass backend=NAME"
    )
