"""Models, not just trees (issue 36, item 5): ``unimesh.save(path, model)`` and
``unimesh.load(path, model)`` for a torch ``nn.Module`` of DTensors (FSDP2 x TP saved, loaded
into a TP-only module under torchrun 4), an ``mlx.nn.Module`` whose Linear layers MLX's own
``shard_linear`` made (mpirun 4: each rank reads only its shard, the layers compute the right
values, and the module saves back as global tensors), a Keras model under ModelParallel fit
with ``unimesh_keras.CheckpointCallback`` and loaded into a model under another distribution
(variables keep their layouts: no gather), and a flax pytree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import CheckpointError

from .support.launch import WORKERS, worker_output

WORKER = WORKERS / "model_worker.py"
LIMIT = 300


def _launch(mode: str, out: Path) -> str:
    return worker_output(WORKER, mode, [mode, str(out)], LIMIT)


def _reports(out: Path, mode: str, ranks: int, output: str) -> list[dict[str, Any]]:
    found = []
    for rank in range(ranks):
        path = out / f"{mode}-rank-{rank}.json"
        assert path.exists(), output[-4000:]
        report = json.loads(path.read_text())
        assert not report["errors"], f"{mode} rank {rank}: {report['errors']}"
        found.append(report)
    return found


@pytest.fixture(scope="module")
def torch_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("models")
    return out, _launch("torch", out)


@pytest.mark.timeout(3 * LIMIT)
def test_a_torch_module_saves_and_loads_into_another_parallel_layout(
    torch_saved: tuple[Path, str],
) -> None:
    out, output = torch_saved
    for report in _reports(out, "torch", 4, output):
        assert report["read"] <= 1.05 * report["held"], report
        # the tensor-parallel weights were filled in their own memory (host_views)
        assert report["in_place"] == ["block.wo.weight", "block.wq.bias", "block.wq.weight"], report
    ck = unimesh.open_checkpoint(out / "model")
    # state_dict names; the FSDP-over-TP weight saved with its strided layout, each block once
    assert "block.wq.weight" in ck.names and "block.steps" in ck.names
    assert len(ck.tensor("block.norm.bias").boxes) == 2  # FSDP's 2 shards, not one per tp rank
    assert ck.tensor("block.steps").dtype == "int64"


@pytest.mark.timeout(3 * LIMIT)
def test_an_mlx_module_of_sharded_linear_layers_loads_only_its_shards(
    torch_saved: tuple[Path, str],
) -> None:
    pytest.importorskip("mlx.core")
    out, _ = torch_saved
    output = _launch("mlx", out)
    total = unimesh.open_checkpoint(out / "model")
    whole = sum(t.nbytes for t in total.tensors.values())
    for report in _reports(out, "mlx", 4, output):
        assert report["read"] <= 1.05 * report["held"], report
        assert report["held"] < whole  # the shards, not the model: what mlx-lm reads
        assert report["max_error"] < 1e-5, report


@pytest.mark.timeout(3 * LIMIT)
def test_a_keras_model_fit_with_the_callback_loads_in_its_own_layouts(tmp_path: Path) -> None:
    pytest.importorskip("keras")
    pytest.importorskip("jax")
    output = _launch("keras", tmp_path)
    (report,) = _reports(tmp_path, "keras", 1, output)
    assert report["saved"] == ["step-2", "step-4"]
    assert report["layouts"]["sequential_1/up/kernel"] == "P('model')"
    ck = unimesh.open_checkpoint(tmp_path / "keras" / "step-2")
    assert sorted(ck.names) == ["down/bias", "down/kernel", "up/bias", "up/kernel"]
    assert repr(ck.layout("up/kernel").spec) == "P(None, 'model')"  # as it was trained
    assert report["read"] <= 1.05 * report["held"]


def test_the_callback_refuses_bad_settings() -> None:
    pytest.importorskip("keras")
    import unimesh_keras

    for every in (0, -1, 1.5, True, "2"):
        with pytest.raises(CheckpointError, match="every"):
            unimesh_keras.CheckpointCallback("ckpt/step-{step}", every=every)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"\{step\}"):
        unimesh_keras.CheckpointCallback("ckpt/latest", every=2)


def test_a_flax_pytree_saves_and_loads_onto_another_mesh(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    nn = pytest.importorskip("flax.linen")
    from unimesh import Layout, LayoutMap, Mesh, P

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(8, name="down")(nn.relu(nn.Dense(32, name="up")(x)))

    params = MLP().init(jax.random.PRNGKey(0), np.ones((2, 16), np.float32))
    mesh = Mesh.from_string("x=4,y=2")
    laid = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(
            a, unimesh.to_native(Layout(mesh, P(None, "x") if a.ndim == 2 else P()), "jax")
        ),
        params,
    )
    unimesh.save(tmp_path / "flax", laid)
    ck = unimesh.open_checkpoint(tmp_path / "flax")
    assert sorted(ck.names) == ["params.down.bias", "params.down.kernel", "params.up.bias",
                                "params.up.kernel"]  # fmt: skip
    other = Mesh.from_string("all=8")
    got = unimesh.load(tmp_path / "flax", LayoutMap(other, {r".*kernel": P("all")}),
                       backend="jax")  # fmt: skip
    for name in ck.names:
        group, layer, leaf = name.split(".")
        assert np.array_equal(np.asarray(got[name]), np.asarray(params[group][layer][leaf]))
    assert unimesh.from_native(got["params.up.kernel"].sharding) == Layout(other, P("all"))
    # a rule target is read as shard_params reads it: a key matching no tensor is refused
    # before a byte is read (here a '/'-joined spelling of a '.'-joined name), or warned of
    wrong = LayoutMap(other, {r".*kernel": P("all"), "params/up/bias": P("all")})
    with pytest.raises(CheckpointError, match=r"1 of 2 LayoutMap keys match no tensor of the "
                       r"checkpoint: 'params/up/bias' \(closest: 'params.up.bias'"):  # fmt: skip
        unimesh.load(tmp_path / "flax", wrong, backend="jax")
    with pytest.warns(UserWarning, match="match no tensor of the checkpoint"):
        again = unimesh.load(tmp_path / "flax", wrong, backend="jax", strict=False)
    assert unimesh.from_native(again["params.up.bias"].sharding) == Layout(other, P())
