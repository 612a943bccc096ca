"""What each framework cannot hold is refused by name on every path (issue 40, item 3): meshes
and layouts of 1 to 64 axes (the core's bound) and TensorFlow DTensor's reserved dim names,
through to_native, distribute and shard_map, on every installed backend. A backend either
takes the mesh (and gives it back from from_native) or raises a UnimeshError naming its limit;
never the framework's own error from inside the conversion."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import Layout, Mesh, P, UnimeshError, UnsupportedError

from .support.torch_fake import fake_torch_world

FRAMEWORK = {"jax": "jax", "keras": "keras", "tensorflow": "tensorflow", "torch": "torch",
             "mlx": "mlx.core"}  # fmt: skip
BACKENDS = [b for b, module in FRAMEWORK.items() if importlib.util.find_spec(module.split(".")[0])]
SHARD_MAP_AT = (1, 16, 32, 33, 64)  # each a compiled program on JAX: a few, not all 64


@contextlib.contextmanager
def world(backend: str) -> Iterator[None]:
    """torch needs a process group for a DeviceMesh: a fake one of one process."""
    if backend == "torch":
        with fake_torch_world(0, 1):
            yield
    else:
        yield


def paths(backend: str, mesh: Mesh, with_shard_map: bool) -> dict[str, Callable[[], Any]]:
    """Every way a mesh reaches the framework, as calls."""
    spec = P(*mesh.axis_names)
    layout = Layout(mesh, spec)
    x = np.zeros((1,) * mesh.ndim, np.float32)
    calls: dict[str, Callable[[], Any]] = {
        "to_native(mesh)": lambda: unimesh.to_native(mesh, backend),
        "to_native(layout)": lambda: unimesh.to_native(layout, backend),
        "distribute": lambda: unimesh.distribute(x, layout, backend),
    }
    be = unimesh.get_backend(backend)
    if with_shard_map and be.supports("shard_map"):
        calls["shard_map"] = lambda: unimesh.shard_map(
            lambda a: a, mesh=mesh, in_specs=(spec,), out_specs=spec, backend=backend
        )(x)
    return calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_to_64_axes_are_held_or_refused_by_name(backend: str) -> None:
    be = unimesh.get_backend(backend)
    limit = be.max_mesh_axes
    with world(backend):
        for n in range(1, 65):
            mesh = Mesh((1,) * n, tuple(f"a{i}" for i in range(n)))
            for where, call in paths(backend, mesh, n in SHARD_MAP_AT).items():
                if limit is None or n <= limit:
                    call()  # held: no error of any kind
                    continue
                with pytest.raises(UnsupportedError) as info:
                    call()
                text = str(info.value)
                assert f"{n} axes" in text and f"({limit})" in text, (where, text)
            if limit is None or n <= limit:
                assert unimesh.from_native(unimesh.to_native(mesh, backend)) == mesh, n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["unsharded", "any", "match"])
def test_tensorflows_reserved_names_on_every_backend(backend: str, name: str) -> None:
    """DTensor reserves these dim names; elsewhere they are ordinary axis names."""
    mesh = Mesh((1, 1), (name, "b"))
    with world(backend):
        for where, call in paths(backend, mesh, True).items():
            if backend != "tensorflow":
                call()
                continue
            with pytest.raises(UnimeshError, match=rf"reserves the dim names.*'{name}'") as info:
                call()
            assert "rename" in str(info.value).lower(), (where, str(info.value))


DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
          "float8_e4m3fn", "<U3", "object", "datetime64[s]"]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_dtype_is_held_bit_exact_or_refused_by_name(backend: str) -> None:
    """numpy's and ml_dtypes' dtypes through distribute: the blocks come back with the same
    bytes, or a UnimeshError says the framework has no such dtype (torch took ml_dtypes'
    bfloat16 to a raw TypeError before)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    mesh = Mesh((1,), ("x",))
    layout = Layout(mesh, P("x"))
    held = []
    with world(backend):
        for name in DTYPES:
            dtype = np.dtype(getattr(ml_dtypes, name, name))
            x = (
                (np.arange(1, 5) % 2).astype(dtype)
                if dtype.kind != "O"
                else np.array([1] * 4, object)
            )
            try:
                out = unimesh.distribute(x, layout, backend)
            except UnimeshError as exc:
                assert str(dtype) in str(exc) or dtype.name in str(exc), (name, str(exc))
                continue
            (block,) = unimesh.local_shards(out).values()
            want = x
            if backend in ("jax", "keras"):  # JAX's own rule: 64-bit types narrowed unless x64
                import jax

                want = x.astype(jax.dtypes.canonicalize_dtype(dtype))
            assert np.asarray(block).tobytes() == want.tobytes(), name
            held.append(name)
    assert {"float32", "int32", "bool"} <= set(held), held
