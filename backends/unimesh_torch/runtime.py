"""The torch backend's runtime layer: the process group (torchrun, gloo), the exchange that
``unimesh.verify`` uses, and the agreement of ranks before a DeviceMesh is built."""

from __future__ import annotations

import threading
import time
from typing import Any

from unimesh import LaunchError, Layout, Mesh, MeshMismatchError, UnsupportedError, detect_launcher
from unimesh.messages import first_line, short
from unimesh.spmd import ProcessBackend


def import_torch() -> Any:
    import torch

    return torch


def _gather_texts(text: str, device: str) -> list[str]:
    """Every rank's ``text``, by fixed-size ``all_gather`` calls (gloo can abort at exit after
    ``all_gather_object``, so the byte strings travel padded to the longest one)."""
    torch, dist = import_torch(), import_dist()
    world = dist.get_world_size()
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(t.item()) for t in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [bytes(t[: int(n.item())].tolist()).decode() for t, n in zip(every, sizes)]


def import_dist() -> Any:
    import torch.distributed as dist

    return dist


_BROKEN = {"peer_gone": False}
# held while a DeviceMesh is built or looked up: threads converting the same mesh at once get
# one DeviceMesh, and its process groups are created once, in one order
BUILD_LOCK = threading.RLock()


_KEY = "unimesh"  # the store keys this backend writes: unimesh/joined/<rank>, unimesh/check/...
_STORE: list[Any] = []  # the TCPStore of the process group this backend started
_CHECKS = [0]  # verify exchanges so far (each writes its own arrival keys)


def _launch_numbers() -> tuple[int, int]:
    import os

    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError as exc:
        raise LaunchError(
            f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} must be "
            "ints (torchrun sets them)"
        ) from exc


_LINGERING: list[bool] = []


def _store(rank: int, world: int, timeout: float) -> Any:
    """The TCPStore at ``MASTER_ADDR:MASTER_PORT``, as ``init_process_group``'s env:// would
    make it (rank 0 hosts it, or torchrun's agent does), kept so that every rank can read who
    has arrived when a peer is missing."""
    import os
    from datetime import timedelta

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = import_dist().TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    _STORE[:] = [store]
    return store


def _missing(store: Any, stage: str, world: int, settle: float = 0.0) -> str:
    """Which ranks have not written ``unimesh/<stage>/<rank>``, in words, read from the store
    (every rank can ask it, so every rank names the same missing ones).

    A peer that dies closes its connections, so the others can fail at once, while a live but
    slow rank has not arrived yet either; with ``settle`` > 0, while more than one rank is
    missing, the store is read again for up to ``settle`` seconds, so that a straggler that
    arrives meanwhile is not named beside the rank that is gone (if the store's host leaves
    meanwhile, the last reading stands)."""
    if store is None:
        return "a peer process may be gone"
    until = time.monotonic() + settle
    gone: list[int] | None = None
    while True:
        try:
            gone = [r for r in range(world) if not store.check([f"{_KEY}/{stage}/{r}"])]
        except (RuntimeError, ValueError):  # the store's host, rank 0, is gone
            if gone is None:
                return "rank 0, which holds the rendezvous store, is gone"
            break
        if len(gone) <= 1 or time.monotonic() >= until:
            break
        time.sleep(0.05)
    if not gone:
        return "every rank arrived; a peer may have left since"
    return f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} did not arrive"


def _settle(timeout: float, since: float) -> float:
    """How long :func:`_missing` may wait for stragglers after a call that began at ``since``
    failed: up to a quarter of ``timeout`` (5 s at most), and only while the call's own
    ``timeout`` has not run out (after it, whoever is missing had the whole time)."""
    return max(0.0, min(5.0, timeout / 4, since + timeout - time.monotonic()))


def _linger(rank: int, timeout: float) -> None:
    """On rank 0 after a failure, when it hosts the store (outside torchrun, whose agent hosts
    it): stay a few seconds at exit, so that the other ranks, whose own timeouts end about now,
    can still read from the store which rank is missing. At exit, not before the error: the
    error is shown at once, and a launcher that ends the others on the first failure does not
    end this one before it has said why."""
    import atexit
    import os

    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    if hosts and _STORE and not _LINGERING:
        _LINGERING.append(True)
        atexit.register(time.sleep, min(5.0, timeout / 4))


