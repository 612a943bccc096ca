"""The command line: the demo runs and checks itself; user errors print one line and exit 2."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import unimesh

from .support.launch import run_cli as run


def row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"│ {name} "))


def test_demo_default_mesh_on_every_installed_backend():
    import unimesh

    proc = run("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Mesh(dp=2, tp=4)" in proc.stdout
    ref = row(proc.stdout, "numpy")
    assert ref.count(" ok ") == 2 and "FAIL" not in ref
    for name in ("torch", "jax", "keras", "tensorflow", "mlx"):
        assert name in proc.stdout
    for name in unimesh.backends():
        line = row(proc.stdout, name)
        assert "FAIL" not in line, line
        if name in ("jax", "keras", "tensorflow", "torch", "mlx"):  # shards checked, matmul done
            assert line.count(" ok ") == 2, line


def _tagged(tag: str) -> list[int]:
    """The processes whose environment holds ``UNIMESH_DEMO_TAG=tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"UNIMESH_DEMO_TAG={tag}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to find the processes")
def test_an_interrupted_demo_leaves_no_launched_process(tmp_path):
    """^C while torch's processes run beside JAX's row: the demo ends, and so does every
    process it started (the launcher and its workers), within seconds; the launcher's
    scratch directory is removed."""
    import signal
    import time
    import uuid

    pytest.importorskip("torch.distributed")
    tag = uuid.uuid4().hex
    # ^C's default meaning, whatever this run inherited (a shell's background job, as CI
    # runs this, starts with SIGINT ignored, and Python then keeps ignoring it)
    interruptible = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['unimesh', 'demo', '--backends', 'jax,torch']; "
        "runpy.run_module('unimesh', run_name='__main__')"
    )
    demo = subprocess.Popen(
        [sys.executable, "-c", interruptible],
        env=dict(os.environ, UNIMESH_DEMO_TAG=tag, TMPDIR=str(tmp_path)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_tagged(tag)) < 6:  # the demo, the launcher and 4 of its 8 workers
            assert demo.poll() is None, "the demo ended before its launch started"
            assert time.monotonic() < deadline, "the launch did not start within 120 s"
            time.sleep(0.1)
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _tagged(tag), f"still running after the demo ended: {_tagged(tag)}"
        assert not list(tmp_path.glob("unimesh-demo-*")), list(tmp_path.iterdir())
    finally:
        for pid in _tagged(tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()


def test_demo_permuted_3d_mesh():
    proc = run(
        "demo", "--mesh", "a=2,b=3,c=2;ids=11,10,9,8,7,6,5,4,3,2,1,0", "--backends", "jax,keras"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout


def test_bad_spec_is_one_line_and_exit_2():
    proc = run("demo", "--mesh", "dp=2,tp=x")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "cannot read axis 'tp=x'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_backends_is_an_aligned_table_in_80_columns_and_json_with_the_same_facts():
    env = {**os.environ, "COLUMNS": "80"}
    proc = run("backends", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["backend", "version", "runs", "layers", "capabilities"]
    assert all(len(line) <= 80 for line in lines), lines
    starts = [lines[0].index(c) for c in ("version", "runs", "layers", "capabilities")]
    listed = json.loads(run("backends", "--json").stdout)
    assert [r["name"] for r in listed] == unimesh.backends()
    for entry in listed:
        be = unimesh.get_backend(entry["name"])
        assert entry["capabilities"] == sorted(be.capabilities)
        assert entry["layers"] == list(be.layers())
        assert entry["version"] == be.framework_version()
        first = next(line for line in lines if line.startswith(entry["name"] + " "))
        # every column starts where its heading does: the table is aligned
        assert all(first[i - 1] == " " and first[i] != " " for i in starts), first
        assert first[starts[0] :].startswith(str(entry["version"])[:10])


def test_version_help_examples_and_typo_suggestions():
    from unimesh import __version__

    assert run("--version").stdout.strip() == f"unimesh {__version__}"
    top = run("--help").stdout
    assert "``" not in top and "examples:" in top
    examples = top.split("examples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    # each example command alone on its line, its description indented below it (issue 40:
    # one space between a command and its description ran them together)
    commands = [ln for ln in examples if ln.startswith("  unimesh ")]
    assert len(commands) == 4 and all(ln.startswith("      ") for ln in examples[1::2])
    for line in commands:
        assert subprocess.run(  # each parses as written (argparse alone: --help of it)
            [sys.executable, "-m", "unimesh", *line.split()[1:], "--help"],
            capture_output=True, text=True, timeout=120, check=False,
        ).returncode == 0, line  # fmt: skip
    for command in ("demo", "backends", "show", "convert", "check"):
        text = run(command, "--help").stdout
        assert f"examples:\n  unimesh {command}" in text, (command, text)
    proc = run("shwo")
    assert proc.returncode == 2
    assert "invalid choice: 'shwo'" in proc.stderr and "did you mean 'show'?" in proc.stderr
    proc = run("convert", "dp=8", "--to", "pytorch")
    assert proc.returncode == 2 and "did you mean 'torch'?" in proc.stderr, proc.stderr
    proc = run("demo", "--backends", "jaxx")
    assert proc.returncode == 2, proc.stdout
    assert "did you mean 'jax'?" in proc.stderr and "unimesh[jaxx]" not in proc.stderr


def test_a_closed_pipe_ends_quietly():
    """``unimesh backends | head -1``: the reader goes away; no traceback, exit 0."""
    for args in (["backends"], ["show", "dp=64,tp=64", "--json"]):
        reader = subprocess.Popen(
            ["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        proc = subprocess.run(
            [sys.executable, "-m", "unimesh", *args],
            stdout=reader.stdin,
            stderr=subprocess.PIPE,
            text=True,
            timeout=170,
            check=False,
        )
        assert reader.stdin is not None
        reader.stdin.close()
        reader.wait(timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == "", proc.stderr


def test_show_json_is_compact():
    proc = run("show", "dp=2,tp=2", "--layout", "dp,None", "--shape", "4,2", "--json")
    lines = proc.stdout.splitlines()
    assert '  "mesh": {"axis_names": ["dp", "tp"], "shape": [2, 2]},' in lines
    assert len(lines) == 9, lines  # a line per field, not per number


def test_show_draws_the_grid_and_each_device_block():
    proc = run("show", "dp=2,tp=4", "--layout", "dp,tp", "--shape", "6,8")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "dp \\ tp" in out and "tp=3" in out and "dp=1" in out
    for cell in (
        "[0:3, 0:2]",
        "[3:6, 6:8]",
        "tensor (6, 8) as P('dp', 'tp')",
        "rows \\ cols",
        " 6:8 ",
    ):
        assert cell in out, cell


def test_show_marks_processes_and_splits_leading_axes():
    proc = run("show", "pp=2,dp=2,tp=2;ids=7,6,5,4,3,2,1,0;per_process=2")
    assert proc.returncode == 0, proc.stderr
    assert "pp=0" in proc.stdout and "pp=1" in proc.stdout
    assert "7 p3" in proc.stdout and "0 p0" in proc.stdout


def test_show_json_gives_the_core_answers():
    import json

    from unimesh import Layout, Mesh, P

    proc = run(
        "show", "dp=2,tp=2;ids=3,1,2,0", "--layout", "dp+tp,None", "--shape", "9,2", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    mesh = Mesh.from_string("dp=2,tp=2;ids=3,1,2,0")
    lay = Layout(mesh, P(("dp", "tp"), None))
    assert Mesh.from_dict(data["mesh"]) == mesh and data["spec"] == repr(lay.spec)
    assert data["size"] == 4 and data["process"] is None
    np.testing.assert_array_equal(data["device_ids"], mesh.device_ids)
    for device in mesh.device_ids.ravel().tolist():
        coords = tuple(mesh.coords(device).values())
        want = [[s.start, s.stop] for s in lay.shard_slices((9, 2), device)]
        assert np.asarray(data["blocks"])[coords].tolist() == want


def test_show_bad_input_is_one_line_and_exit_2():
    for args, words in [
        (("dp=2,tp=x",), "cannot read axis 'tp=x'"),
        (("dp=2,tp=2", "--layout", "dp,pp", "--shape", "4,4"), "'pp'"),
        (("dp=2,tp=2", "--layout", "dp", "--shape", "4,x"), "'4,x'"),
        (("dp=2,tp=2", "--layout", "dp,tp"), "--layout needs --shape"),
        (("dp=2,tp=2", "--layout", "dp,tp", "--shape", "4"), "has 1 dims"),
        ((",".join(f"a{i}=1" for i in range(65)) + ";ids=0",), "a mesh of 65 axes"),
        (("dp=\u0662",), "cannot read axis"),
    ]:
        proc = run("show", *args)
        assert proc.returncode == 2, (args, proc.stdout)
        assert proc.stderr.strip().count("\n") == 0 and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_convert_prints_the_native_mesh():
    proc = run("convert", "dp=2,tp=2;ids=3,1,2,0", "--to", "jax")
    assert proc.returncode == 0, proc.stderr
    assert "axis_names=('dp', 'tp')" in proc.stdout and "id=3" in proc.stdout


def test_convert_is_quiet_readable_and_printed_once(tmp_path):
    """Issue 40: TensorFlow's C++ log lines are kept out of convert's output, its mesh is
    printed as lines that fit a terminal, and under torchrun only the first process prints."""
    pytest.importorskip("tensorflow")
    proc = run("convert", "dp=2,tp=4", "--to", "tensorflow", "--layout", "dp,None")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # no oneDNN / absl lines
    lines = proc.stdout.splitlines()
    assert lines[0] == "dtensor.Mesh(dp=2, tp=4), device type CPU", lines
    assert "global device ids: [[0, 1, 2, 3], [4, 5, 6, 7]]" in proc.stdout
    assert "sharding_specs=['dp', 'unsharded']" in proc.stdout
    assert all(len(ln) <= 80 for ln in lines), lines
    pytest.importorskip("torch.distributed")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    proc = subprocess.run(
        [*launch, "-m", "unimesh", "convert", "dp=2,tp=2", "--to", "torch"],
        capture_output=True, text=True, timeout=300, check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("DeviceMesh(") == 1, proc.stdout


def test_convert_code_builds_the_same_mesh_when_run():
    """The hand-written native code that --code prints, executed, gives back the neutral mesh."""
    spec = "dp=2,tp=2;ids=3,1,2,0"
    for backend, prelude in [
        (
            "jax",
            ("import os\nos.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'\n"),
        ),
        (
            "keras",
            (
                "import os\nos.environ['XLA_FLAGS'] = "
                "'--xla_force_host_platform_device_count=4'\n"
                "os.environ['KERAS_BACKEND'] = 'jax'\n"
            ),
        ),
        (
            "tensorflow",
            ("import unimesh_tensorflow\nunimesh_tensorflow.configure_cpu_devices(4)\n"),
        ),
    ]:
        proc = run("convert", spec, "--to", backend, "--code")
        assert proc.returncode == 0, proc.stderr
        program = (
            prelude + proc.stdout + "\nimport unimesh\n"
            f"assert unimesh.from_native(mesh) == unimesh.Mesh.from_string({spec!r}), "
            "unimesh.from_native(mesh)\nprint('SAME')\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            timeout=170,
            check=False,
        )
        assert done.returncode == 0 and "SAME" in done.stdout, (backend, program, done.stderr)


def test_convert_code_for_torch_and_mlx_names_every_group():
    torch_code = run("convert", "dp=2,tp=2;ids=3,1,2,0", "--to", "torch", "--code").stdout
    assert (
        "DeviceMesh(\"cpu\", torch.tensor([[3, 1], [2, 0]]), mesh_dim_names=('dp', 'tp'))"
        in torch_code
    )
    mlx_code = run("convert", "dp=2,tp=2", "--to", "mlx", "--code").stdout
    assert "rows = [(0, 2), (1, 3)]" in mlx_code and "tp_group = world.split" in mlx_code


def test_convert_bad_input_is_one_line_and_exit_2():
    for args, words in [
        (("dp=2", "--to", "nope"), "no backend named 'nope'"),
        (("dp=2,tp=4", "--to", "torch"), "--nproc-per-node=8 -m unimesh convert dp=2,tp=4 --to"),
        (("dp=0", "--to", "jax"), "must be >= 1, got 0"),
    ]:
        proc = run("convert", *args)
        assert proc.returncode == 2, (args, proc.stdout)
        assert proc.stderr.strip().count("\n") == 0 and words in proc.stderr, proc.stderr


def check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    return subprocess.run(
        [sys.executable, "-m", "unimesh", "check", *args],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        env={**base, **(env or {})},
    )


def test_check_runs_the_suite_and_prints_the_matrix(example_site, tmp_path):
    """A third-party backend that passes and its broken twin: the matrix says which
    capabilities passed, the failures are named, the exit code is 1."""
    import json

    out = tmp_path / "matrix.json"
    proc = check(
        "example",
        "example_broken",
        "--json",
        str(out),
        "--markdown",
        str(tmp_path / "m.md"),
        env={"PYTHONPATH": str(example_site)},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "unimesh capability matrix" in proc.stdout
    assert "example_broken: the suite failed" in proc.stdout
    assert "FAILED" in proc.stdout and "test_mesh_round_trip" in proc.stdout
    matrix = json.loads(out.read_text())["backends"]
    assert matrix["example"]["processes"] == "1 process"
    assert matrix["example"]["ok"] and not matrix["example_broken"]["ok"]
    good, bad = matrix["example"]["matrix"], matrix["example_broken"]["matrix"]
    assert good["mesh"] == good["distribute"] == good["uneven_shards"] == "pass"
    assert good["partial"] == "not declared"
    assert bad["mesh"] == bad["distribute"] == "fail"
    cells = matrix["example"]["cells"]
    assert cells["mesh"]["passed"] == 9 and cells["mesh"]["failed"] == cells["mesh"]["refused"] == 0
    # every mesh case that holds devices 0 and 1 (all but part-of-world) catches the swap
    assert matrix["example_broken"]["cells"]["mesh"]["failed"] == 8
    md = (tmp_path / "m.md").read_text().splitlines()
    assert md[0] == "| capability | example (1 process) | example_broken (1 process) |", md
    assert "| mesh | pass 9 | fail 8/9 |" in md, md
    assert any(line.startswith("- example_broken (1 process), mesh: failed: ") for line in md)


def test_check_a_launched_backend(tmp_path):
    """torch runs under torchrun: every rank reports, the matrix is what torch declares."""
    import json

    import pytest

    import unimesh

    pytest.importorskip("torch.distributed")
    out = tmp_path / "matrix.json"
    proc = check("torch", "--processes", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())["backends"]["torch"]
    assert result["processes"] == "2 processes (torchrun)"
    declared = unimesh.get_backend("torch").capabilities
    for cap, verdict in result["matrix"].items():
        assert verdict in (("pass", "refused") if cap in declared else ("not declared",)), (
            cap,
            verdict,
        )
    # DTensor cannot put shards on a reversed mesh: the matrix says so instead of passing
    placed = result["cells"]["distribute"]
    assert result["matrix"]["distribute"] == "refused" and placed["refused"] > 0, placed
    for cell in result["cells"].values():
        for why in cell["reasons"]:
            assert why.startswith("refused: ") and "device order is not increasing" in why, why


def test_check_bad_input_is_one_line():
    for args, named in (
        (["nosuchbackend"], "'nosuchbackend'"),
        (["torch", "--processes", "0"], "--processes"),
    ):
        proc = check(*args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0] and "Traceback" not in proc.stderr, lines


def test_check_without_names_skips_backends_whose_framework_is_missing(monkeypatch, capsys):
    """`unimesh check` alone checks what can run here and names the rest with the pip extra
    (the suite runs themselves are replaced: only the choice of backends is under test)."""
    import unimesh
    from unimesh.cli import check as _check
    from unimesh.conformance.matrix import Case

    ghost = type(
        "Ghost",
        (unimesh.Backend,),
        {
            "name": "ghost",
            "framework": "no_such_fw_xyz",
            "extra": "ghost",
            "mesh_to_native": lambda self, mesh, **options: mesh,
            "from_native": lambda self, obj: obj,
        },
    )()
    unimesh.register_backend(ghost)
    ran: list[str] = []

    def fake_suite(name, processes, timeout, tick=None):
        ran.append(name)
        run = _check.Run(name, 1, "1 process", returncode=0)
        run.cases.append(Case(name, "mesh", "test_mesh", "passed"))
        run.reports = 1
        return run

    monkeypatch.setattr(_check, "run_suite", fake_suite)
    try:
        assert _check.check([]) == 0
    finally:
        unimesh.unregister_backend("ghost")
    out = capsys.readouterr().out
    assert "ghost" not in ran and ran, ran
    assert (
        'ghost: not checked, its framework is not installed (pip install "unimesh[ghost]")' in out
    )
    assert set(ran) == {n for n in unimesh.backends() if unimesh.get_backend(n).available()}


def test_demo_names_a_backend_whose_framework_is_missing():
    """The demo's row for such a backend says what is missing and the pip extra; no crash."""
    code = (
        "import sys, unimesh\nfrom unimesh.cli import main\n"
        "ghost = type('Ghost', (unimesh.Backend,), {'name': 'ghost', 'framework': "
        "'no_such_fw_xyz', 'extra': 'ghost', 'mesh_to_native': lambda s, m, **o: m, "
        "'from_native': lambda s, o: o})()\n"
        "unimesh.register_backend(ghost)\n"
        "sys.exit(main(['demo', '--backends', 'jax,ghost']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=170, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any(x.startswith("│ ghost ") for x in proc.stdout.splitlines()), proc.stdout
    assert (
        'not run: ghost (no_such_fw_xyz is not installed: pip install "unimesh[ghost]")'
        in proc.stdout
    ), proc.stdout
    assert "Traceback" not in proc.stderr


def test_a_third_party_backend_appears_everywhere_without_an_edit_in_unimesh(example_site):
    """tests/conformance_example, installed as its own package, is listed by `backends`, runs
    in `demo`, writes its native code for `convert --code` (which, run, builds the same mesh)
    and has its column in the docs' tables: every list comes from the installed plugins."""
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(example_site)}

    listed = run("backends", env=env)
    assert listed.returncode == 0, listed.stderr
    line = next(x for x in listed.stdout.splitlines() if x.startswith("example "))
    assert "numpy" in line and "one process" in line, listed.stdout

    demo = run("demo", "--backends", "example", "--mesh", "a=2,b=3;ids=5,4,3,2,1,0", env=env)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    line = row(demo.stdout, "example")
    assert "ExampleMesh" in line and "1 (6 devices)" in line and line.count(" ok ") == 2, line

    spec = "dp=2,tp=2;ids=3,1,2,0"
    code = run("convert", spec, "--to", "example", "--code", env=env)
    assert code.returncode == 0, code.stderr
    program = (
        code.stdout + "\nimport unimesh\nassert unimesh.from_native(mesh) == "
        f"unimesh.Mesh.from_string({spec!r}), unimesh.from_native(mesh)\nprint('SAME')\n"
    )
    done = run("-c", program, env=env)
    assert done.returncode == 0 and "SAME" in done.stdout, (program, done.stderr)

    docs = Path(__file__).parents[1] / "docs"
    script = (
        f"import sys; sys.path.insert(0, {str(docs)!r}); import _gen; "
        "print(_gen.api_table()); print(_gen.collectives_table())"
    )
    tables = run("-c", script, env=env)
    assert tables.returncode == 0, tables.stderr
    api, primitives = tables.stdout.split("\n\n", 1)
    assert " example |" in api.splitlines()[0], api
    assert "| mesh | `unimesh.Mesh` |" in api and "unimesh_example.Mesh (ids and names)" in api
    assert " example |" in primitives.splitlines()[0], primitives


def test_check_without_pytest_names_the_conformance_extra(monkeypatch):
    """In a `pip install "unimesh[jax]"` environment pytest is absent: `check` says which extra
    brings it instead of printing a matrix of dashes."""
    import importlib.util

    import pytest

    from unimesh.cli import check as _check

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else real(name, *a)
    )
    with pytest.raises(
        unimesh.UnimeshError,
        match=r'pytest is not installed here: pip install "unimesh\[conformance\]"',
    ):
        _check.check(["jax"])
