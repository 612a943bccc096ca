"""The docs: Sphinx builds them with warnings as errors; the code in the quickstart, the porting
guide and the config page runs (under the launcher each block names) and prints what numpy says;
the generated capability matrix agrees with what the backends declare."""

from __future__ import annotations

import ast
import html
import inspect
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import unimesh
from unimesh import P

from .support.launch import run_bounded

DOCS = Path(__file__).parents[1] / "docs"
X = np.arange(32.0).reshape(8, 4)


def blocks(page: str, lang: str) -> list[str]:
    text = (DOCS / page).read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    out.update(OMP_NUM_THREADS="1", **extra)
    return out


def test_sphinx_builds_without_warnings(docs_html):
    page = (docs_html / "api-mapping.html").read_text()
    assert "jax.lax.psum" in page and "DeviceMesh.get_group" in page
    api = (docs_html / "api.html").read_text()
    assert "shard_map" in api and "load_config" in api and "MeshMismatchError" in api
    assert "unimesh.verify" in api and "unimesh.initialize" in api and "LaunchError" in api
    # the frameworks' names link to their docs (intersphinx for Sphinx sites, plain links else)
    for link in (
        "https://docs.jax.dev/en/latest/_autosummary/jax.lax.psum.html#jax.lax.psum",
        "https://docs.pytorch.org/docs/stable/distributed.html#"
        + "torch.distributed.device_mesh.DeviceMesh",
        "https://ml-explore.github.io/mlx/build/html/python/_autosummary/"
        + "mlx.core.distributed.all_sum.html#mlx.core.distributed.all_sum",
        "https://keras.io/api/distribution/layout_map/",
        "https://www.tensorflow.org/api_docs/python/tf/experimental/dtensor/Mesh",
    ):
        assert f'href="{link}"' in page, link
    # every capability name is explained on the matrix page
    matrix = (docs_html / "capabilities.html").read_text()
    for name, promise in unimesh.CAPABILITIES.items():
        assert f'<code class="docutils literal notranslate"><span class="pre">{name}' in matrix
        assert html.escape(promise.split("'")[0][:30], quote=False) in matrix, (name, promise)
    # commands are not typeset: no en-dash or curly quote where `--standalone` was written
    pages = {path.name: path.read_text() for path in docs_html.glob("*.html")}
    assert "--standalone" in pages["porting.html"]
    for name, text in pages.items():
        assert "\u2013standalone" not in text and "\u2013nproc" not in text, name
    landing = (docs_html / "index.html").read_text()
    assert ".[jax]" in landing and "A first example" in landing and "Where next" in landing
    # unimesh is not on the index: every install line installs from the clone (issue 40)
    root = DOCS.parent
    for page in [root / "README.md", *DOCS.glob("*.md")]:
        lines = page.read_text().splitlines()  # (error hints, for an installed unimesh, may)
        assert not [ln for ln in lines if 'pip install "unimesh[' in ln and "hint" not in ln]


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
        "Eager build cost",
        "Example programs: training step",
        "Checkpoints",
        "Checkpoints, four processes",
    ]
    assert all(s["rows"] and s["label"] and s["date"] for s in data["sections"])
    by_label = {s["label"]: s for s in data["sections"]}
    programs = {
        (r["backend"].split()[0], r["program"], r["scale"])
        for r in by_label["example programs"]["rows"]
    }
    assert programs == {
        (b, p, k)
        for b in ("jax", "torch")
        for p in ("fsdp", "tp_sp", "moe", "pipeline")
        for k in ("1", "32")
    }
    launches = {r["launch"] for r in by_label["checkpoints 4 processes"]["rows"]}
    assert launches == {"torchrun 4", "mpirun 4"}
    steps = {(r["backend"].split()[0], r["step"]) for r in by_label["step overhead"]["rows"]}
    assert {("torch", "grad/compiled"), ("mlx", "manual/compiled")} <= steps
    builds = {(r["backend"], r["step"]) for r in by_label["build cost"]["rows"]}
    assert builds == {
        ("torch", "manual"),
        ("torch", "ppermute"),
        ("mlx", "manual"),
        ("mlx", "grad"),
    }


