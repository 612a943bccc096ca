"""`unimesh convert --code [--layout]` prints idiomatic native code; each backend's code is run
(torch under torchrun, MLX under mpirun) and what it builds converts back to the same mesh and
layout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import unimesh

from .support.launch import require_mpirun, run_bounded
from .support.launch import run_cli as run

LIMIT = 240
CASES = [("dp=2,tp=2", "dp,tp"), ("dp=2,tp=2;ids=3,1,2,0", "tp,None"), ("a=4", "a")]
EIGHT = "import os\nos.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'\n"
PRELUDE = {
    "jax": EIGHT,
    "keras": EIGHT + "os.environ['KERAS_BACKEND'] = 'jax'\n",
    "tensorflow": "import unimesh_tensorflow\nunimesh_tensorflow.configure_cpu_devices(4)\n",
}
LAYOUT_NAME = {"jax": "sharding", "keras": "layout", "tensorflow": "layout"}


def code(spec: str, backend: str, layout: str | None = None) -> str:
    args = ["convert", spec, "--to", backend, "--code"] + (["--layout", layout] if layout else [])
    proc = run(*args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "UNIMESH_BACKEND")}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return out


def test_default_order_is_written_with_the_idiomatic_constructor():
    assert "init_device_mesh(\"cpu\", (2, 2), mesh_dim_names=('dp', 'tp'))" in code(
        "dp=2,tp=2", "torch"
    )
    jax_code = code("dp=2,tp=2", "jax")
    assert "jax.make_mesh((2, 2), ('dp', 'tp'), axis_types=(AxisType.Auto, AxisType.Auto))" in (
        jax_code
    )
    assert "dp: Auto, tp: Auto (jax.make_mesh's default would be Explicit)" in jax_code
    explicit = code("dp=2,tp=2;types=explicit,auto", "jax")
    assert "axis_types=(AxisType.Explicit, AxisType.Auto)" in explicit
    assert "devices=keras.distribution.list_devices())" in code("dp=2,tp=2", "keras")
    permuted = code("dp=2,tp=2;ids=3,1,2,0", "torch")
    assert 'DeviceMesh("cpu", torch.tensor([[3, 1], [2, 0]])' in permuted
    assert "init_device_mesh cannot express" in permuted
    placements = code("dp=2,tp=4", "torch", "tp+dp")
    assert "placements = (_StridedShard(0, split_factor=4), Shard(0))" in placements


@pytest.mark.parametrize("backend", ["jax", "keras", "tensorflow"])
def test_printed_code_runs_and_converts_back(backend: str, tmp_path: Path):
    if backend not in unimesh.backends():
        pytest.skip(f"backend {backend!r} is not installed")
    checks = []
    for i, (spec, layout) in enumerate(CASES):
        if backend != "jax" and ";ids" not in spec and "+" in layout:
            continue
        text = code(spec, backend, layout).replace("\nmesh = ", f"\nmesh_{i} = mesh = ")
        name = LAYOUT_NAME[backend]
        checks.append(
            text + f"\nassert unimesh.from_native(mesh) == unimesh.Mesh.from_string({spec!r}), "
            "unimesh.from_native(mesh)\n"
            f"assert unimesh.from_native({name}) == unimesh.Layout(unimesh.Mesh.from_string("
            f"{spec!r}), parse_spec({layout!r})), unimesh.from_native({name})\n"
        )
    program = (
        PRELUDE[backend]
        + "import unimesh\nfrom unimesh.cli.show import parse_spec\n"
        + "\n".join(checks)
        + f"\nprint('SAME', {len(checks)})\n"
    )
    path = tmp_path / "program.py"
    path.write_text(program)
    rc, out = run_bounded([sys.executable, str(path)], env(), LIMIT)
    assert rc == 0 and f"SAME {len(checks)}" in out, (program, out[-4000:])


def _launched_program(body: str, tmp_path: Path, rank_expr: str) -> Path:
    path = tmp_path / "program.py"
    path.write_text(
        body
        + "\nimport json, pathlib\n"
        + f"pathlib.Path({str(tmp_path)!r}, f'rank{{{rank_expr}}}.json').write_text("
        "json.dumps(result))\n"
    )
    return path


def _ranks(tmp_path: Path, n: int, out: str) -> list[dict]:
    files = sorted(tmp_path.glob("rank*.json"))
    assert len(files) == n, out[-4000:]
    return [json.loads(f.read_text()) for f in files]


def test_torch_code_runs_under_torchrun(tmp_path: Path):
    pytest.importorskip("torch.distributed")
    body = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
    body += "import unimesh\nfrom unimesh import Layout, Mesh\n"
    body += "from unimesh.cli.show import parse_spec\nresult = {}\n"
    for i, (spec, layout) in enumerate(CASES):
        body += code(spec, "torch", layout) + "\n"
        body += (
            f"got = unimesh.from_native(mesh)\n"
            f"want = Mesh.from_string({spec!r})\n"
            f"lay = Layout.from_placements(got, placements, len(parse_spec({layout!r})))\n"
            f"result[{i}] = [got == want, lay == Layout(want, parse_spec({layout!r}))]\n"
        )
    path = _launched_program(body, tmp_path, "dist.get_rank()")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    rc, out = run_bounded([*cmd, str(path)], {**env(), "GLOO_SOCKET_IFNAME": "lo"}, LIMIT)
    assert rc == 0, out[-6000:]
    for r in _ranks(tmp_path, 4, out):
        assert all(all(v) for v in r.values()) and len(r) == len(CASES), r


def test_mlx_code_runs_under_mpirun(tmp_path: Path):
    pytest.importorskip("mlx.core")
    mpirun = require_mpirun()
    spec, layout = "dp=2,tp=2;ids=3,1,2,0", "tp+dp,None"
    body = code(spec, "mlx", layout) + (
        "\nimport unimesh\nfrom unimesh import Layout, Mesh\n"
        "from unimesh.cli.show import parse_spec\n"
        f"lay = Layout(Mesh.from_string({spec!r}), parse_spec({layout!r}))\n"
        "result = {'groups': [dp_group.size() == 2, tp_group.size() == 2]}\n"
        "for shape in [(8, 3), (7, 2), (3, 5), (1, 1)]:\n"
        "    x = np.arange(int(np.prod(shape))).reshape(shape)\n"
        "    result[str(shape)] = all(\n"
        "        np.array_equal(block(x, r), x[lay.shard_slices(shape, r)]) for r in range(4)\n"
        "    )\n"
    )
    path = _launched_program(body, tmp_path, "rank")
    path.write_text(path.read_text() + "del dp_group, tp_group  # as the printed code says\n")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable]
    rc, out = run_bounded([*cmd, str(path)], env(), LIMIT)
    assert rc == 0, out[-6000:]
    for r in _ranks(tmp_path, 4, out):
        assert all(r["groups"]) and all(v for k, v in r.items() if k != "groups"), r


def test_layout_without_code_prints_the_native_layout():
    proc = run("convert", "dp=2,tp=2", "--to", "jax", "--layout", "dp")
    assert proc.returncode == 0, proc.stderr
    assert "layout:\nNamedSharding(" in proc.stdout and "spec=P('dp',)" in proc.stdout
    bad = run("convert", "dp=2,tp=2", "--to", "jax", "--layout", "zz")
    assert bad.returncode == 2 and "'zz'" in bad.stderr
    keras = run("convert", "dp=2,tp=2", "--to", "keras", "--code", "--layout", "dp+tp")
    assert keras.returncode == 2 and "tuple_axes" in keras.stderr


def test_the_cli_page_shows_what_convert_prints():
    page = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    shown = page.split("--code --layout dp,tp` prints:\n\n```python\n", 1)[1].split("```", 1)[0]
    assert shown == code("dp=2,tp=4", "jax", "dp,tp")
