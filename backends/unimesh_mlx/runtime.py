"""The MLX backend's runtime layer: ``mx.distributed.init`` checked against the launcher
(mlx.launch, mpirun), the exchange ``unimesh.verify`` uses, a watchdog for collectives that
cannot be interrupted, and the exit hook that releases split groups before MPI finalizes."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from unimesh import ConversionError, LaunchError, MeshMismatchError, UnsupportedError
from unimesh.spmd import ProcessBackend

if TYPE_CHECKING:
    from .translate import AxisGroup

LIVE_GROUPS: weakref.WeakSet[AxisGroup] = weakref.WeakSet()
LIVE_LAYERS: list[weakref.ref[Any]] = []  # mlx Modules are dicts: unhashable, but weakly referable
_REGISTERED = False
_ENGINES: weakref.WeakSet[MLXRuntime] = weakref.WeakSet()  # their programs' pending results
_CHECKS = [0]  # mesh checks so far (each a sign-in stage)
_STARTED: list[Any] = []  # the world group, once initialize() checked it


_MX: Any = None


def import_mx() -> Any:
    global _MX
    if _MX is None:
        import mlx.core as mx

        _MX = mx
    return _MX


#: numpy dtypes MLX holds under another name (numpy's own name for the rest)
_MX_DTYPES = (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "bfloat16", "complex64",
)  # fmt: skip


def host_to_mx(value: Any) -> Any:
    """A numpy array (or array-like) as an ``mx.array`` of the same dtype. ``mx.array`` alone
    turns float64 into float32 without a word; MLX's CPU holds float64, so it is kept (MLX's
    own float64 ``sin``/``exp`` are only float32-accurate: that is MLX's). A dtype MLX lacks
    (complex128, strings, objects) is a ConversionError naming it."""
    mx = import_mx()
    host = np.asarray(value)
    name = str(host.dtype)
    if name == "bfloat16":  # ml_dtypes' bfloat16: the same bytes
        return mx.array(host.view(np.uint16)).view(mx.bfloat16)
    if name not in _MX_DTYPES:
        raise ConversionError(
            f"MLX has no dtype {name}: MLX holds "
            f"{', '.join(_MX_DTYPES)}; cast it first (e.g. .astype(np.complex64))"
        )
    return mx.array(host, dtype=getattr(mx, "bool_" if name == "bool" else name))


def mx_to_host(x: Any) -> np.ndarray:
    """An ``mx.array`` as numpy of the same dtype (bfloat16 as ml_dtypes' bfloat16, over the
    same bytes: numpy has none of its own)."""
    mx = import_mx()
    if x.dtype == mx.bfloat16:
        import ml_dtypes

        return np.array(x.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(x)


def _release_groups() -> None:
    """Drop every split group before the interpreter (and MPI) shuts down: a split group still
    alive at MPI_Finalize makes every rank abort."""
    for engine in list(_ENGINES):
        engine.forget_pending()
    for group in list(LIVE_GROUPS):
        group._group = None
    for ref in LIVE_LAYERS:
        layer = ref()
        if layer is not None and "group" in vars(layer):
            vars(layer)["group"] = None
    import sys

    distributed = sys.modules.get("mlx.nn.layers.distributed")
    cached: Any = getattr(distributed, "sum_gradients", None)
    if hasattr(cached, "cache_clear"):  # MLX memoises a gradient hook per group: let it go
        cached.cache_clear()
    import gc

    gc.collect()


def _init_world() -> Any:
    """``mx.distributed.init()``, then (once) the exit hook that releases split groups. It is
    registered after MLX's own, and exit hooks run last-registered first, so it runs before
    MPI is finalized."""
    global _REGISTERED
    world = import_mx().distributed.init()
    if not _REGISTERED:
        atexit.register(_release_groups)
        _REGISTERED = True
    return world


def launcher_world_size() -> tuple[int, str] | None:
    """How many processes the launcher says it started, and the variable that says so:
    mpirun's ``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE``, ``MLX_WORLD_SIZE``, or the number of
    hosts in mlx.launch's ring ``MLX_HOSTFILE``. None outside a launcher."""
    import json

    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_WORLD_SIZE"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value), f"{var}={value}"
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            with open(path) as fh:
                text = fh.read().strip()
            hosts = json.loads(text) if text else []
        except (OSError, ValueError):
            return None
        if isinstance(hosts, list) and hosts:
            return len(hosts), f"MLX_HOSTFILE lists {len(hosts)} hosts"
    return None