def test_the_checkpoint_chart_draws_every_system_with_its_fraction_of_the_limit():
    """docs/_gen.py's SVG: a bar per row with GB/s (object storage aside), its fraction of the
    limit beside it; well-formed XML."""
    import xml.etree.ElementTree as ET

    sys.path.insert(0, str(DOCS))
    try:
        from _gen import checkpoint_chart
    finally:
        sys.path.remove(str(DOCS))
    data = json.loads((DOCS / "_data" / "benchmarks.json").read_text())
    svg = checkpoint_chart(data)
    root = ET.fromstring(svg)
    bars = [e for e in root.iter() if e.tag.endswith("rect")]
    rows = [
        r
        for s in data["sections"]
        if s["label"].startswith("checkpoints")
        for r in s["rows"]
        if isinstance(r.get("GB/s"), (int, float)) and "s3" not in r["system"]
    ]
    assert len(bars) == len(rows) > 20
    texts = " ".join(e.text or "" for e in root.iter() if e.tag.endswith("text"))
    assert "torchrun 4: DCP · DCP load warm" in texts
    assert "of pread warm" in texts and "torch DCP · dcp.save (one process)" in texts


def _run_on_jax(code: str, script: Path) -> str:
    """``code`` as a script with 8 JAX CPU devices: its output (it must exit 0)."""
    script.write_text(code)
    rc, out = run_bounded(
        [sys.executable, str(script)],
        env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        120,
        script.parent,
    )
    assert rc == 0, out[-3000:]
    return out


def test_landing_page_example_runs(tmp_path):
    """The landing page's example prints device 6's block, JAX's sharding and the global sum."""
    pytest.importorskip("jax")
    (code,) = blocks("index.md", "python")
    out = _run_on_jax(code, tmp_path / "landing.py")
    lines = out.strip().splitlines()
    mesh = unimesh.make_mesh({"dp": 2, "tp": 4})
    assert lines[0] == repr(unimesh.Layout(mesh, P("dp", "tp")).shard_slices((8, 4), 6))
    assert lines[1].startswith("NamedSharding(") and "P('dp', 'tp')" in lines[1], lines[1]
    assert float(lines[-1]) == np.ones((8, 4)).sum()
    assert "Warning" not in out, out


def test_quickstart_runs(tmp_path):
    pytest.importorskip("jax")
    code = "\n".join(blocks("quickstart.md", "python"))
    code += (
        "\nassert unimesh.from_native(x.sharding) == layout\n"
        "print(json.dumps(unimesh.full_array(row_sums(x)).ravel().tolist()))\n"
    )
    out = _run_on_jax("import json\n" + code, tmp_path / "quickstart.py")
    assert json.loads(out.strip().splitlines()[-1]) == X.sum(axis=1).tolist()
    assert "Warning" not in out, out  # a new user's first run prints no framework warning


def _porting(tmp_path: Path, index: int, extra: str = "") -> Path:
    code = blocks("porting.md", "python")[index]
    ast.parse(code)
    path = tmp_path / f"porting_{index}.py"
    path.write_text(code + extra)
    return path


