"""Programs on a mesh: ``shard_map``, gradients, compiling, gathering.

The meaning is JAX's ``jax.shard_map``: the function sees each device's block of every input
(the block :meth:`Layout.shard_slices` names), and the blocks it returns are put back together
as ``out_specs`` say; a mesh axis missing from an output spec promises the value is the same
along that axis. Arguments, results and specs are pytrees (optree: tuples, lists, dicts,
namedtuples, None), a spec standing for every array leaf below it. Inside the function the
collectives of :mod:`unimesh.collectives` work over mesh axes by name with ``jax.lax``'s
meaning, on every backend that declares ``shard_map``. :func:`value_and_grad` and :func:`grad`
differentiate a function of global arrays with the backend's own autodiff.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .backend import Backend
from .errors import ConversionError, LayoutError
from .layout import Layout
from .mesh import Mesh
from .mesh_input import check_axes
from .messages import short
from .program import Body, Program, SpecTree

__all__ = ["compile", "full_array", "grad", "shard_map", "stop_gradient", "value_and_grad"]


def compile(
    fn: Callable[..., Any],
    *,
    backend: str | Backend | None = None,
    compiler_options: dict[str, Any] | None = None,
    **options: Any,
) -> Callable[..., Any]:
    """``fn``, a step written with unimesh, compiled by the backend's own compiler: ``jax.jit``
    (JAX, Keras on JAX), ``torch.compile`` (torch), ``mx.compile`` (MLX). Framework-agnostic
    code compiles without naming its framework. ``options`` go to that compiler as they are
    (``donate_argnums=...``, ``fullgraph=True``, ``shapeless=True``); an option whose name is
    ``backend`` (torch.compile's ``backend="aot_eager"``) goes in ``compiler_options``.

    On MLX the compiled function takes and returns :class:`unimesh_mlx.MLXArray` values as
    the step does: ``mx.compile`` accepts only trees of ``mx.array`` and constants, so each
    MLXArray is handed to it as its block, and its layout and global shape (static, like a
    jitted function's shapes) select the compiled trace. Eager and compiled steps give the
    same values and gradients.
    """
    from .registry import get_backend

    if not callable(fn):
        raise LayoutError(f"compile() needs a function, got {short(fn)}")
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise LayoutError(
            f"compile() compiler_options is a dict of the compiler's options, got "
            f"{short(compiler_options)}"
        )
    be = get_backend(backend)
    return be.compile(fn, {**(compiler_options or {}), **options})


def stop_gradient(x: Any) -> Any:
    """``x`` (an array or a pytree of them) as a constant for differentiation: the same
    values, no gradient through them (``jax.lax.stop_gradient``, torch's ``detach()``,
    ``mx.stop_gradient``, ``keras.ops.stop_gradient``), inside :func:`shard_map` or outside.
    A numerically stable loss-parallel softmax shifts by ``pmax(stop_gradient(x), axis)``
    (``pmax`` has no derivative). numpy arrays and Python numbers pass through."""
    import optree

    from .registry import owner_of

    def one(leaf: Any) -> Any:
        if isinstance(leaf, (np.ndarray, np.generic, int, float, complex, bool)) or leaf is None:
            return leaf
        try:
            owner = owner_of(leaf)
        except ConversionError:
            raise ConversionError(
                f"stop_gradient() got {short(leaf)} ({type(leaf).__qualname__}): give a "
                "backend's arrays (jax, torch, MLX, Keras), numpy or Python numbers, or a "
                "pytree of them"
            ) from None
        return owner.stop_gradient(leaf)

    return optree.tree_map(one, x, none_is_leaf=True)


_MISSING: Any = object()


def shard_map(
    f: Callable[..., Any],
    mesh: Mesh | None = None,
    in_specs: Any = _MISSING,
    out_specs: Any = _MISSING,
    backend: str | Backend | None = None,
    *,
    axis_names: Any = None,
    check_vma: bool = True,
    checked: bool | None = None,
) -> Callable[..., Any]:
    """``f`` run on every device's blocks (``jax.shard_map``'s meaning), on any backend.

    Args:
        f: takes one block per array leaf of the arguments and returns a pytree of blocks; it
            may call :func:`psum` and the other axis collectives.
        mesh: the neutral mesh; None takes the context's (``with mesh:``, or on JAX
            ``jax.set_mesh``).
        in_specs: a pytree prefix of the argument tuple with ``P(...)`` leaves (None means
            ``P()``): one ``P`` for all arguments, a tuple with one per argument, or deeper
            (a dict of specs for a dict of parameters). Arguments are global arrays, or the
            backend's distributed arrays.
        out_specs: a pytree prefix of the result with ``P`` leaves; a mesh axis an output spec
            leaves out promises that the blocks along it are equal.
        backend: a name or Backend; None detects it (see :func:`unimesh.get_backend`).
        axis_names: the mesh axes ``f`` is manual over (a set of names; None: all of them).
            Over the others ``f`` is automatic: specs and collectives may name only manual
            axes, and the value along the automatic axes is the global one (JAX lets its
            compiler shard it; per-process backends compute it replicated there).
        check_vma: JAX's flag: True tracks which axes each value varies along (an out_spec
            leaving out an axis the value varies along is refused, a ``psum`` of an
            invariant value is transposed to nothing); False uses JAX's unchecked rules,
            which give the same values and gradients for programs both accept.
        checked: on backends with one device per process, check before every collective that
            all processes of the mesh call the same one (operation, axes, dtype, shape), and
            raise :class:`~unimesh.MeshMismatchError` on every process naming what differs
            instead of hanging. None (default): the ``UNIMESH_CHECKED`` environment variable
            (``1`` turns it on). Off, it costs nothing; on, one small all-gather per collective.

    Returns:
        A function of the global arguments that returns the backend's distributed arrays
        (``jax.Array``, torch ``DTensor``, ``unimesh_mlx.MLXArray``) in the result's tree.
    """
    from .convert import require_layout, require_mesh
    from .registry import get_backend

    if not callable(f):
        raise LayoutError(f"shard_map() needs a function, got {short(f)}")
    for name, given in (("in_specs", in_specs), ("out_specs", out_specs)):
        if given is _MISSING:
            raise LayoutError(
                f"shard_map() needs {name}: a P(...) or a pytree prefix of P's, e.g. "
                f"shard_map(f, mesh, in_specs=P('dp'), out_specs=P('dp'))"
            )
    if not isinstance(check_vma, bool):
        raise LayoutError(f"shard_map() check_vma must be True or False, got {short(check_vma)}")
    be = get_backend(backend)
    be.require("shard_map")
    if mesh is None:
        mesh = _context_mesh(be)
    if not isinstance(mesh, Mesh):
        raise LayoutError(f"shard_map() needs a unimesh.Mesh, got {short(mesh)}")
    manual = _manual_axes(mesh, axis_names)
    ins = SpecTree(mesh, in_specs, "in_specs")
    outs = SpecTree(mesh, out_specs, "out_specs")
    if manual is not None:
        for tree in (ins, outs):
            for layout in tree.layouts:
                auto = [a for a in (*layout.spec.axes(), *layout.spec.partial) if a not in manual]
                if auto:
                    raise LayoutError(
                        f"{tree.what} {layout.spec!r} names axis {auto[0]!r}, which is not in "
                        f"axis_names {sorted(manual)}: a spec may name only the axes the "
                        f"function is manual over; add {auto[0]!r} to axis_names or drop it "
                        "from the spec"
                    )
    require_mesh(be, mesh)
    for layout in set(ins.layouts + outs.layouts):
        require_layout(be, layout)
    if checked is None:
        import os

        checked = os.environ.get("UNIMESH_CHECKED", "") not in ("", "0")
    body = Body(f, outs)
    body.checked = bool(checked)
    body.manual = manual
    body.check_vma = check_vma
    run = be.shard_map(body, mesh, ins, outs)
    flat = run.run_flat if isinstance(run, Program) else None
    n_in = len(in_specs) if isinstance(in_specs, (tuple, list)) else None
    seen: set[tuple[int, tuple[int, ...]]] = set()

    def call(*args: Any) -> Any:
        if n_in is not None and len(args) != n_in:
            raise LayoutError(
                f"the shard_map of {getattr(f, '__name__', 'f')} takes "
                f"{n_in} argument(s) (one per in_spec), got {len(args)}"
            )
        import optree

        leaves, treedef = optree.tree_flatten(args)  # type: ignore[arg-type,var-annotated]
        layouts = ins.for_leaves(args, treedef)
        for i, (leaf, layout) in enumerate(zip(leaves, layouts)):
            shape = getattr(leaf, "shape", None)  # global shapes; each checked once
            if layout is not None and shape is not None:
                key = (i, tuple(shape))
                try:
                    new = key not in seen
                except TypeError:  # symbolic sizes (torch.compile's dynamic shapes)
                    _check_even(layout, key[1], i)
                    continue
                if new:
                    _check_even(layout, key[1], i)
                    seen.add(key)
        if flat is not None:  # the per-process engine: no second flattening
            return flat(leaves, treedef, layouts)
        return run(*args)

    call.__name__ = getattr(f, "__name__", "shard_map")
    call.__doc__ = getattr(f, "__doc__", None)
    call.unimesh_program = run  # type: ignore[attr-defined]  # the backend's, for inspection
    return be.program_entry(call)


def _context_mesh(be: Backend) -> Mesh:
    """The mesh of the context: ``with mesh:``, else the backend's own (``jax.set_mesh``)."""
    from .mesh import current_mesh

    mesh = current_mesh()
    if mesh is None:
        mesh = be.context_mesh()
    if mesh is None:
        raise LayoutError(
            "shard_map() got mesh=None and no mesh is current: pass the mesh, or call it "
            "inside `with mesh:`"
        )
    return mesh


