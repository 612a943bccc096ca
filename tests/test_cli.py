"""The command line: the demo runs and checks itself; user errors print one line and exit 2."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "unimesh", *args], capture_output=True,
                          text=True, timeout=170, check=False)


def row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"│ {name} "))


def test_demo_default_mesh_on_every_installed_backend():
    import unimesh

    proc = run("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Mesh(dp=2, tp=4)" in proc.stdout
    ref = row(proc.stdout, "reference (numpy)")
    assert ref.count(" ok ") == 2 and "FAIL" not in ref
    for name in ("torch", "jax", "keras", "tensorflow", "mlx"):
        assert name in proc.stdout
    for name in unimesh.backends():
        line = row(proc.stdout, name)
        assert "FAIL" not in line, line
        if name in ("jax", "keras", "tensorflow", "torch", "mlx"):  # shards checked, matmul done
            assert line.count(" ok ") == 2, line


def test_demo_permuted_3d_mesh():
    proc = run("demo", "--mesh", "a=2,b=3,c=2;ids=11,10,9,8,7,6,5,4,3,2,1,0",
               "--backends", "jax,keras")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout


def test_bad_spec_is_one_line_and_exit_2():
    proc = run("demo", "--mesh", "dp=2,tp=x")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "cannot read axis 'tp=x'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_backends_command():
    proc = run("backends")
    assert proc.returncode == 0, proc.stderr
