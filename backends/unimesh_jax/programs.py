"""The JAX backend's program layer: ``jax.shard_map`` with the collectives of ``jax.lax``,
``jax.value_and_grad``, ``jax.jit`` and ``shard_params``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np

from unimesh import ConversionError, LayoutError, Mesh
from unimesh.messages import short
from unimesh.program import AxisEnv

from .runtime import import_jax
from .translate import JaxTranslator
from .transport import JAX_ARRAYS, JaxArrays, JaxTransport


def key_path(path: Any) -> str:
    """A JAX key path as ``a/b/0`` (how :func:`unimesh.shard_params` names pytree leaves)."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts)


@functools.cache
def _is_concrete() -> Any:
    """JAX's ``is_concrete`` (internal: None where a JAX version lacks it), looked up once."""
    import_jax()
    from jax._src import core  # JAX's internals, read only here

    return getattr(core, "is_concrete", None)


def _concrete(args: Any) -> bool:
    """Whether every leaf of ``args`` is numpy or a ``jax.Array`` whose value is known now:
    outside any trace, or under an eager ``jax.grad`` / ``jax.jvp`` (not under ``jax.jit``,
    ``vmap`` or another staging trace). Such a call runs jitted: the same values, but the
    body is traced (docs/programs.md says what that changes for its Python code). JAX's own
    test for it (``is_concrete``) is not public: without it, none is."""
    jax = import_jax()
    known = _is_concrete()
    if known is None:
        return False
    leaves = jax.tree_util.tree_leaves(args)
    return all(
        isinstance(leaf, np.ndarray) or (isinstance(leaf, jax.Array) and known(leaf))
        for leaf in leaves
    )


class JaxAxisEnv(AxisEnv):
    """Axis collectives as ``jax.lax`` calls on the named axes of the enclosing shard_map."""

    @staticmethod
    def _varying(x: Any, axes: tuple[str, ...]) -> Any:
        """``x`` marked as varying along ``axes`` where JAX tracks it as equal there: a psum of
        a value equal along an axis is its size times the value on every backend, and JAX's
        own check would refuse the call instead."""
        jax = import_jax()
        x = jax.numpy.asarray(x)
        aval = jax.typeof(x)
        kinds = getattr(aval, "manual_axis_type", None)  # JAX 0.10; older JAX: aval.vma
        vma = kinds.varying if kinds is not None else getattr(aval, "vma", None)
        missing = tuple(a for a in axes if vma is not None and a not in vma)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    def psum(self, x: Any, axes: tuple[str, ...]) -> Any:
        return import_jax().lax.psum(self._varying(x, axes), axes)

    def pmax(self, x: Any, axes: tuple[str, ...]) -> Any:
        return import_jax().lax.pmax(self._varying(x, axes), axes)

    def pmin(self, x: Any, axes: tuple[str, ...]) -> Any:
        return import_jax().lax.pmin(self._varying(x, axes), axes)

    def all_gather(
        self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool, invariant: bool
    ) -> Any:
        """``lax.all_gather``; ``invariant``: JAX knows the result is equal along ``axes``
        (``to="invarying"``), so an out_spec may leave those axes out, as after a psum."""
        return import_jax().lax.all_gather(
            self._varying(x, axes),
            axes,
            axis=dim,
            tiled=tiled,
            to="invarying" if invariant else "varying",
        )

    def psum_scatter(self, x: Any, axes: tuple[str, ...], dim: int, tiled: bool) -> Any:
        return import_jax().lax.psum_scatter(
            self._varying(x, axes), axes, scatter_dimension=dim, tiled=tiled
        )

    def all_to_all(
        self, x: Any, axes: tuple[str, ...], split_axis: int, concat_axis: int, tiled: bool
    ) -> Any:
        """``lax.all_to_all``; untiled as the tiled one on the split dim moved to the front
        (JAX 0.10's transpose of an untiled all_to_all with split != concat fails with a
        cotangent shape error)."""
        jax = import_jax()
        x = self._varying(x, axes)
        if tiled:
            return jax.lax.all_to_all(x, axes, split_axis, concat_axis, tiled=True)
        front = jax.numpy.moveaxis(x, split_axis, 0)
        return jax.numpy.moveaxis(jax.lax.all_to_all(front, axes, 0, 0, tiled=True), 0, concat_axis)

    def ppermute(self, x: Any, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> Any:
        """``lax.ppermute``. JAX numbers the devices of a tuple of axes in mesh order there
        (unlike its own ``axis_index`` and ``all_gather``, which follow the tuple's order), so
        indices are translated when the tuple is not in mesh order."""
        ordered = tuple(sorted(axes, key=self.mesh.axis_names.index))
        if ordered != axes:
            sizes = [self.mesh.axis_size(a) for a in axes]

            def in_mesh_order(index: int) -> int:
                coords = dict(zip(axes, np.unravel_index(index, sizes)))
                return int(
                    np.ravel_multi_index(
                        [coords[a] for a in ordered], [self.mesh.axis_size(a) for a in ordered]
                    )
                )

            perm = tuple((in_mesh_order(a), in_mesh_order(b)) for a, b in perm)
        return import_jax().lax.ppermute(self._varying(x, ordered), ordered, perm)

    def pbroadcast(self, x: Any, axes: tuple[str, ...], source: int) -> Any:
        """A psum of the source's value and zeros elsewhere (``lax.pbroadcast`` has no CPU
        lowering in JAX 0.10); JAX differentiates it to a sum at the source."""
        jax = import_jax()
        x = self._varying(x, axes)
        mine = jax.numpy.where(jax.lax.axis_index(axes) == source, x, jax.numpy.zeros_like(x))
        return jax.lax.psum(mine, axes)

    def axis_index(self, axes: tuple[str, ...]) -> Any:
        return import_jax().lax.axis_index(axes)


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Any]:
    """Make ``mesh`` current for unimesh and for JAX (``jax.set_mesh``); yields the JAX mesh."""
    import unimesh

    native = unimesh.to_native(mesh, "jax")
    with mesh, import_jax().set_mesh(native):
        yield native