def finish_process_group() -> None:
    """At exit, for a process group this backend started (or by a script that started its
    own, as the last thing it does): leave together, then destroy it (a
    rank gone early can make gloo abort the others). After a peer was found gone, no barrier:
    it would wait for that peer until the group's timeout.

    Two barriers, not one. gloo's barrier keeps the work still in progress when it starts (the
    program's last collective, whose tensors Python already dropped) and its worker thread
    frees the lot just after the barrier completes, which takes the GIL. If the interpreter is
    finalizing by then, the thread exits inside a destructor and the process aborts
    ("terminate called without an active exception", about one run in ten of the examples).
    The second barrier is queued only once that worker has let go of the first (it holds the
    queue's lock while it frees it) and starts with nothing in progress, so the work freed
    after it holds no tensors."""
    dist = import_dist()
    if dist.is_initialized():
        if not _BROKEN["peer_gone"]:
            dist.barrier()
            time.sleep(0.001)  # the GIL released: a worker freeing tensors takes it now
            dist.barrier()
        dist.destroy_process_group()


def _gpu_per_rank() -> int | None:
    """This rank's GPU (``LOCAL_RANK``) when CUDA is there and every rank on this machine
    (``LOCAL_WORLD_SIZE``) can have one of its own; else None: gloo on the CPU. NCCL refuses two
    ranks on one GPU, so four ranks on a one-GPU machine run on the CPU rather than fail."""
    import os

    torch = import_torch()
    if not torch.cuda.is_available():
        return None
    return gpu_for_rank(
        os.environ.get("LOCAL_RANK", "0"),
        os.environ.get("LOCAL_WORLD_SIZE", "1"),
        int(torch.cuda.device_count()),
    )


def gpu_for_rank(local_rank: str, local_world: str, gpus: int) -> int | None:
    """The rule of :func:`_gpu_per_rank`, from torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` and the number of GPUs: the local rank's GPU when every local rank has
    one, else None (also for values that are not torchrun's)."""
    try:
        rank, world = int(local_rank), int(local_world)
    except ValueError:
        return None  # not torchrun's: no way to tell which GPU is this rank's
    return rank if 0 <= rank < world <= gpus else None