def _manual_axes(mesh: Mesh, axis_names: Any) -> frozenset[str] | None:
    """``axis_names`` checked against the mesh (None: manual over every axis)."""
    if axis_names is None:
        return None
    if isinstance(axis_names, str) or not isinstance(axis_names, (set, frozenset, tuple, list)):
        raise LayoutError(
            f"shard_map() axis_names must be a set of mesh axis names, got {short(axis_names)}; "
            f"e.g. axis_names={{{mesh.axis_names[0]!r}}}"
        )
    names = frozenset(check_axes(mesh.axis_names, tuple(axis_names), "shard_map() axis_names"))
    return None if names == frozenset(mesh.axis_names) else names


def _check_even(layout: Layout, shape: tuple[int, ...], index: int) -> None:
    """shard_map splits every argument into equal blocks (JAX's rule, on every backend)."""
    if len(layout.spec) > len(shape):
        raise LayoutError(
            f"shard_map argument {index} has shape {shape}, fewer dims than its "
            f"in_spec {layout.spec!r}"
        )
    if not layout.is_even(shape):
        counts = layout.shard_counts()
        bad = next(d for d, n in enumerate(shape[: len(counts)]) if n % counts[d])
        raise LayoutError(
            f"shard_map argument {index} has shape {shape}: dim {bad} ({shape[bad]}) does not "
            f"split evenly into {counts[bad]} blocks under {layout.spec!r} on {layout.mesh!r}; "
            f"shard_map needs equal blocks: pad dim {bad} to a multiple of {counts[bad]}"
        )


