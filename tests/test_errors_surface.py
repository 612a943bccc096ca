"""The bad-input catalogue beyond the core's constructors (tests/test_errors.py): the registry,
programs, configs, the runtime and every backend. Each case asserts the error class and that
the message names the offending value (and, where there is one, the fix)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import (
    AxisContextError,
    BackendNotFoundError,
    BackendRegistrationError,
    ConfigError,
    ConversionError,
    Layout,
    LayoutError,
    LayoutMap,
    Mesh,
    MeshMismatchError,
    MeshSpecError,
    P,
    UnsupportedError,
)

M = Mesh((2, 4), ("dp", "tp"))
BIG = Mesh((4, 4), ("a", "b"))


def _sm(*args: Any, **kw: Any) -> Any:
    return unimesh.shard_map(*args, **kw)


def _keras(name: str) -> Any:
    import unimesh_keras

    return getattr(unimesh_keras, name)


def _torch_axis_mesh() -> Any:
    import unimesh_torch

    return unimesh_torch.axis_mesh(M, "dp")


# (id, the backend it needs or None, call, error class, fragments the message must contain)
CASES: list[tuple[str, str | None, Callable[[], Any], type[Exception], tuple[str, ...]]] = [
    # registry
    (
        "get_backend-unknown",
        None,
        lambda: unimesh.get_backend("caffe"),
        BackendNotFoundError,
        ("'caffe'", "installed backends"),
    ),
    ("get_backend-type", None, lambda: unimesh.get_backend(3), BackendNotFoundError, ("got 3",)),
    (
        "to_native-object",
        "jax",
        lambda: unimesh.to_native(3, "jax"),
        ConversionError,
        ("got 3 (int)", "Mesh, Layout or LayoutMap"),
    ),
    (
        "from_native-object",
        None,
        lambda: unimesh.from_native("dp=2"),
        ConversionError,
        ("'dp=2'", "no installed backend converts"),
    ),
    (
        "distribute-layout",
        "jax",
        lambda: unimesh.distribute(np.ones(4), "dp", "jax"),
        LayoutError,
        ("got 'dp'", "unimesh.Layout(mesh, P(...))"),
    ),
    (
        "distribute-array",
        "jax",
        lambda: unimesh.distribute([1, 2], Layout(M, P("dp")), "jax"),
        ConversionError,
        ("got [1, 2]", ".shape"),
    ),
    (
        "register-object",
        None,
        lambda: unimesh.register_backend(3),
        BackendRegistrationError,
        ("got 3 (int)",),
    ),
    (
        "initialize-unknown",
        None,
        lambda: unimesh.initialize("caffe"),
        BackendNotFoundError,
        ("'caffe'",),
    ),
    (
        "initialize-timeout",
        "jax",
        lambda: unimesh.initialize("jax", timeout=0),
        unimesh.UnimeshError,
        ("got 0", "seconds > 0"),
    ),
    ("verify-mesh", "jax", lambda: unimesh.verify(3, "jax"), MeshMismatchError, ("got 3",)),
    (
        "verify-layout",
        "jax",
        lambda: unimesh.verify(M, "jax", layout="dp"),
        LayoutError,
        ("got 'dp'",),
    ),
    (
        "verify-too-big",
        "jax",
        lambda: unimesh.verify(Mesh((8, 8), ("a", "b")), "jax"),
        MeshMismatchError,
        ("uses device 63", "8 devices"),
    ),
    # programs
    (
        "psum-outside",
        None,
        lambda: unimesh.psum(np.ones(2), "dp"),
        AxisContextError,
        ("unimesh.psum('dp')", "inside the function given to unimesh.shard_map"),
    ),
    (
        "axis_index-outside",
        None,
        lambda: unimesh.axis_index("tp"),
        AxisContextError,
        ("unimesh.axis_index('tp')",),
    ),
    (
        "all_gather-outside",
        None,
        lambda: unimesh.all_gather(np.ones(2), "tp"),
        AxisContextError,
        ("'tp'",),
    ),
    (
        "shard_map-function",
        "jax",
        lambda: _sm(3, M, P("dp"), P("dp"), backend="jax"),
        LayoutError,
        ("needs a function, got 3",),
    ),
    (
        "shard_map-mesh",
        "jax",
        lambda: _sm(len, "dp=2", P("dp"), P("dp"), backend="jax"),
        LayoutError,
        ("needs a unimesh.Mesh, got 'dp=2'",),
    ),
    (
        "shard_map-axis",
        "jax",
        lambda: _sm(len, M, P("zz"), P("dp"), backend="jax"),
        LayoutError,
        ("'zz'", "the axes are ('dp', 'tp')"),
    ),
    (
        "shard_map-spec-type",
        "jax",
        lambda: _sm(len, M, 5, P("dp"), backend="jax"),
        LayoutError,
        ("got 5",),
    ),
    (
        "shard_map-arg-count",
        "jax",
        lambda: _sm(len, M, (P("dp"),), P("dp"), backend="jax")(np.ones(4), np.ones(4)),
        LayoutError,
        ("takes 1 argument(s)", "got 2"),
    ),
    (
        "shard_map-uneven",
        "jax",
        lambda: _sm(lambda x: x, M, P("dp"), P("dp"), backend="jax")(np.ones(3)),
        LayoutError,
        ("shape (3,)", "dim 0 (3)", "pad dim 0 to a multiple of 2"),
    ),
    (
        "shard_map-rank",
        "jax",
        lambda: _sm(lambda x: x, M, P("dp", "tp"), P("dp"), backend="jax")(np.ones(4)),
        LayoutError,
        ("shape (4,)", "P('dp', 'tp')"),
    ),
    (
        "shard_map-tensorflow",
        "tensorflow",
        lambda: _sm(len, M, P("dp"), P("dp"), backend="tensorflow"),
        UnsupportedError,
        ("'tensorflow'", "'shard_map'"),
    ),
    (
        "shard_params-rules",
        "jax",
        lambda: unimesh.shard_params({"w": np.ones(4)}, 3, mesh=M, backend="jax"),
        LayoutError,
        ("got 3", "LayoutMap or unimesh.AxisRules"),
    ),
    (
        "shard_params-axisrules-mesh",
        "jax",
        lambda: unimesh.shard_params(
            {"w": np.ones(4)}, unimesh.AxisRules([("b", "dp")]), backend="jax"
        ),
        LayoutError,
        ("needs mesh=",),
    ),
    # configs
    ("config-type", None, lambda: unimesh.load_config(3.5), ConfigError, ("got 3.5",)),
    (
        "config-key",
        None,
        lambda: unimesh.Config.from_dict({"mesh": "a=2", "colour": 1}),
        ConfigError,
        ("'colour'", "valid keys"),
    ),
    (
        "config-batch-axis",
        None,
        lambda: unimesh.Config.from_dict({"mesh": "a=2", "batch_axis": "b"}),
        ConfigError,
        ("'b'", "choose one of ['a']"),
    ),
    (
        "config-layout-axis",
        None,
        lambda: unimesh.Config.from_dict({"mesh": "a=2", "layout": {"w": ["b"]}}),
        LayoutError,
        ("rule 'w'", "'b'"),
    ),
    (
        "config-mesh",
        None,
        lambda: unimesh.Config.from_dict({"mesh": "a=0"}),
        MeshSpecError,
        ("config mesh", "got 0"),
    ),
    (
        "make_mesh-two-inferred",
        None,
        lambda: unimesh.make_mesh({"dp": -1, "tp": -1}, num_devices=8),
        MeshSpecError,
        ("'dp' and 'tp'",),
    ),
    (
        "make_mesh-indivisible",
        None,
        lambda: unimesh.make_mesh({"dp": 3, "tp": -1}, num_devices=8),
        MeshSpecError,
        ("8 / 3", "num_devices=8"),
    ),
    # JAX
    (
        "jax-uneven",
        "jax",
        lambda: unimesh.distribute(np.ones((3, 4)), Layout(M, P("dp")), "jax"),
        UnsupportedError,
        ("shape (3, 4)", "'uneven_shards'", "pad the tensor"),
    ),
    (
        "jax-option",
        "jax",
        lambda: unimesh.to_native(M, "jax", colour="red"),
        UnsupportedError,
        ("['colour']",),
    ),
    (
        "jax-too-many-devices",
        "jax",
        lambda: unimesh.to_native(BIG, "jax"),
        MeshMismatchError,
        ("uses device 15", "xla_force_host_platform_device_count=16"),
    ),
    (
        "jax-from-native",
        "jax",
        lambda: unimesh.get_backend("jax").from_native(3),
        ConversionError,
        ("3",),
    ),
    # Keras
    (
        "keras-tuple-axes",
        "keras",
        lambda: unimesh.to_native(Layout(M, P(("dp", "tp"))), "keras"),
        UnsupportedError,
        ("P(('dp', 'tp'))", "Mesh.flatten"),
    ),
    (
        "keras-distribution-mesh",
        "keras",
        lambda: _keras("distribution")("dp"),
        ConversionError,
        ("got 'dp'",),
    ),
    (
        "keras-distribution-batch",
        "keras",
        lambda: _keras("distribution")(M, batch_dim_name="batch"),
        LayoutError,
        ("'batch'",),
    ),
    (
        "keras-layoutmap-mesh",
        "keras",
        lambda: _keras("distribution")(M, LayoutMap(Mesh((8,), ("x",)))),
        LayoutError,
        ("Mesh(x=8)",),
    ),
    # TensorFlow
    (
        "tf-tuple-axes",
        "tensorflow",
        lambda: unimesh.to_native(Layout(M, P(("dp", "tp"))), "tensorflow"),
        UnsupportedError,
        ("'tensorflow'", "P(('dp', 'tp'))"),
    ),
    (
        "tf-partial",
        "tensorflow",
        lambda: unimesh.to_native(Layout(M, P("dp", partial={"tp": "sum"})), "tensorflow"),
        UnsupportedError,
        ("partial={'tp': 'sum'}",),
    ),
    (
        "tf-uneven",
        "tensorflow",
        lambda: unimesh.distribute(np.ones((3, 4)), Layout(M, P("dp")), "tensorflow"),
        UnsupportedError,
        ("shape (3, 4)",),
    ),
    (
        "tf-too-many-devices",
        "tensorflow",
        lambda: unimesh.to_native(BIG, "tensorflow"),
        MeshMismatchError,
        ("uses device 15", "configure_cpu_devices(16)"),
    ),
    (
        "tf-from-native",
        "tensorflow",
        lambda: unimesh.get_backend("tensorflow").from_native(3),
        ConversionError,
        ("3",),
    ),
    # torch (this pytest process has no process group)
    (
        "torch-no-process-group",
        "torch",
        lambda: unimesh.to_native(M, "torch"),
        MeshMismatchError,
        ("not initialized", "torchrun --nproc-per-node N"),
    ),
    ("torch-axis-mesh", "torch", _torch_axis_mesh, MeshMismatchError, ("torchrun",)),
    (
        "torch-from-native",
        "torch",
        lambda: unimesh.get_backend("torch").from_native(3),
        ConversionError,
        ("not 3 (builtins.int)",),
    ),
    # MLX (one process here)
    (
        "mlx-world",
        "mlx",
        lambda: unimesh.to_native(M, "mlx"),
        MeshMismatchError,
        ("needs 8 MLX processes", "mpirun --allow-run-as-root -np 8", "mlx.launch -n 8"),
    ),
    (
        "mlx-partial",
        "mlx",
        lambda: unimesh.to_native(Layout(M, P("dp", partial={"tp": "sum"})), "mlx"),
        UnsupportedError,
        ("'mlx'", "'partial'"),
    ),
    (
        "mlx-from-native",
        "mlx",
        lambda: unimesh.get_backend("mlx").from_native(3),
        ConversionError,
        ("3",),
    ),
]


@pytest.mark.parametrize(
    "needs, call, cls, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input(
    needs: str | None, call: Callable[[], Any], cls: type[Exception], fragments: tuple[str, ...]
) -> None:
    if needs is not None and needs not in unimesh.backends():
        pytest.skip(f"backend {needs!r} is not installed")
    with pytest.raises(cls) as info:
        call()
    assert isinstance(info.value, unimesh.UnimeshError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_the_whole_catalogue_is_large_and_covers_every_backend() -> None:
    from .support import error_cases

    assert len(CASES) + len(error_cases.CASES) >= 80
    assert len({c[0] for c in CASES}) == len(CASES)
    covered = {c[1] for c in CASES}
    assert {"jax", "keras", "tensorflow", "torch", "mlx"} <= covered
    assert all(re.fullmatch(r"[a-z0-9_-]+", c[0]) for c in CASES)