class TorchRuntime(ProcessBackend):
    """The runtime layer: torch.distributed's process group, one device per rank."""

    # the backend's state, set up in TorchBackend.__init__ (the layers hold none of their own)
    _meshes: dict[tuple[Any, ...], Any]
    _world_group: Any
    _specs: dict[tuple[Any, ...], Any]
    _native_layouts: dict[Layout, Any]

    def _world(self) -> tuple[int, int]:
        dist = import_dist()
        if not dist.is_available() or not dist.is_initialized():
            launcher = detect_launcher() if dist.is_available() else None
            if launcher is not None and launcher.name == "torchrun":
                return self.initialize(300.0)  # under torchrun: start the group it describes
            raise LaunchError(
                "torch.distributed is not initialized and no torchrun launched this process: "
                "run the script under `torchrun --nproc-per-node N script.py` (unimesh then "
                "starts the process group itself), or call "
                "torch.distributed.init_process_group yourself first"
            )
        return dist.get_rank(), dist.get_world_size()

    def _device_type(self, device_type: str | None) -> str:
        if device_type is not None:
            if not isinstance(device_type, str) or not device_type:
                raise UnsupportedError(
                    f"device_type must be a str like 'cpu' or 'cuda', got {short(device_type)}",
                    backend=self.name,
                )
            return device_type
        torch, dist = import_torch(), import_dist()
        pg_backend = str(dist.get_backend()).lower()
        if "nccl" in pg_backend and torch.cuda.is_available():
            return "cuda"
        return "cpu"

    def _agree(self, mesh: Mesh) -> None:
        """Before a collective group creation: every rank must be building the same mesh, or
        torch would hang. Raise MeshMismatchError on every rank instead (skipped under the fake
        process group, whose collectives carry no data)."""
        dist = import_dist()
        if str(dist.get_backend()).lower() == "fake" or dist.get_world_size() == 1:
            return
        import hashlib

        torch = import_torch()
        text = mesh.to_string()
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
        device = self._device_type(None)
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        if all(int(t.item()) == digest for t in every):
            return
        seen = _gather_texts(text, device)  # only now: to say how they differ
        rank = dist.get_rank()
        other = next(r for r, s in enumerate(seen) if s != text)
        raise MeshMismatchError(
            f"ranks disagree about the mesh to build: rank {rank} has {text!r}, rank {other} "
            f"has {seen[other]!r}. A DeviceMesh is created by every rank together; to get a "
            "rank's own submesh, convert the whole mesh first and then its submesh "
            "(unimesh_torch.axis_mesh(mesh, axes))"
        )

    def launcher(self, processes: int) -> tuple[list[str], dict[str, str]]:
        """torchrun (``python -m torch.distributed.run --standalone``), gloo over loopback."""
        import os
        import sys

        return (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={processes}",
            ],
            {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")},
        )

    def initialize(self, timeout: float, launch: Any = None) -> tuple[int, int]:
        """``init_process_group`` (gloo; gloo + nccl when every rank on this machine has a GPU
        of its own, which becomes its current device) from the launcher's
        ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, every rank joining within
        ``timeout`` seconds; ``launch``'s coordinator ("host:port"), process count and id win
        over them. A process group already started (by the user or torchrun code) is used as
        it is."""
        import os
        from datetime import timedelta

        dist = import_dist()
        if launch is not None and not dist.is_initialized():
            address, procs, pid = launch
            if address is not None:
                host, sep, port = address.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise LaunchError(
                        f"coordinator_address {address!r} must be 'host:port' (torch's "
                        "MASTER_ADDR and MASTER_PORT)"
                    )
                os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port
            if procs is not None:
                os.environ["WORLD_SIZE"] = str(procs)
            if pid is not None:
                os.environ["RANK"] = str(pid)
        if not dist.is_initialized():
            needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            missing = [v for v in needed if v not in os.environ]
            if missing:
                raise LaunchError(
                    f"the torch backend needs a process group, and the launcher's "
                    f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: run "
                    "under torchrun (torchrun --standalone --nproc-per-node N script.py, one "
                    "process per device of the mesh), or "
                    f"set {', '.join(needed)}"
                )
            gpu = _gpu_per_rank()
            kind = "gloo" if gpu is None else "cpu:gloo,cuda:nccl"
            if gpu is not None:
                import_torch().cuda.set_device(gpu)
            rank, world = _launch_numbers()
            since = time.monotonic()
            try:
                store = _store(rank, world, timeout)
                store.set(f"{_KEY}/joined/{rank}", "1")
                dist.init_process_group(
                    kind,
                    store=store,
                    rank=rank,
                    world_size=world,
                    timeout=timedelta(seconds=timeout),
                )
            except (RuntimeError, ValueError) as exc:
                first = first_line(exc)
                absent = _missing(
                    _STORE[0] if _STORE else None, "joined", world, _settle(timeout, since)
                )
                _linger(rank, timeout)
                raise LaunchError(
                    f"torch.distributed.init_process_group({kind!r}) failed for RANK="
                    f"{rank} of WORLD_SIZE={world} at {os.environ['MASTER_ADDR']}:"
                    f"{os.environ['MASTER_PORT']} within {timeout:.0f} s ({absent}): {first}"
                ) from exc
            import atexit

            atexit.register(finish_process_group)
        return int(dist.get_rank()), int(dist.get_world_size())

    def exchange(self, payload: bytes, timeout: float) -> list[bytes]:
        """A gloo ``monitored_barrier`` first (a rank that is gone or stuck is reported within
        ``timeout`` instead of hanging), then fixed-size ``all_gather`` calls."""
        from datetime import timedelta

        dist = import_dist()
        rank, world = self.initialize(timeout)
        if world == 1 or str(dist.get_backend()).lower() == "fake":
            return [payload] * world
        _CHECKS[0] += 1
        stage = f"check{_CHECKS[0]}"
        store = _STORE[0] if _STORE else None
        since = time.monotonic()
        try:
            if store is not None:  # every rank can then name who did not come
                store.set(f"{_KEY}/{stage}/{rank}", "1")
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
            texts = _gather_texts(payload.hex(), "cpu")
        except (RuntimeError, dist.DistError) as exc:
            _BROKEN["peer_gone"] = True
            absent = _missing(store, stage, world, _settle(timeout, since))
            _linger(rank, timeout)
            raise MeshMismatchError(
                f"rank {rank} of {world}: a peer process is gone or stuck (it did not take part "
                f"in the check within {timeout:.0f} s; {absent}): "
                f"{first_line(exc)}"
            ) from exc
        return [bytes.fromhex(t) for t in texts]

    def prepare_devices(self, count: int) -> int:
        """The world size: under a launcher (torchrun sets RANK/WORLD_SIZE) the gloo process
        group is started if it is not (:meth:`initialize`); with no launcher and no process
        group, a :class:`~unimesh.LaunchError` that names the launcher. ``count`` cannot change
        it: the launcher decides."""
        return self.initialize(1800.0)[1]