# -- gradients --------------------------------------------------------------------------------
def _argnums(argnums: object) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else argnums
    if (
        not isinstance(nums, tuple)
        or not nums
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nums)
        or len(set(nums)) != len(nums)
    ):
        raise LayoutError(
            f"argnums must be a non-negative int or a tuple of distinct ones, got {short(argnums)}"
        )
    return nums


#: ml_dtypes' floating types (numpy's dtype kind for them is "V")
_ML_FLOATS = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


def host_float(leaf: Any) -> bool:
    """Whether an argument leaf of :func:`value_and_grad` is host data differentiated as
    ``jax.grad`` takes it: a numpy array or scalar of a floating or complex dtype (ml_dtypes'
    bfloat16 and float8 too) or a Python float. A backend differentiates such a leaf as its
    own array made from it (a Python float in the framework's default float dtype); other
    host leaves (integers, strings) stay as they are."""
    if type(leaf) is float:
        return True
    if isinstance(leaf, (np.ndarray, np.generic)):
        return leaf.dtype.kind in "fc" or leaf.dtype.name in _ML_FLOATS
    return False


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    *,
    has_aux: bool = False,
    backend: str | Backend | None = None,
) -> Callable[..., Any]:
    """``fn``'s value and its gradient with respect to the arguments ``argnums``, with the
    backend's own autodiff (``jax.value_and_grad``, torch autograd, ``mx.value_and_grad``).

    ``fn`` takes global arrays or the backend's distributed arrays (pytrees of them) and returns
    a scalar (with ``has_aux``: a pair ``(scalar, aux)``). Through :func:`shard_map` programs
    the gradient is that of the global function the program computes, as ``jax.grad`` gives
    it. Each gradient is laid out like its argument: a sharded parameter gets a gradient
    sharded the same way, a global array a global gradient. Returns ``(value, grads)`` (with
    ``has_aux``: ``((value, aux), grads)``); ``grads`` is one tree, or a tuple of them when
    ``argnums`` is a tuple.
    """
    from .registry import get_backend

    if not callable(fn):
        raise LayoutError(f"value_and_grad() needs a function, got {short(fn)}")
    nums = _argnums(argnums)
    be = get_backend(backend)
    be.require("grad")
    run = be.value_and_grad(fn, nums, bool(has_aux))
    single = isinstance(argnums, int)

    def call(*args: Any) -> Any:
        if max(nums) >= len(args):
            raise LayoutError(
                f"argnums {argnums} names argument {max(nums)}, but "
                f"{getattr(fn, '__name__', 'fn')} was given {len(args)}"
            )
        value, grads = run(*args)
        return value, grads[0] if single else grads

    call.__name__ = getattr(fn, "__name__", "value_and_grad")
    # for compile(): the same step around a compiled fn (torch compiles the function and
    # takes its gradient with autograd outside the graph, as torch.compile users do)
    call.unimesh_grad_of = (  # type: ignore[attr-defined]
        fn,
        lambda compiled: value_and_grad(compiled, argnums, has_aux=has_aux, backend=be),
    )
    return call


