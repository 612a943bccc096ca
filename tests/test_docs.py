"""The docs: Sphinx builds them with warnings as errors; the code in the quickstart, the porting
guide and the config page runs (under the launcher each block names) and prints what numpy says;
the generated capability matrix agrees with what the backends declare."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import unimesh

from .launch import require_mpirun, run_bounded

DOCS = Path(__file__).parents[1] / "docs"
X = np.arange(32.0).reshape(8, 4)


def blocks(page: str, lang: str) -> list[str]:
    text = (DOCS / page).read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    out.update(OMP_NUM_THREADS="1", **extra)
    return out


def test_sphinx_builds_without_warnings(tmp_path):
    if os.environ.get("CI") is None:
        pytest.importorskip("sphinx")
        pytest.importorskip("myst_parser")
    rc, out = run_bounded(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(tmp_path / "html"),
        ],
        env(),
        300,
        tmp_path,
    )
    assert rc == 0, out[-5000:]
    page = (tmp_path / "html" / "api-mapping.html").read_text()
    assert "jax.lax.psum" in page and "DeviceMesh.get_group" in page
    api = (tmp_path / "html" / "api.html").read_text()
    assert "shard_map" in api and "load_config" in api and "MeshMismatchError" in api
    assert "unimesh.verify" in api and "unimesh.initialize" in api and "LaunchError" in api


def test_generated_matrix_matches_what_backends_declare():
    """docs/_data/capabilities.json comes from a real `unimesh check` run; a backend whose
    declared capabilities changed since then makes this fail until the run is repeated."""
    data = json.loads((DOCS / "_data" / "capabilities.json").read_text())
    from unimesh.conformance import CHECKED

    assert set(data["backends"]) == {"torch", "jax", "keras", "tensorflow", "mlx"}
    for name, run in data["backends"].items():
        assert run["ok"], name
        if name not in unimesh.backends():
            continue
        declared = unimesh.get_backend(name).capabilities
        for cap in CHECKED:
            cell = run["cells"][cap]
            assert cell["verdict"] == run["matrix"][cap] and cell["failed"] == 0, (name, cap)
            if cap not in declared:
                assert cell["verdict"] == "not declared", (name, cap, cell)
            elif cell["refused"]:  # a declared capability with a refused case is not a pass
                assert cell["verdict"] == "refused" and cell["reasons"], (name, cap, cell)
            else:
                assert cell["verdict"] == "pass" and cell["passed"] > 0, (name, cap, cell)
    # torch refuses layouts on meshes whose device order is not increasing: the matrix shows it
    torch = data["backends"]["torch"]["cells"]
    assert torch["distribute"]["verdict"] == "refused", torch["distribute"]
    assert all("device order is not increasing" in why for why in torch["distribute"]["reasons"])


def test_benchmark_data_has_every_section():
    data = json.loads((DOCS / "_data" / "benchmarks.json").read_text())
    titles = [s["title"] for s in data["sections"]]
    assert titles == [
        "Import cost",
        "to_native overhead",
        "The core at 1,048,576 devices",
        "Program step overhead",
        "Example programs: training step",
    ]
    assert all(s["rows"] for s in data["sections"])
    programs = {(r["backend"].split()[0], r["program"]) for r in data["sections"][-1]["rows"]}
    assert programs == {
        (b, p) for b in ("jax", "torch") for p in ("fsdp", "tp_sp", "moe", "pipeline")
    }


def test_quickstart_runs(tmp_path):
    pytest.importorskip("jax")
    code = "\n".join(blocks("quickstart.md", "python"))
    code += (
        "\nassert unimesh.from_native(x.sharding) == layout\n"
        "print(json.dumps(unimesh.full_array(row_sums(x)).ravel().tolist()))\n"
    )
    script = tmp_path / "quickstart.py"
    script.write_text("import json\n" + code)
    rc, out = run_bounded(
        [sys.executable, str(script)],
        env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        120,
        tmp_path,
    )
    assert rc == 0, out[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == X.sum(axis=1).tolist()


def _porting(tmp_path: Path, index: int) -> Path:
    code = blocks("porting.md", "python")[index]
    ast.parse(code)
    path = tmp_path / f"porting_{index}.py"
    path.write_text(code)
    return path


def _rank_sums(out: str, nproc: int) -> None:
    """Every rank printed its rows' sums over tp: rank r holds rows 4*(r//4) .. +4."""
    found = dict(re.findall(r"rank (\d+) sums (\[[^\]]*\])", out))
    assert sorted(map(int, found)) == list(range(nproc)), out[-3000:]
    for rank, sums in found.items():
        dp = int(rank) // 4
        assert json.loads(sums) == X[4 * dp : 4 * dp + 4].sum(axis=1).tolist(), (rank, sums)


