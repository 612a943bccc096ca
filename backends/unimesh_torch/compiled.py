"""All of the torch backend's torch.compile glue, in one place (as MLX's ``compiled.py``): a
program as one opaque call to dynamo (:func:`program_entry`, through a
``torch._dynamo.nonstrict_trace`` twin made once dynamo is loaded, watched for on
``sys.meta_path``), :func:`compile_step`, the refusal a traced program raised surfaced as the
UnimeshError it was, and the functional collectives used while dynamo or aot_autograd traces.

Module state (listed in ``docs/internals.md``): ``REFUSED`` (the error of the trace in
flight), ``_INSIDE`` (how many twins are running), ``_UNMARKED`` (programs made before dynamo
loaded), ``_AUTOGRAD_TRACED`` and its lock (compiled value_and_grad steps running with
dynamo's ``trace_autograd_ops`` on) -- process-wide facts of torch's compiler, not of one
backend object."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from unimesh import UnimeshError

from .runtime import import_torch

__all__ = ["compile_step", "compiling", "funcol", "in_twin", "mark_entries", "program_entry",
           "real_mesh", "surfacing", "traced_permute"]  # fmt: skip


#: the UnimeshError a program's twin raised while torch.compile traced it (see ``surfacing``)
REFUSED: list[BaseException] = []
#: how many programs' twins are running (traced by aot_autograd, not by dynamo)
_INSIDE = [0]
#: the ``mark`` of every program made before dynamo was loaded (``TorchPrograms.program_entry``)
_UNMARKED: list[weakref.ref[Callable[[], None]]] = []


def surfacing(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (a torch.compile'd function) raising the UnimeshError a program refused
    with while dynamo traced it, instead of dynamo's report of that error (which names
    neither the value nor the fix)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        REFUSED.clear()
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:
            if REFUSED and not isinstance(exc, UnimeshError):
                raise REFUSED.pop() from exc
            raise

    call.__name__ = getattr(compiled, "__name__", "compiled")
    call.__wrapped__ = compiled  # type: ignore[attr-defined]
    return call


def mark_entries() -> None:
    """Give every program made so far its nonstrict_trace twin (dynamo is loaded now)."""
    while _UNMARKED:
        mark = _UNMARKED.pop()()
        if mark is not None:
            mark()


def _unmarked(mark: Callable[[], None]) -> None:
    """Keep ``mark`` until dynamo loads. The first time, watch for ``import torch._dynamo``
    (``torch.compile`` imports it on its first call), so that a program made before it gets
    its twin before dynamo traces it, whoever calls ``torch.compile``; dead references are
    dropped as the list grows."""
    if not _UNMARKED and not any(isinstance(f, _DynamoWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoWatch())
    if len(_UNMARKED) >= 64 and len(_UNMARKED) & (len(_UNMARKED) - 1) == 0:
        _UNMARKED[:] = [ref for ref in _UNMARKED if ref() is not None]
    _UNMARKED.append(weakref.ref(mark))


class _DynamoWatch:
    """A finder on ``sys.meta_path`` that finds nothing itself: when ``torch._dynamo`` is
    imported it takes itself off the path, has the import system find the module as before,
    and runs :func:`mark_entries` once the module has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class Marking(importlib.abc.Loader):
            def __getattr__(self, attr: str) -> Any:  # get_source and the rest: the loader's
                return getattr(loader, attr)

            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                try:
                    mark_entries()
                except Exception as exc:  # noqa: BLE001 - never break the import of dynamo
                    import warnings

                    warnings.warn(
                        f"unimesh could not prepare its programs for torch.compile ({exc!r}); "
                        "programs made before torch._dynamo was imported are traced by "
                        "dynamo (with graph breaks). Call unimesh.compile, or import "
                        "torch._dynamo before making them",
                        RuntimeWarning,
                        stacklevel=2,
                    )

        spec.loader = Marking()
        return spec


def _plain(x: Any, depth: int) -> bool:
    """Whether ``x`` is what a nonstrict_trace function takes: tensors, None, numbers and
    strings in dicts, lists and tuples (not namedtuples or other classes)."""
    if isinstance(x, (import_torch().Tensor, int, float, bool, str)) or x is None:
        return True
    if depth > 50:
        return False
    if type(x) in (tuple, list):
        return all(_plain(v, depth + 1) for v in x)
    if type(x) is dict:
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in x.items())
    return False


