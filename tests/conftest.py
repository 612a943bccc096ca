from __future__ import annotations

import os

# before any test imports jax or keras: 8 virtual CPU devices, Keras on JAX
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("KERAS_BACKEND", "jax")

import atexit
import shutil
import tempfile


def _jax_compilation_cache() -> None:
    """One JAX persistent compilation cache for this run and every process it starts (fresh
    each run, removed at exit): JAX, Keras on JAX and jax.distributed ranks compile the same
    XLA programs over and over (eager ``shard_map`` compiles each primitive), about 35 ms
    each, where a cached one loads in a few. What runs is unchanged: only compiling is shared."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="unimesh-jax-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=folder,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


_jax_compilation_cache()


def _openmpi_session_dirs() -> None:
    """OpenMPI's session directories (``ompi.<host>.<uid>/jf.*``, which a singleton MLX
    process leaves behind empty: MLX never finalizes MPI) go into a folder of this run, removed
    at exit, for this process and every process it starts (Open MPI 4's variable, the
    Debian 12 package this project installs; Open MPI 5's PRRTE names it otherwise)."""
    if "OMPI_MCA_orte_tmpdir_base" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="unimesh-ompi-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["OMPI_MCA_orte_tmpdir_base"] = folder  # noqa: SIM112 - OpenMPI spells it so


_openmpi_session_dirs()

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/conformance_example pip-installed into a directory (for PYTHONPATH): a third-party
    backend package found through its entry point, and its broken twin."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    example = Path(__file__).with_name("conformance_example")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(example),
        ],
        capture_output=True,
        text=True,
        cwd=build,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any(p.name.startswith("unimesh_example_backend") for p in target.iterdir())
    return target


@pytest.fixture(scope="session")
def docs_html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs built once with Sphinx, warnings as errors (each test that reads the site
    shares this build)."""
    from .support.launch import run_bounded

    if os.environ.get("CI") is None:
        for module in ("sphinx", "myst_parser", "furo", "sphinx_copybutton"):
            pytest.importorskip(module)
    out = tmp_path_factory.mktemp("docs") / "html"
    docs = Path(__file__).parents[1] / "docs"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    rc, log = run_bounded([*cmd, str(docs), str(out)], env, 300, out.parent)
    assert rc == 0, log[-5000:]
    return out


CHILD = "UNIMESH_TEST_CHILD"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "quick: the quick tier (python -m pytest -m quick): every public call once on every "
        "installed backend, in minutes",
    )
    config.addinivalue_line(
        "markers",
        "isolated: the test runs in a child pytest process, so that libraries which leave "
        "threads and native state behind (fsspec's IO loop, TensorStore, Orbax) never load in "
        "the process that runs the rest of the suite",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run an ``isolated`` test's body as ``python -m pytest NODEID`` in a child process (its
    own temporary directory, so the child's pytest never rotates this session's away); the
    parent's fixtures have run and pass what the child needs through the environment."""
    if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get(CHILD):
        return None
    import tempfile

    from .support.launch import run_bounded

    marker = pyfuncitem.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else 300.0
    base = tempfile.mkdtemp(prefix="unimesh-child-")
    root = Path(str(pyfuncitem.config.rootpath))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header",
           f"--basetemp={base}", pyfuncitem.nodeid]  # fmt: skip
    try:
        rc, log = run_bounded(cmd, dict(os.environ, **{CHILD: "1"}), limit - 10, root)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    if rc != 0:
        pytest.fail(f"in its child process (exit {rc}):\n{log[-6000:]}", pytrace=False)
    return True


def _log_launches(path: str) -> None:
    """With ``UNIMESH_LAUNCH_LOG`` set: every process the suite starts (launchers, workers,
    child interpreters) appended to that file with its start time and running test, to count
    launcher starts per run (issue 51: the time spent launching against checking)."""
    import json
    import time

    real = subprocess.Popen.__init__

    def logged(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
        entry = {
            "t": time.time(),
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "argv": [Path(a).name if i == 0 else a for i, a in enumerate(argv[:6])],
        }
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        real(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = logged  # type: ignore[method-assign]


if os.environ.get("UNIMESH_LAUNCH_LOG"):
    _log_launches(os.environ["UNIMESH_LAUNCH_LOG"])


# -- what a run leaves behind (issues 51 and 70): checked when the session ends -----------------
#: whether this session's start marked its processes (the check judges nothing otherwise)
_MARKED: list[bool] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    """Mark every process this run starts (their environment), so that the check at the end
    finds the run's own, and only those (tests/support/launch.py)."""
    from .support.launch import LAUNCH_VAR, RUN

    os.environ[LAUNCH_VAR] = RUN
    _MARKED.append(True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it left something of its own behind: a launch's temporary folder not
    removed, or a process it started still running (ended now, by process id, and the folder
    removed). Only the run's own launches and processes are judged: folders that other
    programs make in the temporary folder meanwhile (another user's torchrun jobs, a CI
    runner's parallel jobs) are theirs, and left alone."""
    if os.environ.get(CHILD) or not _MARKED:
        return
    mlx_process = sys.modules.get("unimesh_mlx.process")
    if mlx_process is not None:  # MLX's watchdog lives as long as this process: end it now
        mlx_process.PROCESS.stop_watchdog()
    from .support.launch import left_behind

    left = left_behind()
    if not left:
        return
    lines = left.lines()  # before the cleaning: what each folder held
    left.clean()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = "the run left these behind (a launch that is not cleaned up; ended and removed now):\n"
    text += "\n".join(lines)
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "leftovers", red=True)
        reporter.write_line(text)
    else:
        print(text)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
