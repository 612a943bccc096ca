"""The README's example runs, and each value its comments show is what the call returns."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from .support.launch import WORKERS, free_port, require_mpirun, run_bounded, run_ranks

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_prints_what_it_shows():
    """Run as a script, the example prints each value its comments show, in order."""
    import contextlib
    import io

    block = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    lines = [ln for ln in block.splitlines() if "backend=" not in ln]  # needs a plugin installed
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n".join(lines), "README.md", "exec"), {})  # noqa: S102 - the README runs
    printed = out.getvalue().splitlines()
    shown = [ln.partition("#")[2].strip() for ln in lines if ln.startswith("print(")]
    assert len(printed) == len(shown) >= 8, (printed, shown)
    for got, comment in zip(printed, shown):
        assert comment.startswith(got), (got, comment)


# -- the multi-process lines, run as written under their launchers ---------------------------
WORKER = WORKERS / "readme_worker.py"
LIMIT = 240  # twice what 8 ranks take on a loaded 2-core machine


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("UNIMESH_BACKEND", "XLA_FLAGS")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _results(out_dir: Path, n: int, output: str) -> list[dict]:
    files = sorted(out_dir.glob("rank*.json"))
    assert [f.name for f in files] == sorted(f"rank{i}.json" for i in range(n)), output[-4000:]
    return [json.loads(f.read_text()) for f in files]


def test_readme_under_torchrun(tmp_path):
    """`to_native(mesh, backend="torch")` and `initialize()`/`verify(mesh)` with nothing
    imported first: unimesh finds torchrun and starts the process group itself."""
    pytest.importorskip("torch.distributed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8"]
    rc, out = run_bounded(
        [*cmd, str(WORKER), "1", str(tmp_path)], _env(GLOO_SOCKET_IFNAME="lo"), LIMIT
    )
    assert rc == 0, out[-6000:]
    for r in _results(tmp_path, 8, out):
        assert r["imported_before"] == [] and r["world"] == 8, r
        assert (r["launcher"], r["backend"], r["native"]) == ("torchrun", "torch", "DeviceMesh"), r
        assert r["native_mesh"] == "Mesh(dp=2, tp=4)", r


def test_readme_under_jax_distributed(tmp_path):
    pytest.importorskip("jax")
    address = f"127.0.0.1:{free_port()}"
    envs = [
        _env(
            JAX_COORDINATOR_ADDRESS=address,
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
            JAX_PLATFORMS="cpu",
            # CPU devices per process are fixed before JAX starts, as on a real host
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
        )
        for i in range(2)
    ]
    codes, outs, _ = run_ranks([sys.executable, str(WORKER), "0", str(tmp_path)], envs, LIMIT)
    assert codes == [0, 0], "\n---\n".join(o[-3000:] for o in outs)
    for r in _results(tmp_path, 2, "\n".join(outs)):
        assert r["imported_before"] == [] and r["world"] == 2, r
        assert (r["launcher"], r["backend"]) == ("jax.distributed", "jax"), r


def test_readme_under_mpirun(tmp_path):
    pytest.importorskip("mlx.core")
    mpirun = require_mpirun()
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "8", sys.executable]
    rc, out = run_bounded([*cmd, str(WORKER), "0", str(tmp_path)], _env(), LIMIT)
    assert rc == 0, out[-6000:]
    for r in _results(tmp_path, 8, out):
        assert r["imported_before"] == [] and r["world"] == 8, r
        assert (r["launcher"], r["backend"]) == ("mpirun", "mlx"), r