def _port_reference() -> tuple[float, dict[str, np.ndarray]]:
    """The porting guide's transformer block on one device in float64 (torch autograd, no
    parallelism): the loss and every parameter's gradient, from the guide's seed and sizes."""
    torch = pytest.importorskip("torch")
    batch, seq, d, heads, ff = 4, 8, 16, 4, 32
    shapes = {
        "attn_norm.weight": (d,),
        **{f"attn.{w}.weight": (d, d) for w in ("wq", "wk", "wv", "wo")},
        "mlp_norm.weight": (d,),
        "mlp.w1.weight": (ff, d),
        "mlp.w2.weight": (d, ff),
    }
    rng = np.random.default_rng(0)
    p = {k: torch.tensor(rng.normal(0, 0.5, s), requires_grad=True) for k, s in shapes.items()}
    x, t = (torch.tensor(rng.standard_normal((batch, seq, d))) for _ in "xt")

    def norm(v, w):  # type: ignore[no-untyped-def]
        return v * torch.rsqrt((v * v).mean(-1, keepdim=True) + 1e-6) * w

    def split(v):  # type: ignore[no-untyped-def]
        return v.reshape(batch, seq, heads, d // heads).transpose(1, 2)

    h = norm(x, p["attn_norm.weight"])
    q, k, v = (split(h @ p[f"attn.{w}.weight"].T) for w in ("wq", "wk", "wv"))
    a = torch.softmax(q @ k.transpose(2, 3) / (d // heads) ** 0.5, dim=-1) @ v
    y = x + a.transpose(1, 2).reshape(batch, seq, d) @ p["attn.wo.weight"].T
    u = norm(y, p["mlp_norm.weight"]) @ p["mlp.w1.weight"].T
    y = y + torch.nn.functional.silu(u) @ p["mlp.w2.weight"].T
    loss = ((y - t) ** 2).mean()
    loss.backward()
    return loss.item(), {k: v.grad.numpy() for k, v in p.items()}


def _check_port(out: str) -> None:
    """The one JSON line process 0 printed: loss and every gradient, to 1e-5 of float64."""
    lines = [line for line in out.splitlines() if line.startswith('{"loss"')]
    assert len(lines) == 1, out[-3000:]
    got = json.loads(lines[0])
    want_loss, want = _port_reference()
    assert abs(got["loss"] - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (got["loss"], want_loss)
    assert sorted(got["grads"]) == sorted(want)
    for name, g in want.items():
        err = np.abs(np.asarray(got["grads"][name]) - g) / np.maximum(1.0, np.abs(g))
        assert err.max() <= 1e-5, (name, err.max())


_PLACEMENTS = """
import os
import unimesh
if os.environ["RANK"] == "0":
    umesh = unimesh.Mesh((2, 2), ("dp", "tp"))
    print("SPECS " + json.dumps({n: repr(unimesh.Layout.from_placements(
        umesh, p.placements, p.ndim).spec) for n, p in model.named_parameters()}))
"""


def test_porting_torch_block(tmp_path):
    """The PyTorch original (parallelize_module + fully_shard) under torchrun: the loss and
    gradients of the float64 reference, and torch's parameter placements are the specs the
    unimesh version gives them."""
    pytest.importorskip("torch.distributed")
    rc, out = run_bounded(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            str(_porting(tmp_path, 0, _PLACEMENTS)),
        ],
        env(GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")),
        300,
        tmp_path,
    )
    assert rc == 0, out[-3000:]
    _check_port(out)
    (specs,) = re.findall(r"^SPECS (\{.*\})$", out, flags=re.MULTILINE)
    module = ast.parse(blocks("porting.md", "python")[1])
    (node,) = [
        n for n in module.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "SPECS"
    ]
    unimesh_specs = eval(compile(ast.Expression(node.value), "porting.md", "eval"), {"P": P})
    assert json.loads(specs) == {k: repr(v) for k, v in unimesh_specs.items()}


@pytest.mark.parametrize("backend", ["jax", "torch", "mlx"])
def test_porting_unimesh_block_on_every_backend(backend, tmp_path):
    """The unimesh version, unchanged, under each framework's launcher: the same loss and
    gradients as the float64 reference (and so as the PyTorch original)."""
    script = str(_porting(tmp_path, 1))
    if backend == "jax":
        pytest.importorskip("jax")
        cmd = [sys.executable, script, "--backend", "jax"]
        extra = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    elif backend == "torch":
        pytest.importorskip("torch.distributed")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            script,
            "--backend",
            "torch",
        ]
        extra = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    else:
        pytest.importorskip("mlx.core")
        launch = Path(sys.executable).with_name("mlx.launch")
        cmd = [str(launch), "-n", "4", "--backend", "ring", "--", sys.executable, script]
        cmd += ["--backend", "mlx"]
        extra = {}
    rc, out = run_bounded(cmd, env(**extra), 300, tmp_path)
    assert rc == 0, out[-3000:]
    _check_port(out)


def _port_on_jax(tmp_path, checkpoint):
    """The guide's unimesh program on 4 JAX devices, dp=4 x tp=1, its weights from
    ``checkpoint``: its output (it must exit 0)."""
    rc, out = run_bounded(
        [sys.executable, str(_porting(tmp_path, 1)), "--backend", "jax", "--mesh", "dp=4,tp=1",
         "--checkpoint", checkpoint],
        env(XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        300,
        tmp_path,
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    return out


def test_porting_torch_dcp_checkpoint_loads_into_the_jax_port_on_another_mesh(tmp_path):
    """Issue 36's porting story: the PyTorch program (FSDP2 x TP) saves with dcp.save; the
    unimesh program, unchanged, loads that checkpoint on JAX with a dp=4 x tp=1 mesh and gives
    the same loss and gradients on the same batch (the float64 reference, to 1e-5)."""
    pytest.importorskip("torch.distributed")
    pytest.importorskip("jax")
    torch_script = _porting(tmp_path, 0)
    rc, out = run_bounded(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         str(torch_script)],
        env(GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")),
        300,
        tmp_path,
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    assert (tmp_path / "ckpt-torch" / ".metadata").exists()
    command = blocks("porting.md", "bash")[0]
    assert "--checkpoint ckpt-torch" in command and "--mesh dp=4,tp=1" in command
    _check_port(_port_on_jax(tmp_path, "ckpt-torch"))
    # the weights do come from the checkpoint: doubled ones give another loss
    ck = unimesh.open_checkpoint(tmp_path / "ckpt-torch")
    assert ck.kind == "dcp"
    unimesh.save(tmp_path / "doubled", {name: 2 * ck.read(name) for name in ck.names})
    with pytest.raises(AssertionError):
        _check_port(_port_on_jax(tmp_path, "doubled"))


def test_porting_loss_parallel_cross_entropy(tmp_path):
    """The guide's loss-parallel cross-entropy (stop_gradient before pmax) on JAX: a finite
    loss and softmax - labels as the gradient, against numpy in float64."""
    pytest.importorskip("jax")
    (code,) = [b for b in blocks("porting.md", "python") if "def xent(" in b]
    out = _run_on_jax(
        code + "\nimport json\nprint(json.dumps({'loss': float(value), "
        "'grad': np.asarray(grad).tolist(), 'logits': logits.tolist()}))\n",
        tmp_path / "loss_parallel.py",
    )
    got = json.loads(out.strip().splitlines()[-1])
    x = np.asarray(got["logits"], dtype=np.float64)
    labels = np.eye(16)[np.arange(8) % 16]
    top = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - top).sum(axis=1, keepdims=True)) + top
    want_loss = float((lse[:, 0] - (x * labels).sum(axis=1)).sum() / 8)
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.exp(x.astype(np.float32)).sum())  # unshifted would overflow
    assert abs(got["loss"] - want_loss) <= 1e-4 * abs(want_loss)
    np.testing.assert_allclose(got["grad"], (np.exp(x - lse) - labels) / 8, atol=1e-6)


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
    sys.path.insert(0, str(DOCS))
    try:
        from _gen import hooks_table
    finally:
        sys.path.remove(str(DOCS))
    assert "{include} _generated/hooks-table.md" in text
    table = hooks_table()
    for layer in unimesh.LAYERS:
        for hook in layer.all_hooks:
            assert f"| `{hook}` | {layer.name} |" in table, hook
    for feature in unimesh.FEATURES:
        assert f"`{feature}`" in text, feature
    # the guide's own tables name hooks of that one table (or helpers), never another spelling
    from unimesh.contract import HELPERS, HOOKS

    named = {h.name for h in HOOKS} | HELPERS
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    called = re.findall(r"`(\w+)\(([^)`]*)\)", " ".join(rows))
    assert called and {n for n, _ in called} <= named, sorted({n for n, _ in called} - named)
    from unimesh.spmd import ProcessBackend

    for name, args in called:  # with its parameters' own names (``**options`` may be left out)
        params = [
            p
            for p in inspect.signature(getattr(ProcessBackend, name)).parameters.values()
            if p.name != "self"
        ]
        given = [a.strip().split("=")[0].lstrip("*") for a in args.split(",") if a.strip()]
        assert given in (
            [p.name for p in params],
            [p.name for p in params if p.kind != p.VAR_KEYWORD],
        ), (name, given)