def test_porting_torch(tmp_path):
    pytest.importorskip("torch.distributed")
    rc, out = run_bounded(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=8",
            str(_porting(tmp_path, 0)),
        ],
        env(GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")),
        240,
        tmp_path,
    )
    assert rc == 0, out[-3000:]
    _rank_sums(out, 8)


def test_porting_jax(tmp_path):
    pytest.importorskip("jax")
    rc, out = run_bounded(
        [sys.executable, str(_porting(tmp_path, 1))],
        env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        120,
        tmp_path,
    )
    assert rc == 0, out[-3000:]
    (sums,) = re.findall(r"sums (\[[^\]]*\])", out)
    assert json.loads(sums) == X.sum(axis=1).tolist()


def test_porting_mlx(tmp_path):
    pytest.importorskip("mlx.core")
    mpirun = require_mpirun()
    rc, out = run_bounded(
        [
            mpirun,
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "8",
            sys.executable,
            str(_porting(tmp_path, 2)),
        ],
        env(),
        240,
        tmp_path,
    )
    assert rc == 0, out[-3000:]
    _rank_sums(out, 8)


@pytest.mark.parametrize("backend", ["jax", "torch", "mlx"])
def test_porting_unimesh_version_on_every_backend(backend, tmp_path):
    """The unimesh block, unchanged, under each framework's launcher: every process prints the
    whole result (full_array), the row sums."""
    script = str(_porting(tmp_path, 3))
    if backend == "jax":
        pytest.importorskip("jax")
        cmd, nproc = [sys.executable, script, "--backend", "jax"], 1
        extra = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    elif backend == "torch":
        pytest.importorskip("torch.distributed")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=8",
            script,
            "--backend",
            "torch",
        ]
        nproc, extra = 8, {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    else:
        pytest.importorskip("mlx.core")
        launch = Path(sys.executable).with_name("mlx.launch")
        cmd = [
            str(launch),
            "-n",
            "8",
            "--backend",
            "ring",
            "--",
            sys.executable,
            script,
            "--backend",
            "mlx",
        ]
        nproc, extra = 8, {}
    rc, out = run_bounded(cmd, env(**extra), 240, tmp_path)
    assert rc == 0, out[-3000:]
    sums = re.findall(r"sums (\[[^\]]*\])", out)
    assert len(sums) == nproc, out[-3000:]
    assert all(json.loads(s) == X.sum(axis=1).tolist() for s in sums), sums


def test_config_page_example(tmp_path):
    toml, rule_list = blocks("configs.md", "toml")
    listed = unimesh.Config.from_toml('mesh = "batch=2,fsdp=2,model=2"\n' + rule_list)
    # flax.linen.logical_to_mesh_axes gives the same (tests/test_axis_rules.py compares them)
    assert listed.axis_rules.spec(("embed", "mlp")) == unimesh.P("fsdp", "model")
    assert listed.axis_rules.spec(("norm", "embed")) == unimesh.P(None, ("fsdp", "model"))
    assert unimesh.Config.from_json(listed.to_json()) == listed
    path = tmp_path / "dist.toml"
    path.write_text(toml)
    config = unimesh.load_config(path)
    assert config.mesh == unimesh.Mesh((2, 4), ("batch", "model"))
    assert config.layout_map.get("block_1/dense/kernel").spec == unimesh.P(None, "model")
    assert config.axis_rules.spec(("batch", "mlp")) == unimesh.P("batch", "model")
    assert unimesh.Config.from_json(config.to_json()) == config


def test_writing_a_backend_starts_from_a_backend_that_runs_and_names_every_hook():
    """The guide's smallest backend is real code (run here, then unregistered), and every hook
    and feature of the contract appears in the guide."""
    text = (DOCS / "writing-a-backend.md").read_text()
    first = text.split("```python\n", 1)[1].split("```", 1)[0]
    try:
        exec(compile(first, "writing-a-backend.md", "exec"), {})  # noqa: S102 - our own docs
        assert unimesh.get_backend("dict").layers() == ("translator",)
    finally:
        unimesh.unregister_backend("dict")
    for layer in unimesh.LAYERS:
        for hook in layer.all_hooks:
            assert f"`{hook}" in text, hook
    for feature in unimesh.FEATURES:
        assert f"`{feature}`" in text, feature