def in_twin() -> bool:
    """Whether a program's nonstrict_trace twin is running (traced by aot_autograd)."""
    return _INSIDE[0] > 0


def compiling() -> bool:
    """Whether dynamo or aot_autograd traces this call: collectives are then torch's
    functional collectives (graph nodes naming their group by a string), not the c10d
    ones, which write in place into a tensor and carry the ProcessGroup object."""
    return bool(import_torch().compiler.is_compiling())


def funcol() -> Any:
    from torch.distributed import _functional_collectives

    return _functional_collectives


def real_mesh(device_mesh: Any) -> Any:
    """The DeviceMesh itself: while aot_autograd traces, a DTensor's mesh is a
    ``FakeScriptObject`` around it (DeviceMesh is an opaque type, so not a copy)."""
    if not _INSIDE[0]:  # eager, or dynamo tracing (which fakes the mesh its own way)
        return device_mesh
    from torch._library.fake_class_registry import FakeScriptObject

    return device_mesh.real_obj if isinstance(device_mesh, FakeScriptObject) else device_mesh


def program_entry(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as one opaque call to dynamo: inside ``torch.compile`` it runs through its
    ``torch._dynamo.nonstrict_trace`` twin, whose Python (pytree flattening, the engine,
    autograd) dynamo does not trace; aot_autograd traces the tensor operations and the
    functional collectives it calls, so a unimesh step compiles with ``fullgraph=True``.
    Importing dynamo costs a second or more, so the twin is made once dynamo is loaded:
    at once if it is, else when ``torch._dynamo`` is imported (``_DynamoWatch``), by
    :func:`unimesh.compile` or at the first eager call after dynamo loads. Arguments
    nonstrict_trace refuses (a namedtuple) run the program eagerly (a graph break)."""
    compiling = import_torch().compiler.is_compiling
    twin: list[Callable[..., Any]] = []

    def mark() -> None:
        if not twin:
            from torch._dynamo import nonstrict_trace

            def traced(*args: Any) -> Any:
                _INSIDE[0] += 1  # traced by aot_autograd: the check_vma tags hold
                try:
                    return fn(*args)
                except UnimeshError as exc:  # dynamo reports it as its own Unsupported
                    REFUSED[:] = [exc]
                    raise
                finally:
                    _INSIDE[0] -= 1

            traced.__name__ = getattr(fn, "__name__", "traced")
            twin.append(nonstrict_trace(traced))
            # arguments nonstrict_trace does not take: run eagerly, a clean graph break
            # (dynamo tracing the program's own Python fails and then skips its code)
            twin.append(import_torch().compiler.disable(fn))

    def run(*args: Any) -> Any:
        if twin and compiling():
            return twin[0](*args) if _plain(args, 0) else twin[1](*args)
        if not twin and "torch._dynamo" in sys.modules and not compiling():
            mark()
        return fn(*args)

    run.__name__ = getattr(fn, "__name__", "run")
    run.__doc__ = getattr(fn, "__doc__", None)
    if "torch._dynamo" in sys.modules:
        mark()
    else:
        _unmarked(mark)
    return run


def compile_step(fn: Any, options: dict[str, Any]) -> Any:
    """``torch.compile(fn, **options)``. The step's unimesh programs reach dynamo as single
    calls (:func:`program_entry`), so ``fullgraph=True`` holds. A step made by
    :func:`unimesh.value_and_grad` (or ``grad``) compiles whole, its gradient included: dynamo
    traces its ``torch.autograd.grad`` (``trace_autograd_ops``, set while the step runs), so
    forward and backward are one graph with no DTensor wrapping between them. Where that
    graph breaks (an argument ``nonstrict_trace`` does not take, such as a namedtuple; a
    ``print`` or ``.item()`` in the loss; a torch whose dynamo refuses ``requires_grad_``)
    or recompiles too often, it warns once and falls back, for good, to the step around the
    compiled function: the forward compiled, aot_autograd's backward run by autograd outside
    the graph. An exception the step itself raises is raised as it is (no fallback). Shapes
    are static unless ``dynamic`` is given (a program's blocks follow from its arguments'
    shapes)."""
    torch = import_torch()
    mark_entries()
    # shapes specialize, as under jax.jit: a program's blocks and groups follow from them
    options = {"dynamic": False, **options}
    grad_of = getattr(fn, "unimesh_grad_of", None)
    if grad_of is None:
        return surfacing(torch.compile(fn, **options))
    inner, around = grad_of
    exc = torch._dynamo.exc
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):  # a dynamo that cannot
        return around(surfacing(torch.compile(inner, **options)))  # trace autograd.grad
    # a code object of its own: every value_and_grad step shares its wrapper's code, and
    # dynamo's recompile limit (8) counts per code object
    own = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    whole = surfacing(torch.compile(own, **{**options, "fullgraph": True}))
    split: list[Callable[..., Any]] = []
    breaks = (exc.Unsupported, getattr(exc, "FailOnRecompileLimitHit", exc.Unsupported))

    def step(*args: Any) -> Any:
        if split:
            return split[0](*args)
        try:
            with _tracing_autograd(torch):
                return whole(*args)
        except breaks as err:
            if isinstance(err.__cause__, getattr(exc, "ObservedException", ())):
                return fn(*args)  # the step's own error, raised as it is (a bad batch, say)
            import warnings

            warnings.warn(
                "unimesh.compile: this value_and_grad step does not compile as one graph "
                f"({str(err).splitlines()[0]}); it runs as the loss compiled and its gradient "
                "taken by autograd outside the graph from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            split.append(around(surfacing(torch.compile(inner, **options))))
        return split[0](*args)

    step.__name__ = getattr(fn, "__name__", "step")
    # for tests: whether the gradient is still compiled in the step's graph
    step.unimesh_whole = lambda: not split  # type: ignore[attr-defined]
    return step


#: steps running with dynamo's ``trace_autograd_ops`` on, and the setting before the first
_AUTOGRAD_TRACED: list[Any] = [0, False]
_AUTOGRAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _tracing_autograd(torch: Any) -> Iterator[None]:
    """dynamo's ``trace_autograd_ops`` on while a compiled value_and_grad step runs (it is
    read while dynamo traces: the first call, a recompile), and put back once no such step
    runs in any thread; the user's other compiled code keeps its own setting otherwise."""
    config = torch._dynamo.config
    with _AUTOGRAD_LOCK:
        if _AUTOGRAD_TRACED[0] == 0:
            _AUTOGRAD_TRACED[1] = config.trace_autograd_ops
            config.trace_autograd_ops = True
        _AUTOGRAD_TRACED[0] += 1
    try:
        yield
    finally:
        with _AUTOGRAD_LOCK:
            _AUTOGRAD_TRACED[0] -= 1
            if _AUTOGRAD_TRACED[0] == 0:
                config.trace_autograd_ops = _AUTOGRAD_TRACED[1]


def traced_permute(x: Any, group: Any, sources: tuple[int | None, ...]) -> Any:
    """``TorchGroup.permute`` as ``funcol.permute_tensor``, which takes a whole permutation (each
    rank sends to one and receives from one, in the group's ranks): a member that sends
    nothing is paired with one that receives nothing, and what that one gets is zeros."""
    collectives = funcol()
    n = group.size
    dest: list[int | None] = [None] * n
    for i, s in enumerate(sources):
        if s is not None:
            dest[s] = i
    idle = iter([i for i, s in enumerate(sources) if s is None])
    rank_of = group.ranks.index  # a member's rank within the process group
    src_dst = [0] * n
    for i, d in enumerate(dest):
        src_dst[rank_of(group.members[i])] = rank_of(group.members[next(idle) if d is None else d])
    # its split sizes are numel() along dim 0, so it permutes flat tensors: flattened here
    flat = collectives.permute_tensor(x.detach().contiguous().reshape(-1), src_dst, group.pg)
    out = flat.reshape(x.shape)
    if sources[group.members.index(group.rank)] is None:
        return import_torch().zeros_like(out)
    return out
