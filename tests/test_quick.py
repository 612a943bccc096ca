"""The quick tier (``python -m pytest -m quick``): every public call once, on every installed
backend, in this one process, checked against numpy or the framework's own answer.

The full suite checks each call in depth (hypothesis, the frameworks' own test suites, real
launchers); this tour is what a newcomer runs first: every call reached, in a few minutes. Other
modules mark their fast, framework-free tests ``quick`` too (``pytestmark``).
"""

from __future__ import annotations

import importlib.util
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import Layout, LayoutMap, Mesh, P

pytestmark = pytest.mark.quick

_FRAMEWORK = {"jax": "jax", "torch": "torch", "mlx": "mlx", "keras": "keras",
              "tensorflow": "tensorflow"}  # fmt: skip
INSTALLED = [
    name
    for name in unimesh.backends()
    if name in _FRAMEWORK and importlib.util.find_spec(_FRAMEWORK[name]) is not None
]
#: backends that run shard_map programs (one device per process on torch and MLX: here, one)
PROGRAMS = [name for name in ("jax", "torch", "mlx") if name in INSTALLED]


@pytest.fixture(scope="module")
def torch_world() -> Iterator[None]:
    """A one-process gloo world for torch (left as found)."""
    if "torch" not in INSTALLED:
        yield
        return
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()


def _mesh(backend: str) -> Mesh:
    """JAX and Keras: 8 devices as (dp=4, tp=2); TF: 8 logical CPUs; torch and MLX: this one
    process, as (dp=1, tp=1)."""
    if backend == "tensorflow":
        from unimesh_tensorflow import configure_cpu_devices

        configure_cpu_devices(8)
    if backend in ("jax", "keras", "tensorflow"):
        return Mesh((4, 2), ("dp", "tp"))
    return Mesh((1, 1), ("dp", "tp"))


def _host(x: Any, backend: str) -> np.ndarray:
    return np.asarray(unimesh.full_array(x, backend=backend), dtype=np.float64)


# -- the core: no framework ------------------------------------------------------------------
def test_mesh_layout_rules_and_text_forms() -> None:
    mesh = unimesh.make_mesh({"dp": 2, "tp": -1}, 8)
    assert mesh == Mesh.from_string(mesh.to_string()) == Mesh.from_json(mesh.to_json())
    assert mesh.groups("tp")[0] == (0, 1, 2, 3) and mesh.coords(5) == {"dp": 1, "tp": 1}
    assert mesh.submesh("tp", containing=5).device_ids.tolist() == [4, 5, 6, 7]
    assert mesh.flatten(("dp", "tp"), "all").shape == (8,)
    with mesh:
        assert unimesh.current_mesh() is mesh
    lay = Layout(mesh, P("dp", "tp"))
    assert lay.shard_slices((8, 8), 5) == (slice(4, 8), slice(2, 4))
    assert Layout.from_placements(mesh, lay.placements(), 2) == lay
    assert isinstance(lay.placements()[0], unimesh.Shard)
    rules = LayoutMap(mesh, {r".*kernel": P(None, "tp")})
    assert rules.get("dense/kernel") == Layout(mesh, P(None, "tp"))
    axis_rules = unimesh.AxisRules([("batch", "dp"), ("embed", "tp")])
    assert axis_rules.spec(("batch", "embed")) == P("dp", "tp")
    config = unimesh.load_config({"mesh": "dp=2,tp=4", "layout": {"w": "_,tp"}})
    assert unimesh.Config.from_json(config.to_json()) == config
    out = io.StringIO()
    from rich.console import Console

    unimesh.visualize(lay, (8, 8), console=Console(file=out, width=100))
    assert "8" in out.getvalue()
    assert unimesh.detect_launcher({}) is None


