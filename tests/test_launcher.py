"""unimesh.detect_launcher: which launcher started this process, read from its environment."""

from __future__ import annotations

import pytest

import unimesh
from unimesh import LaunchError, detect_launcher

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "3",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}
JAX = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
MPIRUN = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
}
MLX_LAUNCH = {"MLX_RANK": "0", "MLX_HOSTFILE": "/tmp/hosts.json"}


@pytest.mark.parametrize(
    "env, name, backend, rank, processes",
    [
        (TORCHRUN, "torchrun", "torch", 3, 8),
        (
            {k: TORCHRUN[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
            "torchrun",
            "torch",
            3,
            8,
        ),
        (JAX, "jax.distributed", "jax", 2, 4),
        (MPIRUN, "mpirun", "mlx", 1, 2),
        ({"PMI_RANK": "5", "PMI_SIZE": "6"}, "mpirun", "mlx", 5, 6),
        (MLX_LAUNCH, "mlx.launch", "mlx", 0, None),
        ({**MPIRUN, **TORCHRUN}, "torchrun", "torch", 3, 8),  # torchrun under an MPI job
        ({**MPIRUN, **JAX}, "jax.distributed", "jax", 2, 4),
        ({**MLX_LAUNCH, **MPIRUN}, "mlx.launch", "mlx", 0, None),
    ],
)
def test_each_launcher_is_found(env, name, backend, rank, processes):
    found = detect_launcher(env)
    assert found is not None
    assert (found.name, found.backend, found.rank, found.processes) == (
        name,
        backend,
        rank,
        processes,
    )
    assert found.name in str(found) and "=" in found.evidence


def test_no_launcher_and_partial_variables():
    assert detect_launcher({}) is None
    assert detect_launcher({"RANK": "0", "WORLD_SIZE": "2"}) is None  # no rendezvous: not torchrun
    assert detect_launcher({"JAX_COORDINATOR_ADDRESS": ""}) is None
    odd = detect_launcher({**JAX, "JAX_PROCESS_ID": "٣", "JAX_NUM_PROCESSES": "9" * 40})
    assert odd is not None and odd.rank is None and odd.processes is None  # not ints: unknown
    assert len(odd.evidence) < 200  # a huge value is shortened in the text


def test_two_framework_launchers_at_once_are_an_error():
    with pytest.raises(LaunchError, match=r"started by both .* and .*backend=") as caught:
        detect_launcher({**TORCHRUN, **JAX})
    assert "torchrun (" in str(caught.value) and "jax.distributed (" in str(caught.value)


def test_launchers_are_declared_by_the_backends():
    """The core finds a launcher only through a backend's launcher_signs: a backend
    registered in this process with a sign of its own is found by it, and its sign yields to
    a framework's launcher when both mark the environment."""
    from unimesh.launchers import LauncherSign

    from .support.refbackend import RefBackend

    class Launched(RefBackend):
        name = "launched"
        launcher_signs = (
            LauncherSign("mylaunch", any_set=("MY_RANK",), rank_var="MY_RANK", size_var="MY_N"),
            LauncherSign("mympi", any_set=("MY_MPI",), names_framework=False),
        )

    unimesh.register_backend(Launched())
    try:
        found = detect_launcher({"MY_RANK": "2", "MY_N": "4"})
        assert found == ("mylaunch", "launched", 2, 4, "MY_RANK='2', MY_N='4'")
        assert detect_launcher({"MY_MPI": "1"}).name == "mympi"
        assert detect_launcher({"MY_MPI": "1", **JAX}).name == "jax.distributed"
        with pytest.raises(LaunchError, match="started by both"):
            detect_launcher({"MY_RANK": "0", **TORCHRUN})
    finally:
        unimesh.unregister_backend("launched")
    assert detect_launcher({"MY_RANK": "2"}) is None


def test_a_backend_with_malformed_launcher_signs_is_refused():
    from .support.refbackend import RefBackend

    class Bad(RefBackend):
        name = "badsigns"
        launcher_signs = (("torchrun", "RANK"),)  # type: ignore[assignment]

    with pytest.raises(unimesh.BackendRegistrationError, match="launcher_signs must be a tuple"):
        unimesh.register_backend(Bad())


def test_initialize_outside_a_launcher_runs_one_process(monkeypatch):
    for var in (*TORCHRUN, *JAX, *MPIRUN, *MLX_LAUNCH, "PMI_SIZE", "UNIMESH_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    assert detect_launcher() is None
    pytest.importorskip("jax")
    assert unimesh.initialize("jax") == (0, 1)


def test_unimesh_backend_names_the_runtime_over_the_launcher(monkeypatch):
    from unimesh.runtime import _runtime_backend

    for var, value in TORCHRUN.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("UNIMESH_BACKEND", "jax")
    pytest.importorskip("jax")
    assert _runtime_backend(None).name == "jax"
    monkeypatch.delenv("UNIMESH_BACKEND")
    pytest.importorskip("torch")
    assert _runtime_backend(None).name == "torch"  # the launcher's, nothing started yet


def test_a_bad_environment_is_a_launch_error():
    with pytest.raises(LaunchError, match=r"mapping of environment variables .* got 3"):
        detect_launcher(3)  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match=r"got \['RANK=0'\]"):
        detect_launcher(["RANK=0"])  # type: ignore[arg-type]