class JaxPrograms(JaxTranslator):
    """The program layer: unimesh programs are ``jax.shard_map`` programs."""

    def arrays(self) -> JaxArrays:
        return JAX_ARRAYS

    def transport(self) -> JaxTransport:
        return JaxTransport(self)

    def stop_gradient(self, x: Any) -> Any:
        return import_jax().lax.stop_gradient(x)

    def compile(self, fn: Any, options: dict[str, Any]) -> Any:
        """``jax.jit(fn, **options)``: a unimesh step's programs are ``jax.shard_map``."""
        return import_jax().jit(fn, **options)

    # -- programs --------------------------------------------------------------------------------
    def shard_map(self, body: Any, mesh: Mesh, ins: Any, outs: Any) -> Any:
        """``jax.shard_map`` over the converted mesh, with the body's ``axis_names`` and
        ``check_vma`` (on: JAX checks that an output is equal along the axes its spec leaves
        out; its refusal is raised as :class:`~unimesh.LayoutError`, JAX's words kept). Jit
        the result as usual."""
        jax = import_jax()
        env = JaxAxisEnv(mesh)
        options: dict[str, Any] = {"check_vma": body.check_vma}
        if body.manual is not None:
            options["axis_names"] = set(body.manual)
        program = jax.shard_map(
            lambda *blocks: body(env, *blocks),
            mesh=self.mesh_to_native(mesh),
            in_specs=ins.map(self._spec),
            out_specs=outs.map(self._spec),
            **options,
        )
        if body.manual is not None:
            # a partial-manual program runs jitted, as JAX's own tests run them: JAX 0.10.2's
            # eager path of one under a gradient builds an inner shard_map whose out_specs
            # name the automatic axes, and refuses it (seen with check_vma=False)
            program = jax.jit(program)
        eager = jax.jit(program)
        compiled = [True]  # emptied once the body turns out to need values in Python
        reads_values = (
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerArrayConversionError,
            jax.errors.TracerIntegerConversionError,
        )

        def run(*args: Any) -> Any:
            try:
                # called on arrays whose values are known (eagerly, or under an eager
                # gradient), the program runs as one compiled XLA computation (what a user's
                # jax.jit gives; its gradient is jit's), not op by op as jax.shard_map's eager
                # path does; under a staging trace (its arguments that trace's tracers) it
                # is the bare shard_map, so a user's jit lowers to the StableHLO of the same
                # step written with jax.shard_map (a call inside a jit on closed-over
                # constants only is a nested jit: the same values)
                if compiled and _concrete(args):
                    try:
                        return eager(*args)
                    except reads_values:  # the body reads a value in Python (an `if` on
                        # it): jax.shard_map's eager path from now on, as JAX would run it
                        compiled.clear()
                return program(*args)
            except ValueError as exc:
                if "out_specs" not in str(exc) or isinstance(exc, LayoutError):
                    raise
                raise LayoutError(str(exc)) from exc

        return run

    def context_mesh(self) -> Mesh | None:
        """The mesh ``jax.set_mesh`` made current, as a neutral mesh (None outside one)."""
        import sys

        if "jax" not in sys.modules:
            return None
        mesh = import_jax().sharding.get_mesh()
        if mesh is None or getattr(mesh, "empty", True):
            return None
        found = self.from_native(mesh)
        return found if isinstance(found, Mesh) else None

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], has_aux: bool) -> Any:
        """``jax.value_and_grad``; each gradient is placed like its argument."""
        jax = import_jax()
        vg = jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux)

        def placed(g: Any, a: Any) -> Any:
            sharding = getattr(a, "sharding", None)
            if sharding is None or isinstance(g, jax.core.Tracer) or g.sharding == sharding:
                return g
            return jax.device_put(g, sharding)

        def run(*args: Any) -> Any:
            value, grads = vg(*args)
            return value, tuple(
                jax.tree_util.tree_map(placed, g, args[i]) for g, i in zip(grads, argnums)
            )

        return run

    def full_array(self, array: Any) -> Any:
        """numpy of a ``jax.Array``; gathered from every process when not all addressable."""
        if getattr(array, "is_fully_addressable", True):
            return np.asarray(array)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    def param_paths(self, model: Any) -> list[tuple[str, tuple[int, ...]]]:
        """Each leaf's key path (``a/b/0``) and shape."""
        leaves = import_jax().tree_util.tree_flatten_with_path(model)[0]
        return [(key_path(path), tuple(np.shape(leaf))) for path, leaf in leaves]

    def shard_params(self, model: Any, resolve: Any) -> Any:
        """A new pytree whose leaves are placed by ``resolve(path, shape)``; a path joins the
        key entries with ``/`` (dict keys, attribute names, sequence indices)."""
        jax = import_jax()

        def place(path: Any, leaf: Any) -> Any:
            host = np.asarray(leaf)
            if host.dtype.kind not in "biufc":
                where = key_path(path) or "(the root)"
                raise ConversionError(
                    f"shard_params() lays out a pytree of arrays; leaf {where!r} is "
                    f"{short(leaf)} ({type(leaf).__name__}); pass the parameters' pytree"
                )
            return self.distribute(host, resolve(key_path(path), host.shape))

        return jax.tree_util.tree_map_with_path(place, model)