@functools.cache
def _roll_call() -> tuple[str, bool] | None:
    """This job's sign-in directory on this machine (each process leaves a file there before
    each step the watchdog guards, so that the watchdog can name who never came), and whether
    every process of the job runs on this machine. None when the launcher names no job, or the
    directory is not this user's alone. Found (and old jobs' directories swept) once per
    process: the launcher's variables do not change."""
    import hashlib
    import json
    import stat
    import tempfile

    job = os.environ.get("PMIX_NAMESPACE")  # one mpirun job (OpenMPI 4 and 5)
    if job:
        local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
        key, single = f"mpi {job}", bool(local) and local == os.environ.get("OMPI_COMM_WORLD_SIZE")
    elif os.environ.get("MLX_HOSTFILE"):
        try:
            with open(os.environ["MLX_HOSTFILE"], "rb") as fh:
                text = fh.read(1 << 20)
            hosts = json.loads(text)
            single = len({str(a).rpartition(":")[0] for row in hosts for a in row}) == 1
        except (OSError, ValueError, TypeError):
            return None
        key = "ring " + hashlib.sha256(text).hexdigest()  # one launch's random ports
    else:
        return None
    # with the launcher's process id (the parent of every process of the job on this machine):
    # mlx.launch reuses its ports, and a job ended by a signal leaves its sign-ins behind
    digest = hashlib.sha256(f"{key} {os.getppid()}".encode()).hexdigest()[:16]
    prefix = os.path.join(tempfile.gettempdir(), f"unimesh-mlx-{os.getuid()}-")
    path = prefix + digest
    _sweep(prefix)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return None
    return path, single


def _sweep(prefix: str) -> None:
    """Remove this user's sign-in directories of jobs older than a day (a process the watchdog
    ended never ran its exit hook)."""
    import glob
    import shutil
    import time

    for old in glob.glob(glob.escape(prefix) + "*"):
        with contextlib.suppress(OSError):
            if time.time() - os.lstat(old).st_mtime > 86400:
                shutil.rmtree(old)


_SIGNED: list[str] = []


def _sign_in(where: str, stage: str, rank: str) -> None:
    """Leave ``stage.rank`` in the job's directory (removed at exit)."""
    name = os.path.join(where, f"{stage}.{rank}")
    try:
        with open(name, "w"):
            pass
    except OSError:
        return
    if not _SIGNED:
        atexit.register(_sign_out)
    _SIGNED.append(name)


def _sign_out() -> None:
    for name in _SIGNED:
        with contextlib.suppress(OSError):
            os.remove(name)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(_SIGNED[0]))  # the last process of the job to leave