def grad(
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    *,
    has_aux: bool = False,
    backend: str | Backend | None = None,
) -> Callable[..., Any]:
    """The gradient of ``fn`` (see :func:`value_and_grad`); with ``has_aux``, ``(grads, aux)``."""
    vg = value_and_grad(fn, argnums, has_aux=has_aux, backend=backend)

    def call(*args: Any) -> Any:
        value, grads = vg(*args)
        return (grads, value[1]) if has_aux else grads

    call.__name__ = getattr(fn, "__name__", "grad")
    call.unimesh_grad_of = (  # type: ignore[attr-defined]
        fn,
        lambda compiled: grad(compiled, argnums, has_aux=has_aux, backend=backend),
    )
    return call


def full_array(array: Any, backend: str | Backend | None = None) -> Any:
    """The whole global value of a backend's distributed array, as a numpy array, on every
    process (``DTensor.full_tensor()``, JAX's process_allgather, MLX world all_gather)."""
    from .registry import get_backend, owner_of

    if array is None or isinstance(array, (list, tuple, dict, str, bytes, int, float, complex)):
        raise ConversionError(
            f"full_array() takes a backend's distributed array (a jax.Array, a DTensor, an "
            f"MLX array from distribute or shard_map), got {short(array)} "
            f"({type(array).__name__})"
        )
    be = get_backend(backend) if backend is not None else owner_of(array)
    return be.full_array(array)
