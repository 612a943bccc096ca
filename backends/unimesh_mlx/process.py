"""The MLX backend's process state, in one object (:data:`PROCESS`, an :class:`MLXProcess`):
what the launcher said (:class:`Launcher`, read once), the world group once started, what
holds a split group (released at exit, before MPI finalizes), the job's sign-ins and the
watchdog process (:mod:`.watchdog`). A forked child resets it (:meth:`MLXProcess.after_fork`).
Nothing here imports mlx until it is used."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from unimesh import LaunchError

__all__ = ["PROCESS", "Launcher", "MLXProcess"]


@dataclass(frozen=True)
class Launcher:
    """What the launcher (mpirun, mlx.launch) told this process, read once from its
    environment: ``world``, how many processes it says it started and the variable that says
    so (mpirun's ``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE``, ``MLX_WORLD_SIZE``, or the number of
    hosts in mlx.launch's ring ``MLX_HOSTFILE``; None outside a launcher); ``rank``, this
    process's rank as it says (``?``: none); ``split``, whether its groups split (True under
    mpirun, False under mlx.launch's ring, None when neither is named); ``mpi_ranks``, whether
    every rank is reachable directly (mpirun); ``job``, the key of this job's sign-ins (the
    mpirun job, or the ring hostfile's digest; None: none), and ``single``, whether all of
    the job's processes run on this machine."""

    world: tuple[int, str] | None
    rank: str
    split: bool | None
    mpi_ranks: bool
    job: str | None
    single: bool

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> Launcher:
        import hashlib
        import json

        world: tuple[int, str] | None = None
        for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_WORLD_SIZE"):
            value = environ.get(var)
            if value and value.isdigit():
                world = int(value), f"{var}={value}"
                break
        text, hosts = b"", None  # the ring hostfile: its bytes, and its JSON (None: unread)
        path = environ.get("MLX_HOSTFILE")
        if path:
            with contextlib.suppress(OSError, ValueError):
                with open(path, "rb") as fh:
                    text = fh.read(1 << 20)
                hosts = json.loads(text) if text.strip() else []
        if world is None and isinstance(hosts, list) and hosts:
            world = len(hosts), f"MLX_HOSTFILE lists {len(hosts)} hosts"
        job, single = None, False
        if environ.get("PMIX_NAMESPACE"):  # one mpirun job (OpenMPI 4 and 5)
            local = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
            job = f"mpi {environ['PMIX_NAMESPACE']}"
            single = bool(local) and local == environ.get("OMPI_COMM_WORLD_SIZE")
        elif text.strip() and hosts is not None:
            with contextlib.suppress(TypeError):
                single = len({str(a).rpartition(":")[0] for row in hosts for a in row}) == 1
                job = "ring " + hashlib.sha256(text).hexdigest()  # one launch's random ports
        split: bool | None = None
        if environ.get("MLX_HOSTFILE") or environ.get("MLX_RANK"):
            split = False  # mlx.launch's ring backend
        elif "OMPI_COMM_WORLD_SIZE" in environ or "PMI_SIZE" in environ:
            split = True
        rank = next((environ[v] for v in ("OMPI_COMM_WORLD_RANK", "MLX_RANK") if v in environ), "?")
        mpi_ranks = "OMPI_COMM_WORLD_RANK" in environ
        return cls(world, rank, split, mpi_ranks, job, single)


class Split:
    """A split ``mx.distributed.Group`` as the engine holds it (its group handle), so that
    the exit hook can let it go (``group`` None)."""

    __slots__ = ("__weakref__", "group", "members")

    def __init__(self, members: tuple[int, ...], group: Any) -> None:
        self.members = members
        self.group = group

    def __repr__(self) -> str:
        return f"Split(members={self.members})"


class MLXProcess:
    """This process's MLX state: one per process (:data:`PROCESS`).

    - ``mx()``: ``mlx.core``, imported on first use;
    - ``launcher``: :class:`Launcher`, read on first use;
    - ``world``: the world group once :meth:`start` checked it (None before);
    - what holds a group (``engines``, whose pending results may; :class:`Split` s; the layers
      of ``mlx.nn`` given one), all let go by :meth:`release` at exit, before MPI finalizes;
    - the sign-ins (:meth:`sign_in`) and the watchdog process (:meth:`watch`).
    """

    def __init__(self) -> None:
        self._mx: Any = None
        self._launcher: Launcher | None = None
        self.world: Any = None
        self.engines: weakref.WeakSet[Any] = weakref.WeakSet()
        self.splits: weakref.WeakSet[Split] = weakref.WeakSet()
        self.layers: list[weakref.ref[Any]] = []  # mlx Modules are dicts: weakly referable
        self.checks = 0  # mesh checks so far (each a sign-in stage)
        self._roll: tuple[str, bool] | None = None
        self._rolled = False  # the roll call looked for
        self._signed: list[str] = []
        self._guard: Any = None  # the watchdog process (subprocess.Popen)
        self._watched = threading.Lock()  # one watched call at a time (one window)
        self._hooked: set[str] = set()  # exit and fork hooks registered

    # -- mlx and the launcher ---------------------------------------------------------------------
    def mx(self) -> Any:
        if self._mx is None:
            import mlx.core as mx

            self._mx = mx
        return self._mx

    @property
    def launcher(self) -> Launcher:
        if self._launcher is None:
            self._launcher = Launcher.read(os.environ)
        return self._launcher

    def _hook(self, name: str) -> None:
        """Register hook ``name`` once: ``release`` and ``exit`` at exit, ``fork`` after a
        fork in the child."""
        if name in self._hooked:
            return
        self._hooked.add(name)
        if name == "fork":
            os.register_at_fork(after_in_child=self.after_fork)
        else:
            atexit.register(self.release if name == "release" else self.exit)

    # -- the world --------------------------------------------------------------------------------
    def start(self, timeout: float) -> Any:
        """The world group: ``mx.distributed.init()`` (within ``timeout`` seconds, see
        :meth:`watch`), checked against the process count the launcher says it started: MLX
        silently falls back to a 1-process group when it finds no distributed backend. Once
        per process; then the exit hook that releases split groups, registered after MLX's
        own (exit hooks run last-registered first, so it runs before MPI is finalized)."""
        if self.world is not None:
            return self.world
        rank = self.launcher.rank
        with self.watch(timeout, f"mx.distributed.init() on rank {rank}", "init", rank):
            world = self.mx().distributed.init()
        self._hook("release")
        expected = self.launcher.world
        if expected is not None and expected[0] != int(world.size()):
            raise LaunchError(
                f"the launcher started {expected[0]} processes ({expected[1]}) but "
                f"mx.distributed.init() gave a group of {int(world.size())}: MLX found no "
                "distributed backend for this launcher (mpirun: is openmpi's libmpi "
                "installed, apt-get install libopenmpi-dev; mlx.launch: is the ring "
                "hostfile readable?)"
            )
        self.world = world
        return world

    def keep_layer(self, layer: Any) -> None:
        """``layer`` (an ``mlx.nn`` Module) holds a group: let it go at exit too."""
        self.layers.append(weakref.ref(layer))

    def release(self) -> None:
        """Drop every split group before the interpreter (and MPI) shuts down: a split group
        still alive at MPI_Finalize makes every rank abort."""
        import gc
        import sys

        for engine in list(self.engines):
            engine.forget_pending()
        for split in list(self.splits):
            split.group = None
        for ref in self.layers:
            layer = ref()
            if layer is not None and "group" in vars(layer):
                vars(layer)["group"] = None
        distributed = sys.modules.get("mlx.nn.layers.distributed")
        cached: Any = getattr(distributed, "sum_gradients", None)
        if hasattr(cached, "cache_clear"):  # MLX memoises a gradient hook per group
            cached.cache_clear()
        gc.collect()

    # -- sign-ins ---------------------------------------------------------------------------------
    def roll_call(self) -> tuple[str, bool] | None:
        """This job's sign-in directory on this machine (each process leaves a file there
        before each step the watchdog guards, so that the watchdog can name who never came),
        and whether every process of the job runs on this machine. None when the launcher
        names no job, or the directory is not this user's alone. Found (and old jobs'
        directories swept) once per process."""
        if not self._rolled:
            self._roll, self._rolled = self._find_roll(), True
        return self._roll

    def _find_roll(self) -> tuple[str, bool] | None:
        import hashlib
        import stat
        import tempfile

        launcher = self.launcher
        if launcher.job is None:
            return None
        # with the launcher's process id (the parent of every process of the job on this
        # machine): mlx.launch reuses its ports, and a job ended by a signal leaves its
        # sign-ins behind
        digest = hashlib.sha256(f"{launcher.job} {os.getppid()}".encode()).hexdigest()[:16]
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
        return path, launcher.single

    def sign_in(self, where: str, stage: str, rank: str) -> None:
        """Leave ``stage.rank`` in the job's directory (removed at exit)."""
        name = os.path.join(where, f"{stage}.{rank}")
        try:
            with open(name, "w"):
                pass
        except OSError:
            return
        self._hook("exit")
        self._signed.append(name)

    def sign_out(self) -> None:
        """Remove this process's sign-ins, and the job's directory if it is the last out."""
        signed, self._signed = self._signed, []
        for name in signed:
            with contextlib.suppress(OSError):
                os.remove(name)
        if signed:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(signed[0]))

    # -- the watchdog -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, seconds: float, what: str, stage: str, rank: str) -> Iterator[None]:
        """MLX collectives cannot be interrupted: if ``what`` does not finish within
        ``seconds``, say so on stderr and end this process (SIGTERM) instead of hanging. This
        process (``rank``) signs in for ``stage`` first, and the message names the ranks that
        never did.

        A process (:mod:`.watchdog`), not a thread: ``mx.distributed.init()`` under mpirun
        holds the GIL while it waits for a peer that never starts, so no Python thread of
        this process would ever run (a ``threading.Timer`` never fired there). One process,
        started once and armed for each call (a process started per call cost each mesh
        check or save agreement about 20 ms)."""
        import json
        import sys

        message = (
            f"unimesh: {what} did not finish within {seconds:.0f} s: a peer process never "
            "started, is gone or is stuck"
        )
        where, single = "", False
        world = self.launcher.world
        roll = self.roll_call() if world is not None else None
        if roll is not None:
            where, single = roll
            self.sign_in(where, stage, rank)
        arm = json.dumps([seconds, message, where, stage, world[0] if world else 0, single])
        self._hook("fork")  # before the lock is first taken: a child must not inherit it held
        with self._watched:
            guard = self._started()
            try:
                if not _tell(guard, arm.encode() + b"\n"):  # it ended since: a new one
                    self._guard = None
                    guard = self._started()
                    if not _tell(guard, arm.encode() + b"\n"):
                        raise LaunchError(
                            f"unimesh could not start the watchdog process that bounds {what} "
                            f"(MLX cannot interrupt it): {sys.executable} -I -S did not take "
                            "its input; check that this Python can start a subprocess"
                        )
                yield
            finally:
                _tell(guard, b"disarm\n")

    def _started(self) -> Any:
        """The watchdog process, started on first use (about 20 ms: a Python start), and
        again if it has ended."""
        import subprocess
        import sys

        from . import watchdog  # here: `python -m unimesh_mlx.watchdog` finds it unimported

        if self._guard is None or self._guard.poll() is not None:
            self._hook("exit")
            self._guard = subprocess.Popen(
                [sys.executable, "-I", "-S", watchdog.__file__, str(os.getpid())],
                stdin=subprocess.PIPE,
            )
        return self._guard

    @property
    def watchdog_pid(self) -> int | None:
        """The watchdog process's id (None: none started, or stopped)."""
        return None if self._guard is None else int(self._guard.pid)

    def stop_watchdog(self) -> None:
        """End the watchdog process, if there is one (at exit, or where a caller wants no
        child process left, as the test suite's leftover check does): its stdin closed, it
        ends, and it is reaped. The next watched call starts another."""
        guard, self._guard = self._guard, None
        if guard is not None:
            with contextlib.suppress(OSError, ValueError):
                guard.stdin.close()
            with contextlib.suppress(Exception):
                guard.wait(timeout=2.0)

    def exit(self) -> None:
        """At exit: the watchdog stopped, the sign-ins removed."""
        self.stop_watchdog()
        self.sign_out()

    def after_fork(self) -> None:
        """In a forked child: let go of the parent's watchdog (its pipe's write end,
        inherited, would keep it from seeing the parent's end), of a lock another thread may
        have held, and of the parent's sign-ins (the parent removes them)."""
        self._watched = threading.Lock()
        self._signed = []
        guard, self._guard = self._guard, None
        if guard is not None:
            null = os.open(os.devnull, os.O_WRONLY)
            try:  # the pipe's end replaced, so the file object stays valid
                with contextlib.suppress(Exception):
                    os.dup2(null, guard.stdin.fileno())
            finally:
                os.close(null)


def _tell(guard: Any, line: bytes) -> bool:
    """Write one line to the watchdog; False if it is gone."""
    try:
        guard.stdin.write(line)
        guard.stdin.flush()
    except (OSError, ValueError):
        return False
    return True


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


#: this process's MLX state
PROCESS = MLXProcess()