# The watchdog process, one per process that uses it: it waits on its stdin for a line that
# arms it (JSON: seconds, message, sign-in directory, stage, world size, all on one machine),
# then for the next line, which disarms it; an end of file (this process closed it, or the
# kernel did when this process died) ends it. When an armed call's time is up, it says so
# (naming, from the job's sign-in directory, the ranks that never came) and ends this process.
_WATCHDOG = """
import json, os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is this process's to handle; EOF ends us
pid, pending = int(sys.argv[1]), b""
def line(deadline):
    global pending
    while b"\\n" not in pending:
        if deadline is not None:  # a line already written when the time is up still counts
            left = max(0.0, deadline - time.monotonic())
            if not select.select([0], [], [], left)[0]:
                return None
        chunk = os.read(0, 65536)
        if not chunk:
            return b""
        pending += chunk
    got, _, pending = pending.partition(b"\\n")
    return got
while True:
    armed = line(None)
    if not armed:
        break
    if armed == b"disarm":  # a call interrupted before it armed us
        continue
    seconds, message, where, stage, world, single = json.loads(armed)
    done = line(time.monotonic() + seconds)
    if done is not None:
        if done:
            continue
        break
    if where:
        try:
            came = {n[len(stage) + 1:] for n in os.listdir(where) if n.startswith(stage + ".")}
        except OSError:
            came = None
        if came is not None and single:
            absent = [r for r in range(world) if str(r) not in came]
            if absent:
                who = "rank %d" % absent[0] if len(absent) == 1 else "ranks %s" % absent
                message += ": %s never reached it (of %s processes, all on this machine)" % (
                    who, world)
        elif came is not None:
            message += ": of the processes on this machine, ranks %s reached it" % sorted(
                int(r) for r in came if r.isdigit())
    sys.stderr.write(message + "; MLX cannot interrupt it, so this process is ended (SIGTERM)\\n")
    sys.stderr.flush()
    os.kill(pid, signal.SIGTERM)
    if line(time.monotonic() + 5.0) is None:
        os.kill(pid, signal.SIGKILL)
    break
"""

_GUARD: list[Any] = []  # this process's watchdog process, once started (a fork: none)
_WATCHED = threading.Lock()  # one watched call at a time (the guard watches one window)


def _forked() -> None:
    """In a forked child: let go of the parent's watchdog (its pipe's write end, inherited,
    would keep it from seeing the parent's end) and of a lock another thread may have held."""
    global _WATCHED
    _WATCHED = threading.Lock()
    if _GUARD:
        null = os.open(os.devnull, os.O_WRONLY)
        try:  # the pipe's end replaced, so the file object stays valid
            with contextlib.suppress(Exception):
                os.dup2(null, _GUARD[0].stdin.fileno())
        finally:
            os.close(null)
        _GUARD.clear()


os.register_at_fork(after_in_child=_forked)


def _guard() -> Any:
    """This process's watchdog process, started on first use (about 20 ms: a Python start),
    and again if it has ended."""
    import subprocess
    import sys

    if not _GUARD or _GUARD[0].poll() is not None:
        _GUARD[:] = [
            subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid())],
                stdin=subprocess.PIPE,
            )
        ]
    return _GUARD[0]


def stop_watchdog() -> None:
    """End this process's watchdog process, if it has one (at exit, or where a caller wants
    no child process left, as the test suite's leftover check does): its stdin closed, it
    ends, and it is reaped. The next watched call starts another."""
    if _GUARD:
        guard = _GUARD.pop()
        with contextlib.suppress(OSError, ValueError):
            guard.stdin.close()
        with contextlib.suppress(Exception):
            guard.wait(timeout=2.0)


atexit.register(stop_watchdog)