def test_registry_calls() -> None:
    names = unimesh.backends()
    assert set(INSTALLED) <= set(names)

    class Tiny(unimesh.Backend):
        name = "quick-tiny"
        framework = "json"

        def mesh_to_native(self, mesh: Mesh, **options: Any) -> Any:
            return mesh.to_dict()

        def from_native(self, obj: Any) -> Any:
            return Mesh.from_dict(obj)

    unimesh.register_backend(Tiny())
    try:
        mesh = Mesh((2,), ("x",))
        assert (
            unimesh.get_backend("quick-tiny").from_native(unimesh.to_native(mesh, "quick-tiny"))
            == mesh
        )
        assert unimesh.get_backend("quick-tiny").supports("mesh")
        with pytest.raises(unimesh.UnsupportedError, match="distribute"):
            unimesh.distribute(np.zeros(2), Layout(mesh, P()), "quick-tiny")
    finally:
        unimesh.unregister_backend("quick-tiny")
    unimesh.refresh_backends()
    with pytest.raises(unimesh.BackendNotFoundError):
        unimesh.get_backend("no-such-backend")


def test_cli_commands(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from unimesh.cli import main

    assert main(["show", "dp=2,tp=4", "--layout", "dp,tp", "--shape", "8,8"]) == 0
    assert main(["backends"]) == 0
    assert main(["convert", "dp=2,tp=4", "--to", INSTALLED[0], "--code"]) in (0, None)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    unimesh.save(tmp_path / "ck", {"x": x})
    assert main(["checkpoint", "show", str(tmp_path / "ck"), "--json"]) == 0
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 0
    assert "x" in capsys.readouterr().out


# -- every backend ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", INSTALLED)
def test_translate_distribute_and_back(backend: str, torch_world: None) -> None:
    mesh = _mesh(backend)
    native = unimesh.to_native(mesh, backend)
    assert unimesh.from_native(native) == mesh or backend == "mlx"
    lay = Layout(mesh, P("dp", "tp"))
    assert unimesh.to_native(lay, backend) is not None
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    dist = unimesh.distribute(x, lay, backend)
    blocks = unimesh.local_shards(dist, backend)
    for device, block in blocks.items():
        np.testing.assert_array_equal(np.asarray(block), x[lay.shard_slices(x.shape, device)])
    again = unimesh.from_local(blocks, lay, x.shape, backend)
    if unimesh.get_backend(backend).supports("shard_map"):
        np.testing.assert_array_equal(_host(again, backend), x)
    if backend == "keras":
        keras_map = unimesh.to_native(LayoutMap(mesh, {"w": P("tp")}), backend)
        assert keras_map["w"] is not None


@pytest.mark.parametrize("backend", PROGRAMS)
def test_programs_every_collective_gradient_and_compile(backend: str, torch_world: None) -> None:
    mesh = _mesh(backend)
    dp, tp = mesh.axis_size("dp"), mesh.axis_size("tp")
    x = np.arange(8 * tp * 2, dtype=np.float32).reshape(8, 2 * tp) / 10

    def body(b: Any) -> Any:
        s = unimesh.psum(b, "tp") + unimesh.pmean(b, "dp") - unimesh.pmax(b, "tp")
        s = s + unimesh.pmin(b, "dp") * 0 + unimesh.axis_size("tp") * 0
        g = unimesh.all_gather(b, "tp", axis=1, tiled=True)
        r = unimesh.psum_scatter(g, "tp", scatter_dimension=1, tiled=True)
        a = unimesh.all_to_all(b, "tp", 1, 1, tiled=True)
        p = unimesh.ppermute(b, "tp", [(i, (i + 1) % tp) for i in range(tp)])
        c = unimesh.pbroadcast(b, "tp", 0)
        k = unimesh.stop_gradient(b) * (1 + unimesh.axis_index("tp"))
        return s + r + a + p + c + k * 0

    program = unimesh.shard_map(body, mesh, P("dp", "tp"), P("dp", "tp"), backend=backend)
    got = _host(program(x), backend)
    assert got.shape == x.shape and np.isfinite(got).all()
    if dp == tp == 1:  # one device: every collective is the identity on its block
        np.testing.assert_allclose(got, 5 * x, rtol=1e-6)

    total = unimesh.shard_map(
        lambda b: unimesh.psum((b * b).sum(), ("dp", "tp")), mesh, P("dp", "tp"), P(),
        backend=backend,
    )  # fmt: skip
    arg = unimesh.distribute(x, Layout(mesh, P("dp", "tp")), backend)
    value, grad = unimesh.value_and_grad(total, backend=backend)(arg)
    np.testing.assert_allclose(_host(value, backend), (x.astype(np.float64) ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(_host(grad, backend), 2 * x, rtol=1e-5)
    only = unimesh.grad(total, backend=backend)(arg)
    np.testing.assert_allclose(_host(only, backend), 2 * x, rtol=1e-5)
    options = {"backend": "aot_eager"} if backend == "torch" else {}
    step = unimesh.compile(program, backend=backend, compiler_options=options)
    np.testing.assert_allclose(_host(step(arg), backend), got, rtol=1e-6)


@pytest.mark.parametrize("backend", [b for b in ("jax", "torch", "mlx", "keras") if b in INSTALLED])
def test_shard_params(backend: str, torch_world: None) -> None:
    mesh = _mesh(backend)
    rules = LayoutMap(mesh, {r".*w.*": P("tp")} if backend != "keras" else {".*": P()})
    if backend == "jax":
        model: Any = {"w": np.ones((4,), np.float32)}
    elif backend == "torch":
        import torch

        model = torch.nn.Linear(4, 2)
        rules = LayoutMap(mesh, {"weight": P("tp", None)})
    elif backend == "mlx":
        from mlx import nn

        model = nn.Linear(4, 2)
        rules = LayoutMap(mesh, {"weight": P("tp", None)})
    else:
        import keras

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    placed = unimesh.shard_params(model, rules, backend=backend)
    assert placed is not None


@pytest.mark.parametrize(
    "backend", [b for b in INSTALLED if unimesh.get_backend(b).supports("checkpoint")]
)
def test_save_load_and_open_checkpoint(backend: str, torch_world: None, tmp_path: Path) -> None:
    mesh = _mesh(backend)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    tree = {"w": unimesh.distribute(x, Layout(mesh, P("dp", "tp")), backend)}
    unimesh.save(tmp_path / "a", tree, backend=backend)
    unimesh.async_save(tmp_path / "b", tree, backend=backend).wait()
    stats: dict[str, int] = {}
    back = unimesh.load(tmp_path / "b", {"w": Layout(mesh, P("tp"))}, backend=backend, stats=stats)
    blocks = unimesh.local_shards(back["w"], backend)
    for device, block in blocks.items():
        want = x[Layout(mesh, P("tp")).shard_slices(x.shape, device)]
        np.testing.assert_array_equal(np.asarray(block), want)
    ckpt = unimesh.open_checkpoint(tmp_path / "a")
    np.testing.assert_array_equal(ckpt.read("w"), x)
    assert json.loads(json.dumps(stats)) == stats


@pytest.mark.parametrize("backend", INSTALLED)
def test_reshard(backend: str, torch_world: None) -> None:
    """unimesh.reshard to another spec and onto a mesh of the devices in reverse order: every
    block the target's, bit for bit, with this process's bytes counted (none received: one
    process)."""
    mesh = _mesh(backend)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    source = Layout(mesh, P("dp", "tp"))
    placed = unimesh.distribute(x, source, backend)
    reverse = Mesh((mesh.size,), ("x",), device_ids=mesh.device_ids.ravel()[::-1].tolist())
    for target in (Layout(mesh, P("tp", None)), Layout(reverse, P(None, "x"))):
        stats: dict[str, int] = {}
        moved = unimesh.reshard(placed, target, stats=stats)
        for device, block in unimesh.local_shards(moved, backend).items():
            np.testing.assert_array_equal(
                np.asarray(block), x[target.shard_slices(x.shape, device)]
            )
        assert stats["bytes_received"] == 0 and stats["bytes_sent"] == 0


@pytest.mark.parametrize("backend", PROGRAMS)
def test_one_process_runtime(backend: str, torch_world: None) -> None:
    """initialize and verify in one process (the real launches are in the full suite)."""
    rank, count = unimesh.initialize(backend)
    assert (rank, count) == (0, 1)
    unimesh.verify(Mesh((1,), ("x",)), backend)