def _tell(guard: Any, line: bytes) -> bool:
    """Write one line to the watchdog; False if it is gone."""
    try:
        guard.stdin.write(line)
        guard.stdin.flush()
    except (OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def watchdog(seconds: float, what: str, stage: str, rank: str) -> Iterator[None]:
    """MLX collectives cannot be interrupted: if ``what`` does not finish within ``seconds``,
    say so on stderr and end this process (SIGTERM) instead of hanging. This process (``rank``)
    signs in for ``stage`` first, and the message names the ranks that never did.

    A process, not a thread: ``mx.distributed.init()`` under mpirun holds the GIL while it
    waits for a peer that never starts, so no Python thread of this process would ever run
    (a ``threading.Timer`` never fired there). One process, started once and armed for each
    call (a process started per call cost each mesh check or save agreement about 20 ms)."""
    import json
    import sys

    message = (
        f"unimesh: {what} did not finish within {seconds:.0f} s: a peer process never "
        "started, is gone or is stuck"
    )
    where, single = "", False
    world = launcher_world_size()
    roll = _roll_call() if world is not None else None
    if roll is not None:
        where, single = roll
        _sign_in(where, stage, rank)
    arm = json.dumps([seconds, message, where, stage, world[0] if world else 0, single])
    with _WATCHED:
        guard = _guard()
        try:
            if not _tell(guard, arm.encode() + b"\n"):  # it ended since: a new one
                _GUARD.clear()
                guard = _guard()
                if not _tell(guard, arm.encode() + b"\n"):
                    raise LaunchError(
                        f"unimesh could not start the watchdog process that bounds {what} "
                        f"(MLX cannot interrupt it): {sys.executable} -I -S did not take its "
                        "input; check that this Python can start a subprocess"
                    )
            yield
        finally:
            _tell(guard, b"disarm\n")


class MLXRuntime(ProcessBackend):
    """The runtime layer: MLX's distributed world, one device per process."""

    def _world(self) -> Any:
        _ENGINES.add(self)
        if _STARTED:
            return _STARTED[0]
        self.initialize(300.0)
        return _STARTED[0]

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:
        """``mx.distributed.init()`` (within ``timeout`` seconds, see :func:`watchdog`), checked
        against the process count the launcher says it started: MLX silently falls back to a
        1-process group when it finds no distributed backend. MLX's launchers start the
        processes and tell them where to meet: launch parameters are refused."""
        if launch is not None:
            raise UnsupportedError(
                f"the mlx backend takes no launch parameters (got {launch}): mlx.launch and "
                "mpirun start MLX's processes and tell them where to meet; run the script "
                "under `mlx.launch -n N -- python ...` or `mpirun -np N python ...`",
                backend=self.name,
                capability="multi_process",
            )
        if not _STARTED:
            rank_hint = next(
                (os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "MLX_RANK") if v in os.environ),
                "?",
            )
            with watchdog(timeout, f"mx.distributed.init() on rank {rank_hint}", "init", rank_hint):
                world = _init_world()
            expected = launcher_world_size()
            if expected is not None and expected[0] != int(world.size()):
                raise LaunchError(
                    f"the launcher started {expected[0]} processes ({expected[1]}) but "
                    f"mx.distributed.init() gave a group of {int(world.size())}: MLX found no "
                    "distributed backend for this launcher (mpirun: is openmpi's libmpi "
                    "installed, apt-get install libopenmpi-dev; mlx.launch: is the ring "
                    "hostfile readable?)"
                )
            _STARTED.append(world)
        world = _STARTED[0]
        return int(world.rank()), int(world.size())

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """``mx.distributed.all_gather`` of the lengths, then of the padded bytes, over the
        world group, under :func:`watchdog`."""
        mx = import_mx()
        rank, world_size = self.initialize(timeout)
        if world_size == 1:
            return [payload]
        world = _STARTED[0]
        _CHECKS[0] += 1
        with watchdog(
            timeout,
            f"the mesh check on rank {rank} of {world_size}",
            f"check{_CHECKS[0]}",
            str(rank),
        ):
            try:
                sizes = mx.distributed.all_gather(
                    mx.array([len(payload)], dtype=mx.int32), group=world
                )
                longest = int(mx.max(sizes).item())
                mine = np.zeros(longest, dtype=np.int32)
                mine[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
                every = mx.distributed.all_gather(mx.array(mine), group=world)
                mx.eval(every)
            except RuntimeError as exc:
                raise MeshMismatchError(
                    f"rank {rank} of {world_size}: a peer process is gone ({exc})"
                ) from exc
        rows = np.array(every).reshape(world_size, longest)
        return [bytes(rows[r, : int(n)].astype(np.uint8)) for r, n in enumerate(np.array(sizes))]

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]]:
        """``mlx.launch -n N --backend ring -- python`` (the ring backend needs no MPI)."""
        import sys
        from pathlib import Path

        launch = Path(sys.executable).with_name("mlx.launch")
        return [str(launch), "-n", str(processes), "--backend", "ring", "--", sys.executable], {}

    def prepare_devices(self, count: int) -> int:
        return self.initialize(300.0)[1]
