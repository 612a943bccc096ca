"""``unimesh.link``: a model's weights handed from one job to another (a trainer to an inference
job), each receiving process getting only its own blocks, straight from the sending processes
that hold them.

How the two jobs meet: every process of both jobs calls :func:`link` with the same ``address``.
Process 0 of the job whose name sorts first hosts the rendezvous there (a key-value store of
the link's engine); every other process connects to it. Each process writes its place, waits
for every process of both jobs, and the engine makes one group of both jobs' processes (the
first job's processes first), apart from each job's own. A transfer is one :meth:`Link.send`
in the sending job against one :meth:`Link.receive` in the other: both describe their side
(a manifest: names, shapes, dtypes, layouts, where each device lives), both check the pair
the same way, so every process of both jobs raises the same :class:`~unimesh.LinkError`
before any byte moves; then each pair of processes exchanges the pieces of the live
reshard's plan (:mod:`unimesh.moves`), one message each: straight from block to block where
a piece is one run of memory at both ends, else staged in rounds of bounded bytes; every
process marks
the transfer done. A heartbeat per process lets the survivors name a process that died or
stopped answering.

The engine comes from the ``unimesh.links`` entry points (``Engine``: a store and a group that
moves byte buffers point to point); the torch backend's is torch.distributed over gloo.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .checkpoint.format import DTYPES, dtype_text, numpy_dtype
from .errors import BackendUnavailableError, LaunchError, LinkError, UnimeshError
from .fusion import Concat, Segment, Slice, check_sources, segments
from .layout import Layout
from .mesh import Mesh
from .messages import short
from .moves import IN_FLIGHT, Boxes, Piece, plan
from .spec import PartitionSpec

__all__ = ["ENGINES", "Engine", "Link", "Message", "Store", "Wire", "link"]

#: the entry-point group of link engines
ENGINES = "unimesh.links"
#: the environment variable naming the engine, where several are installed
ENGINE_VAR = "UNIMESH_LINK_ENGINE"
#: seconds between two heartbeats of a process; a process whose count stands still for
#: ``STALE`` seconds is named as stopped
BEAT, STALE = 0.5, 5.0


class Store(Protocol):
    """The rendezvous: a key-value store every process of both jobs reaches (torch's
    ``TCPStore`` has this shape)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...


#: one message on the wire: (link process, tag, flat uint8 buffer)
Message = tuple[int, int, np.ndarray]


class Wire(Protocol):
    """A group of both jobs' processes moving byte buffers point to point."""

    def start(self, sends: Sequence[Message], receives: Sequence[Message]) -> Callable[[], None]:
        """Start each message: ``(q, tag, buffer)`` sends the flat uint8 ``buffer`` to link
        process ``q`` (it may be read-only) or fills it from ``q``, matched by ``tag``;
        the returned call waits until all are done, raising on a failure or after the
        engine's timeout. Many messages, on many tags, may be in flight at once."""
        ...

    def close(self) -> None: ...


class Engine(Protocol):
    """What a ``unimesh.links`` entry point gives: the store and the group."""

    def store(self, host: str, port: int, is_host: bool, timeout: float) -> Store: ...
    def connect(self, store: Store, prefix: str, rank: int, size: int, timeout: float) -> Wire: ...


def _engine() -> Engine:
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group=ENGINES)}
    want = os.environ.get(ENGINE_VAR, "").strip()
    if not found:
        raise BackendUnavailableError(
            "unimesh.link moves bytes on torch.distributed, which is not installed in this "
            'job: pip install "unimesh[torch]" (every process of both jobs needs it)'
        )
    if want and want not in found:
        raise LinkError(f"{ENGINE_VAR}={want!r} names no link engine; installed: {sorted(found)}")
    name = want or min(found)
    made: Engine = found[name].load()()
    return made


def _address(address: object) -> tuple[str, int]:
    if not isinstance(address, str) or address.count(":") < 1:
        raise LinkError(
            f"link(address=...) takes 'host:port', the one address both jobs share, got "
            f"{short(address)}"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LinkError(
            f"link(address={address!r}): give 'host:port' with a port in 1..65535, e.g. "
            "'127.0.0.1:29600'"
        )
    return host.strip("[]"), int(port)


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 64 or not value.isprintable():
        raise LinkError(
            f"link({what}=...) takes a job's name (1-64 printable characters), got {short(value)}"
        )
    if "/" in value:
        raise LinkError(f"link({what}={value!r}): a job's name has no '/'")
    return value


def _place(timeout: float) -> tuple[Any, int, int]:
    """(the job's backend or None, this process's index in its job, the job's processes)."""
    from .runtime import detect_launcher, initialize, started

    got = started()
    if got is None and detect_launcher() is not None:
        initialize(timeout=timeout)
        got = started()
    return (None, 0, 1) if got is None else got


def link(address: str, *, job: str, peer: str, timeout: float = 300.0) -> Link:
    """Join the link between this job (``job``) and another (``peer``) at ``address``.

    Every process of both jobs calls it, after :func:`unimesh.initialize` in a job of several
    processes; process 0 of the job whose name sorts first hosts the rendezvous at
    ``address``. Returns once every process of both jobs has joined, else raises
    :class:`~unimesh.LaunchError` naming the job and the processes missing after
    ``timeout`` seconds. ``timeout`` also bounds every wait of a transfer: a process that
    dies or stops answering makes every survivor raise :class:`~unimesh.LinkError` naming
    it, within ``timeout`` + 15 s.
    """
    host, port = _address(address)
    mine, theirs = _name(job, "job"), _name(peer, "peer")
    if mine == theirs:
        raise LinkError(f"link(job={job!r}, peer={peer!r}): the two jobs need different names")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e7:
        raise LinkError(f"link(timeout=...) takes seconds > 0, got {short(timeout)}")
    seconds = float(timeout)
    be, me, count = _place(seconds)
    return Link(_engine(), host, port, mine, theirs, be, me, count, seconds)


class _Side:
    """One job in the link: its name, its processes and the link rank of its process 0."""

    def __init__(self, name: str, count: int, offset: int) -> None:
        self.name, self.count, self.offset = name, count, offset

    def owns(self, rank: int) -> bool:
        return self.offset <= rank < self.offset + self.count


class Link:
    """Two jobs joined by :func:`link`: :meth:`send` in one, :meth:`receive` in the other, any
    number of times, in the same order in both."""

    def __init__(
        self,
        engine: Engine,
        host: str,
        port: int,
        job: str,
        peer: str,
        backend: Any,
        me: int,
        count: int,
        timeout: float,
    ) -> None:
        self.job, self.peer, self.timeout = job, peer, timeout
        self.address = f"{host}:{port}"
        self._backend, self._me = backend, me
        #: the last version received (on the receiving side) or sent
        self.version: int | None = None
        #: transfers planned so far (a repeated transfer of the same tensors replays its plan)
        self.plans = 0
        self._transfers = 0
        self._schedules: dict[tuple[str, str], _Schedule] = {}
        #: staging memory of the even and the odd rounds (see _arena)
        self._arenas = [np.empty(0, np.uint8)] * 2
        self._closed = False
        self._broken = False  # a transfer failed: close() waits for no one
        first = job < peer
        self._hosting = first and me == 0
        self._store_host = f"process 0 of job {min(job, peer)!r}, which hosts {self.address}"
        try:
            self._store = engine.store(host, port, self._hosting, timeout)
        except Exception as exc:  # noqa: BLE001 - the engine's own errors, said as ours
            raise LaunchError(
                f"job {job!r} process {me} could not "
                f"{'host' if self._hosting else 'reach'} the link's rendezvous at "
                f"{self.address} within {timeout:g} s ({type(exc).__name__}: {exc}); "
                + (
                    "choose a free port"
                    if self._hosting
                    else f"start the job {min(job, peer)!r} (its process 0 hosts it)"
                )
            ) from None
        st = self._store
        where = f"{socket.gethostname()} pid {os.getpid()}"
        deadline = time.monotonic() + timeout
        self._safe(lambda: st.set(f"size/{job}", str(count)))
        self._safe(lambda: st.set(f"in/{job}/{me}", where))
        if not self._poll([f"size/{peer}"], deadline, "join/fail", LaunchError):
            raise self._give_up(
                "join/fail",
                f"job {peer!r} did not join the link at {self.address} within {timeout:g} s "
                f"(job {job!r} waited); start it with link(..., job={peer!r}, peer={job!r})",
                LaunchError,
                [f"{job}/{i}" for i in range(count) if st.check([f"in/{job}/{i}"])],
            )
        theirs = int(self._safe(lambda: st.get(f"size/{peer}")))
        self.mine = _Side(job, count, 0 if first else theirs)
        self.other = _Side(peer, theirs, count if first else 0)
        keys = [f"in/{s.name}/{i}" for s in (self.mine, self.other) for i in range(s.count)]
        if not self._poll(keys, deadline, "join/fail", LaunchError):
            missing = {
                s.name: [i for i in range(s.count) if not st.check([f"in/{s.name}/{i}"])]
                for s in (self.mine, self.other)
            }
            said = "; ".join(f"job {n!r} processes {m}" for n, m in missing.items() if m)
            raise self._give_up(
                "join/fail",
                f"the link at {self.address} did not fill within {timeout:g} s: missing {said} "
                "(each process of both jobs must call unimesh.link)",
                LaunchError,
                [
                    f"{s.name}/{i}"
                    for s in (self.mine, self.other)
                    for i in range(s.count)
                    if i not in missing[s.name]
                ],
            )
        self.rank = self.mine.offset + me
        self.size = count + theirs
        self._beats: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        beat_store = engine.store(host, port, False, timeout)
        self._beater = threading.Thread(
            target=self._beat, args=(beat_store,), name="unimesh-link-heartbeat", daemon=True
        )
        self._beater.start()
        try:
            self._wire = engine.connect(st, "wire/", self.rank, self.size, timeout)
        except Exception as exc:  # noqa: BLE001 - the engine's own errors, said as ours
            self._stop.set()
            raise LaunchError(
                f"the link's group of {self.size} processes at {self.address} did not form "
                f"({type(exc).__name__}: {exc})"
            ) from None

    # -- liveness ---------------------------------------------------------------------------
    def _beat(self, store: Store) -> None:
        key = f"beat/{self.rank}"
        while not self._stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 - the rendezvous is gone: the waits say so
                return
            self._stop.wait(BEAT)

    def _who(self, rank: int) -> str:
        job, index = self._ident(rank).split("/")
        return f"process {index} of job {job!r}"

    def _stalled(self) -> list[int]:
        """Link ranks whose heartbeat stood still for ``STALE`` seconds (each call samples)."""
        now = time.monotonic()
        out = []
        for r in range(self.size):
            if r == self.rank:
                continue
            count = int(self._safe(functools.partial(self._store.add, f"beat/{r}", 0)))
            last = self._beats.get(r)
            if last is None or last[0] != count:
                self._beats[r] = (count, now)
            elif now - last[1] > STALE:
                out.append(r)
        return out

    def _safe(self, call: Callable[[], Any]) -> Any:
        """A store call; a failure is the rendezvous's host gone."""
        try:
            return call()
        except Exception as exc:
            if isinstance(exc, UnimeshError):
                raise
            raise LinkError(
                f"job {self.job!r} process {self._me}: the link's rendezvous stopped "
                f"answering ({self._store_host}; {type(exc).__name__}: {exc})"
            ) from None

    def _poll(
        self,
        keys: list[str],
        deadline: float,
        fail: str | None,
        kind: type[Exception] = LinkError,
        watch: bool = True,
    ) -> bool:
        """Wait until every key is set (True), or the deadline passes (False); raise ``kind``
        as soon as ``fail`` is set (another process's error, acknowledged) or a process stops
        answering."""
        pause = 0.001
        started = time.monotonic()
        next_look = started + 1.0
        while True:
            if self._safe(lambda: self._store.check(keys)):
                return True
            if fail is not None and self._safe(lambda: self._store.check([fail])):
                text = self._safe(lambda: self._store.get(fail)).decode()
                raise self._give_up(fail, text, kind, self._members())
            now = time.monotonic()
            if now >= deadline:
                return False
            if watch and now >= next_look and hasattr(self, "rank"):
                stalled = self._stalled()
                if stalled:
                    raise self._failed(fail, None, stalled)
                next_look = now + 1.0
            time.sleep(pause)
            # a transfer's waits are short: answer within 5 ms for 2 s, then poll gently
            pause = min(pause * 2, 0.005 if now - started < 2.0 else 0.1)

    def _ack(self, fail: str) -> None:
        """Say this process has seen the failure ``fail`` (the rendezvous's host waits for
        every survivor's word before it goes)."""
        with contextlib.suppress(Exception):
            self._store.set(f"{fail}/ack/{self.job}/{self._me}", "1")

    def _give_up(
        self, fail: str, text: str, kind: type[Exception], waiting: list[str]
    ) -> Exception:
        """Publish a failure every process of both jobs raises, acknowledge it, and, on the
        process hosting the rendezvous, wait (bounded) for ``waiting`` (``job/index`` of the
        survivors) to acknowledge it too, so that they read it before the store goes."""
        with contextlib.suppress(Exception):
            if not self._store.check([fail]):
                self._store.set(fail, text)
            text = self._store.get(fail).decode()
        self._ack(fail)
        if self._hosting:  # the store goes with this process: wait for the others' word
            deadline = time.monotonic() + self.timeout + STALE
            left = list(waiting)
            with contextlib.suppress(Exception):
                while left and time.monotonic() < deadline:
                    left = [w for w in left if not self._store.check([f"{fail}/ack/{w}"])]
                    if left and hasattr(self, "rank"):  # no word to wait for from the stopped
                        gone = {self._ident(r) for r in self._stalled()}
                        left = [w for w in left if w not in gone]
                    time.sleep(0.1)
        return kind(text)

    def _ident(self, rank: int) -> str:
        """``job/index`` of a link rank."""
        side = self.mine if self.mine.owns(rank) else self.other
        return f"{side.name}/{rank - side.offset}"

    def _members(self) -> list[str]:
        """``job/index`` of every process that joined (all of both jobs once the link is up)."""
        if hasattr(self, "rank"):
            return [self._ident(r) for r in range(self.size)]
        st, out = self._store, []
        with contextlib.suppress(Exception):
            for job in (self.job, self.peer):
                count = int(st.get(f"size/{job}")) if st.check([f"size/{job}"]) else 0
                out += [f"{job}/{i}" for i in range(count) if st.check([f"in/{job}/{i}"])]
        return out

    def _failed(
        self, fail: str | None, cause: BaseException | None, stalled: list[int]
    ) -> LinkError:
        """The error every survivor raises: another process's published failure, else the
        processes that stopped, else the cause."""
        found = None
        if not stalled and cause is not None:  # a peer's socket closed: find who stopped
            until = time.monotonic() + STALE + 2 * BEAT + 1.0
            while not stalled and time.monotonic() < until:
                if fail is not None and self._safe(lambda: self._store.check([fail])):
                    found = self._safe(lambda: self._store.get(fail)).decode()
                    break
                time.sleep(0.25)
                stalled = self._stalled()
        if found is not None:
            text = found
        elif stalled:
            text = (
                f"the link between jobs {self.job!r} and {self.peer!r} lost "
                + ", ".join(self._who(r) for r in stalled)
                + f": it died or stopped answering (no heartbeat for {STALE:g} s)"
            )
        else:
            text = (
                f"job {self.job!r} process {self._me}: a transfer of the link at "
                f"{self.address} failed ({type(cause).__name__}: {cause})"
            )
        self._broken = True
        if fail is None:
            return LinkError(text)
        survivors = [self._ident(r) for r in range(self.size) if r not in stalled]
        made = self._give_up(fail, text, LinkError, survivors)
        assert isinstance(made, LinkError)
        return made

    # -- transfers ---------------------------------------------------------------------------
    def _open(self, what: str) -> int:
        if self._closed:
            raise LinkError(f"{what} on a closed link (jobs {self.job!r}, {self.peer!r})")
        if self._broken:  # its messages may still be posted: a new transfer could meet them
            raise LinkError(
                f"{what}: an earlier transfer on this link (jobs {self.job!r}, {self.peer!r}) "
                "failed while its bytes moved; close it and open a new link"
            )
        seq = self._transfers
        self._transfers += 1
        return seq

    def _publish(self, seq: int, side: str, manifest: dict[str, Any]) -> None:
        """This job's manifest for transfer ``seq`` (written by its process 0)."""
        if self._me == 0:
            text = json.dumps(manifest)
            self._safe(lambda: self._store.set(f"t{seq}/{side}", text))

    def _other(self, seq: int, side: str) -> dict[str, Any]:
        """The other job's manifest for transfer ``seq`` (``side``: its role)."""
        key = f"t{seq}/{side}"
        if not self._poll([key], time.monotonic() + self.timeout, f"t{seq}/fail"):
            doing = "receive" if side == "recv" else "send"
            raise self._failed(
                f"t{seq}/fail",
                TimeoutError(f"job {self.peer!r} did not {doing} within {self.timeout:g} s"),
                [],
            )
        got: dict[str, Any] = json.loads(self._safe(lambda: self._store.get(key)))
        return got

    def _finish(self, seq: int, side: str, error: BaseException | None) -> None:
        """Every process marks the transfer done (or failed) and waits for all others."""
        fail = f"t{seq}/fail"
        if error is not None:
            raise self._failed(fail, error, [])
        self._safe(lambda: self._store.set(f"t{seq}/done/{self.rank}", "1"))
        keys = [f"t{seq}/done/{r}" for r in range(self.size)]
        if not self._poll(keys, time.monotonic() + self.timeout, fail):
            late = [r for r in range(self.size) if not self._store.check([keys[r]])]
            raise self._failed(
                fail,
                TimeoutError(
                    "not done within the timeout: " + ", ".join(self._who(r) for r in late)
                ),
                [],
            )
        if self._me == 0:  # every process has read both manifests: this job's goes
            with contextlib.suppress(Exception):  # (a store without deletes keeps it)
                self._store.delete_key(f"t{seq}/{side}")

    def send(
        self, tree: Any, *, version: int | None = None, stats: dict[str, int] | None = None
    ) -> None:
        """Hand ``tree`` (DTensors, ``jax.Array`` s, ``MLXArray`` s; numpy in a job of one
        process) to the other job's matching :meth:`receive`, every process of this job with
        the arrays it holds. Returns once its bytes are received. ``version`` (an int) is what
        a ``receive(version=k)`` checks; ``stats`` gets ``bytes_sent``."""
        seq = self._open("send()")
        try:
            _check_version(version)
            _check_stats(stats)
            manifest, blocks = _outgoing(tree, self._me, self.mine.count)
            manifest["version"] = version
        except UnimeshError as exc:
            self._publish(seq, "send", {"error": f"job {self.job!r}: {exc}"})
            raise
        self._publish(seq, "send", manifest)
        theirs = self._other(seq, "recv")
        if "error" in theirs:
            raise LinkError(theirs["error"])
        problem = _problem(manifest, theirs, self.job, self.peer)
        if problem:
            raise LinkError(problem)
        schedule = self._schedule(manifest, theirs, None)
        error = None
        try:
            self._send(schedule, blocks)
        except Exception as exc:  # noqa: BLE001 - every process learns of it in _finish
            error = exc
        self._finish(seq, "send", error)
        self.version = version
        _add(stats, schedule.stats)

    def receive(
        self,
        target: Any,
        *,
        version: int | None = None,
        stats: dict[str, int] | None = None,
        sources: Mapping[str, str | Concat | Slice] | None = None,
        dtype: Any = None,
        backend: Any = None,
    ) -> Any:
        """The other job's next :meth:`send`, laid out as ``target``: a dict name ->
        :class:`~unimesh.Layout`, a pytree of Layouts (names are tree paths joined with
        ``.``), a :class:`~unimesh.LayoutMap` with a mesh (every sent tensor, by its name), or
        existing arrays (DTensors and numpy filled in place, others made anew laid out like
        them). ``sources`` maps a target name to a sent name, :class:`~unimesh.Concat` or
        :class:`~unimesh.Slice`; ``dtype`` (one, or a dict name -> dtype) types targets given
        as layouts (the sender casts). ``version``: accept that version only. ``backend``:
        the framework of the arrays made (default: the one this job initialized). Returns
        the target's structure holding the arrays, bit for bit the sender's values."""
        seq = self._open("receive()")
        theirs = self._other(seq, "send")
        if "error" in theirs:
            raise LinkError(theirs["error"])
        try:
            _check_version(version)
            _check_stats(stats)
            wanted = _Targets(target, theirs, check_sources(sources), dtype, backend, self)
            manifest = wanted.manifest(version)
        except UnimeshError as exc:
            self._publish(seq, "recv", {"error": f"job {self.job!r}: {exc}"})
            raise
        self._publish(seq, "recv", manifest)
        problem = _problem(theirs, manifest, self.peer, self.job)
        if problem:
            raise LinkError(problem)
        schedule = self._schedule(theirs, manifest, wanted)
        blocks = wanted.blocks(schedule)
        error = None
        try:
            self._receive(schedule, blocks)
        except Exception as exc:  # noqa: BLE001 - every process learns of it in _finish
            error = exc
        try:
            self._finish(seq, "recv", error)
        except LinkError as exc:
            touched = wanted.in_place()
            if touched:
                said = f"{exc.args[0]}; these targets were being filled in place and may hold "
                exc.args = (f"{said}parts of the new values: {touched}",)
            raise
        self.version = theirs.get("version")
        _add(stats, schedule.stats)
        return wanted.result(blocks)

    def _schedule(
        self, sent: dict[str, Any], wanted: dict[str, Any], targets: _Targets | None
    ) -> _Schedule:
        key = (json.dumps(sent["tensors"]), json.dumps([wanted["tensors"], wanted["sources"]]))
        found = self._schedules.get(key)
        if found is None:
            found = self._schedules[key] = _Schedule(sent, wanted, self, targets)
            self.plans += 1
        return found

    def _send(self, schedule: _Schedule, blocks: dict[str, dict[int, np.ndarray]]) -> None:
        """The free units posted at once; the staged ones round by round, each round packed
        while the one before is on the wire (two in flight); then any free unit whose sent
        block is not laid out in C order after all (a transposed local tensor), packed two
        at a time (its receiver posted it at once: any order is safe)."""

        def message(q: int, u: _Unit, arena: np.ndarray) -> Message | None:
            """``u`` from its block's own memory, else packed in ``arena`` (cast to the
            target's dtype on the way); None where it needs packing and ``arena`` is
            :data:`_NOT_STAGED`."""
            part = blocks[u.name][u.device][_box(u.lo, u.hi)]
            flat = _flat(part, u.dtype, writable=False)
            if flat is None:
                if arena is _NOT_STAGED:
                    return None
                flat = _staging(arena, u)
                flat.view(u.dtype).reshape(u.shape)[...] = part
            return q, u.tag, flat

        direct, packed = [], []
        for q, u in schedule.free:
            sent = message(q, u, _NOT_STAGED)
            if sent is None:
                packed.append((q, _at_start(u)))
            else:
                direct.append(sent)
        free = self._wire.start(direct, [])
        rounds = [*schedule.staged, *([one] for one in packed)]
        size = max([schedule.arena, *(u.nbytes for _, u in packed)])
        waiting: Callable[[], None] | None = None
        for r, units in enumerate(rounds):
            arena = self._arena(r % 2, size)
            made = [message(q, u, arena) for q, u in units]
            posted = self._wire.start([m for m in made if m is not None], [])
            if waiting is not None:
                waiting()
            waiting = posted
        if waiting is not None:
            waiting()
        free()

    def _receive(self, schedule: _Schedule, blocks: dict[str, dict[int, np.ndarray]]) -> None:
        """The free units posted at once, straight into the target blocks; the staged ones
        round by round, each round posted before the one before is unpacked (two in
        flight)."""

        Pending = list[tuple[_Unit, np.ndarray, int]]

        def post(units: list[tuple[int, _Unit]], arena: np.ndarray | None) -> tuple[Pending, Any]:
            inbox, unpack = [], []
            for q, u in units:
                device, lo, hi = u.into[0]  # straight into the first target block
                flat = _flat(blocks[u.name][device][_box(lo, hi)], u.dtype)
                if flat is None:
                    flat = _staging(arena, u)
                    unpack.append((u, flat, 0))
                elif len(u.into) > 1:  # then copied into the others
                    unpack.append((u, flat, 1))
                inbox.append((q, u.tag, flat))
            return unpack, self._wire.start([], inbox)

        def unpack(done: Pending) -> None:
            for u, buf, first in done:
                part = buf.view(u.dtype).reshape(u.shape)
                for device, lo, hi in u.into[first:]:
                    blocks[u.name][device][_box(lo, hi)] = part

        def post_round(r: int) -> tuple[Pending, Any] | None:
            if r >= len(schedule.staged):
                return None
            return post(schedule.staged[r], self._arena(r % 2, schedule.arena))

        free_unpack, free = post(schedule.free, None)
        ahead = post_round(0)
        for r in range(len(schedule.staged)):
            assert ahead is not None
            todo, wait = ahead
            ahead = post_round(r + 1)  # its arena's round before (r - 1) is unpacked
            wait()
            unpack(todo)
        free()
        unpack(free_unpack)

    def _arena(self, parity: int, size: int) -> np.ndarray:
        """The staging memory of every other round (``parity``), kept from one transfer to
        the next (at most ``IN_FLIGHT`` for both) and let go by :meth:`close`."""
        if self._arenas[parity].size < size:
            self._arenas[parity] = np.empty(size, np.uint8)
        return self._arenas[parity]

    def close(self) -> None:
        """Leave the link; the process hosting the rendezvous waits (up to the timeout) for
        every other to leave first."""
        if self._closed:
            return
        self._closed = True
        try:
            self._store.set(f"closed/{self.rank}", "1")
            if self._hosting and not self._broken:
                keys = [f"closed/{r}" for r in range(self.size)]
                self._poll(keys, time.monotonic() + min(self.timeout, 60.0), None, watch=False)
        except UnimeshError:
            pass
        finally:
            self._stop.set()
            self._wire.close()
            self._arenas = [np.empty(0, np.uint8)] * 2

    def __enter__(self) -> Link:  # noqa: PYI034 - Link is final
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Link({self.address}, job={self.job!r} ({self.mine.count} processes), "
            f"peer={self.peer!r} ({self.other.count}))"
        )


def _box(lo: tuple[int, ...], hi: tuple[int, ...]) -> Any:
    """The index of the box ``[lo, hi)`` (``...`` for a 0-d block: a view, not a scalar)."""
    return tuple(slice(a, b) for a, b in zip(lo, hi)) if lo else ...


def _flat(view: np.ndarray, dtype: np.dtype[Any], writable: bool = True) -> np.ndarray | None:
    """``view``'s own bytes as one flat uint8 array, where it is one C-order run of ``dtype``
    (and writable, if asked: a receive's); else None (it is staged)."""
    if view.dtype != dtype or not view.flags.c_contiguous:
        return None
    if writable and not view.flags.writeable:
        return None
    return view.reshape(-1).view(np.uint8)


#: the arena of a unit that is not to be packed (see Link._send)
_NOT_STAGED = np.empty(0, np.uint8)


def _at_start(u: _Unit) -> _Unit:
    """A copy of ``u`` staged at the start of an arena."""
    out = _Unit()
    for name in _Unit.__slots__:
        setattr(out, name, getattr(u, name))
    out.at = 0
    return out


def _staging(arena: np.ndarray | None, u: _Unit) -> np.ndarray:
    """Where a staged unit is packed or received: its place in its round's arena (a free
    unit, always one run at both ends, has none: new memory, should it ever be staged)."""
    if arena is None:
        return np.empty(u.nbytes, np.uint8)
    return arena[u.at : u.at + u.nbytes]


def _one_run(sizes: Sequence[int], block: Any) -> bool:
    """Whether a box of shape ``sizes`` inside a C-order block of shape ``block`` is one
    stretch of its memory: every dimension after the first one longer than 1 is whole."""
    first = next((d for d, n in enumerate(sizes) if n > 1), len(sizes))
    return all(sizes[d] == block[d] for d in range(first + 1, len(sizes)))


# -- manifests -------------------------------------------------------------------------------
def _check_version(version: object) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise LinkError(f"version must be an int (or None), got {short(version)}")


def _check_stats(stats: object) -> None:
    if stats is not None and not isinstance(stats, dict):
        raise LinkError(f"stats takes a dict to fill, got {short(stats)}")


def _add(stats: dict[str, int] | None, counted: Mapping[str, int]) -> None:
    if stats is not None:
        for key in ("bytes_sent", "bytes_received", "bytes_copied"):
            stats[key] = stats.get(key, 0) + int(counted.get(key, 0))


def _layout_json(layout: Layout, processes: Sequence[int]) -> dict[str, Any]:
    spec = [e if e is None or isinstance(e, str) else list(e) for e in layout.spec]
    return {
        "mesh": layout.mesh.to_dict(),
        "spec": spec,
        "partial": dict(layout.spec.partial),
        "processes": [int(p) for p in processes],
    }


def _layout(doc: Mapping[str, Any]) -> Layout:
    entries = [e if e is None or isinstance(e, str) else tuple(e) for e in doc["spec"]]
    return Layout(
        Mesh.from_dict(doc["mesh"]), PartitionSpec(*entries, partial=doc["partial"] or None)
    )


#: the one-device layout of a numpy array in a job of one process
WHOLE = Layout(Mesh((1,), ("whole",)), PartitionSpec())


def _numpy_dtype(name: str) -> np.dtype[Any]:
    if name not in DTYPES:
        raise LinkError(
            f"dtype {name} cannot travel on a link; it carries {', '.join(DTYPES)}: cast first"
        )
    return numpy_dtype(name)


def _outgoing(
    tree: Any, me: int, count: int
) -> tuple[dict[str, Any], dict[str, dict[int, np.ndarray]]]:
    """The sending job's manifest and this process's blocks (numpy, by device), by name."""
    from .checkpoint.tree import flatten
    from .convert import layout_of, local_shards

    names, leaves, _ = flatten(tree)
    tensors, blocks = [], {}
    for name, leaf in zip(names, leaves):
        if isinstance(leaf, Layout):
            raise LinkError(f"send() sends arrays; tensor {name!r} is a Layout ({leaf!r})")
        found = layout_of(leaf)
        if found is None:
            if not isinstance(leaf, np.ndarray) or count > 1:
                raise LinkError(
                    f"tensor {name!r} is {short(leaf, 60)}, not a distributed array: send "
                    "DTensors, jax.Arrays or MLXArrays (numpy only from a job of one process)"
                )
            layout, held, processes = WHOLE, {0: leaf}, [0]
        else:
            be, layout = found
            held = {d: np.asarray(b) for d, b in local_shards(leaf, backend=be).items()}
            processes = be.transport().processes(layout.mesh.device_ids.ravel().tolist())
        if layout.spec.partial:
            raise LinkError(
                f"tensor {name!r} is sent as a pending reduction ({layout.spec!r}): a link "
                "moves values, so reduce it first (DTensor.redistribute to Replicate, a psum "
                "in the program)"
            )
        shape = [int(n) for n in leaf.shape]
        dtype = dtype_text(leaf.dtype)
        _numpy_dtype(dtype)
        tensors.append([name, shape, dtype, _layout_json(layout, processes)])
        blocks[name] = held
    return {"tensors": tensors}, blocks


def _casts(src: str, dst: str) -> bool:
    if src == dst:
        return True
    a, b = _numpy_dtype(src), _numpy_dtype(dst)
    floats = "float" in src and "float" in dst
    ints = a.kind in "iu" and b.kind in "iu" and np.can_cast(a, b, "safe")
    return floats or bool(ints)


def _encode_sources(sources: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sources.items():
        if isinstance(v, Concat):
            out[k] = {"concat": list(v.names), "dim": v.dim}
        elif isinstance(v, Slice):
            out[k] = {"slice": v.name, "dim": v.dim, "start": v.start, "stop": v.stop}
        else:
            out[k] = v
    return out


def _decode_source(v: Any) -> str | Concat | Slice:
    if isinstance(v, str):
        return v
    if "concat" in v:
        return Concat(v["concat"], v["dim"])
    return Slice(v["slice"], v["dim"], v["start"], v["stop"])


def _problem(sent: dict[str, Any], wanted: dict[str, Any], sender: str, receiver: str) -> str:
    """The first disagreement between the two jobs' manifests (the same text on every process
    of both), or ''."""
    if "error" in wanted:
        return str(wanted["error"])
    if wanted["version"] is not None and sent["version"] != wanted["version"]:
        said = "no version" if sent["version"] is None else f"version {sent['version']}"
        return (
            f"job {sender!r} sent {said}, job {receiver!r} asked for version "
            f"{wanted['version']}; nothing was moved"
        )
    shapes = {t[0]: tuple(t[1]) for t in sent["tensors"]}
    dtypes = {t[0]: t[2] for t in sent["tensors"]}
    sources = wanted["sources"]
    for name, shape, dtype, layout in wanted["tensors"]:
        source = _decode_source(sources.get(name, name))
        try:
            whole, runs = segments(name, source, shapes)
        except UnimeshError as exc:
            return f"job {receiver!r}: {exc}"
        if shape is not None and tuple(shape) != whole:
            return (
                f"tensor {name!r}: job {sender!r} sends shape {whole}, job {receiver!r} wants "
                f"{tuple(shape)}; nothing was moved"
            )
        if len(layout["spec"]) > len(whole):
            return (
                f"tensor {name!r}: job {receiver!r}'s layout names {len(layout['spec'])} dims, "
                f"the sent tensor has shape {whole}"
            )
        kinds = sorted({dtypes[r.name] for r in runs})
        want = dtype if dtype is not None else kinds[0] if len(kinds) == 1 else None
        if want is None:
            return (
                f"tensor {name!r} joins sent tensors of dtypes {kinds}; pass dtype= to say the "
                "one it takes"
            )
        for k in kinds:
            if not _casts(k, want):
                return (
                    f"tensor {name!r}: job {sender!r} sends {k}, job {receiver!r} wants {want}, "
                    f"and {k} does not cast to {want} without changing what it holds (a link "
                    "casts between float types, and integers to wider integers)"
                )
    return ""


# -- the plan of a transfer --------------------------------------------------------------------
class _Unit:
    """A run of rows of one piece on its way between one pair of processes."""

    __slots__ = ("at", "device", "dtype", "hi", "into", "lo", "name", "nbytes", "shape", "tag")

    def __init__(self) -> None:
        self.name = ""
        self.device = 0
        self.lo: tuple[int, ...] = ()
        self.hi: tuple[int, ...] = ()
        self.shape: tuple[int, ...] = ()
        self.dtype: np.dtype[Any] = np.dtype(np.uint8)
        self.nbytes = 0
        #: its message's tag: its place in the pair's stream
        self.tag = 0
        #: where it is staged in its round's arena
        self.at = 0
        #: on the receiver: (device, lo, hi) inside each target block it is written to
        self.into: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []


class _Schedule:
    """This process's part of a transfer, computed once per pair of manifests: the units it
    sends or receives with their peers, and the bytes counted.

    Every piece is cut into runs of rows of at most a pair's share of ``IN_FLIGHT``, one
    message each. A piece that is one stretch of memory in both the sent block and the
    target block, and needs no cast, is *free*: its runs go straight from the one into the
    other, all posted at once (no memory beside the blocks). The others are *staged*
    (packed by the sender, unpacked by the receiver, or both) and move in rounds, two in
    flight. Both sides compute the same units, rounds and tags from the two manifests
    alone."""

    def __init__(
        self, sent: dict[str, Any], wanted: dict[str, Any], link: Link, targets: _Targets | None
    ) -> None:
        is_sender = targets is None
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "bytes_copied": 0}
        #: each target's global shape and numpy dtype
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype[Any]] = {}
        by_name = {t[0]: t for t in sent["tensors"]}
        shapes = {t[0]: tuple(t[1]) for t in sent["tensors"]}
        s_side, r_side = (link.mine, link.other) if is_sender else (link.other, link.mine)
        # two rounds in flight, each pair an equal share: at most IN_FLIGHT per process
        budget = max(IN_FLIGHT // (2 * max(s_side.count, r_side.count)), 1)
        #: per peer, in stream order: (target, piece, id offset, run, dtype, the origin of
        #: the sent block it is cut from, whether it is free)
        streams: dict[
            int, list[tuple[str, Piece, int, Segment, np.dtype[Any], tuple[int, ...], bool]]
        ] = {}
        for name, _shape, dtype, layout_doc in wanted["tensors"]:
            source = _decode_source(wanted["sources"].get(name, name))
            whole, runs = segments(name, source, shapes)
            kinds = {by_name[r.name][2] for r in runs}
            want = _numpy_dtype(dtype if dtype is not None else kinds.pop())
            self.shapes[name], self.dtypes[name] = whole, want
            target = _layout(layout_doc)
            t_lo, t_hi = target.shard_bounds(whole)
            t_ids = target.mesh.device_ids.ravel()
            t_procs = np.asarray(layout_doc["processes"], np.int64) + r_side.offset
            for run in runs:
                s_doc = by_name[run.name][3]
                s_layout = _layout(s_doc)
                s_shape = tuple(by_name[run.name][1])
                s_lo, s_hi = s_layout.shard_bounds(s_shape)
                s_ids = s_layout.mesh.device_ids.ravel()
                s_procs = np.asarray(s_doc["processes"], np.int64) + s_side.offset
                lo_t, hi_t = t_lo.copy(), t_hi.copy()
                lo_s, hi_s = s_lo.copy(), s_hi.copy()
                if run.dim is not None:  # the run's span of the target, and the sent part
                    d = run.dim
                    span = (run.at, run.at + run.stop - run.start)
                    lo_t[:, d] = np.clip(lo_t[:, d], *span)
                    hi_t[:, d] = np.clip(hi_t[:, d], *span)
                    lo_s[:, d] = np.clip(lo_s[:, d], run.start, run.stop) - run.start + run.at
                    hi_s[:, d] = np.clip(hi_s[:, d], run.start, run.stop) - run.start + run.at
                off = int(s_ids.max()) + 1
                process_of = np.zeros(off + int(t_ids.max()) + 1, np.int64)
                process_of[s_ids] = s_procs
                process_of[off + t_ids] = t_procs
                the_plan = plan(
                    Boxes(s_ids, lo_s, hi_s),
                    Boxes(t_ids + off, lo_t, hi_t),
                    whole,
                    want.itemsize,
                    process_of,
                    link.rank,
                )
                for key, value in the_plan.stats().items():
                    self.stats[key] += value
                pieces = the_plan.send if is_sender else the_plan.receive
                casts = _numpy_dtype(by_name[run.name][2]) != want
                for q, ps in pieces.items():
                    for p in ps:
                        row = int(np.flatnonzero(s_ids == p.source)[0])
                        origin = tuple(int(x) for x in s_lo[row])
                        # the target block it lies in (the same on both sides of the pair)
                        inside = ((lo_t <= p.start) & (np.asarray(p.stop) <= hi_t)).all(axis=1)
                        t_row = int(np.flatnonzero(inside)[0])
                        free = (
                            not casts
                            and _one_run(p.shape, s_hi[row] - s_lo[row])
                            and _one_run(p.shape, t_hi[t_row] - t_lo[t_row])
                        )
                        streams.setdefault(q, []).append((name, p, off, run, want, origin, free))
        self.units: dict[int, list[_Unit]] = {}
        mine_lo: dict[str, dict[int, tuple[int, ...]]] = {}
        if not is_sender:
            for name, _shape, _dtype, layout_doc in wanted["tensors"]:
                target = _layout(layout_doc)
                ids = list(targets.devices(name)) if targets is not None else []
                if ids:
                    lo, _hi = target.shard_bounds(self.shapes[name], ids)
                    mine_lo[name] = {d: tuple(lo[i].tolist()) for i, d in enumerate(ids)}
        #: the free units (peer, unit), and the staged ones round by round
        self.free: list[tuple[int, _Unit]] = []
        self.staged: list[list[tuple[int, _Unit]]] = []
        #: the bytes of the largest round's arena; each round's staged bytes so far
        self.arena = 0
        used: dict[int, int] = {}
        for q, stream in sorted(streams.items()):
            r, fill = 0, 0  # this pair's round, and its staged bytes so far
            units: list[_Unit] = []
            for name, p, off, run, want, origin, free in stream:
                shape = p.shape
                rows = shape[0] if shape else 1
                row_bytes = math.prod(shape[1:]) * want.itemsize if shape else want.itemsize
                step = max(1, budget // max(row_bytes, 1))
                for r0 in range(0, max(rows, 1), step):
                    r1 = min(r0 + step, rows)
                    u = _Unit()
                    u.name, u.dtype = name, want
                    box_lo = (p.start[0] + r0, *p.start[1:]) if shape else ()
                    box_hi = (p.start[0] + r1, *p.stop[1:]) if shape else ()
                    u.shape = tuple(b - a for a, b in zip(box_lo, box_hi))
                    u.nbytes = math.prod(u.shape) * want.itemsize
                    u.tag = len(units)
                    if free:
                        self.free.append((q, u))
                    else:
                        if fill and fill + u.nbytes > budget:  # the next round
                            r, fill = r + 1, 0
                        fill += u.nbytes
                        self.staged += [[] for _ in range(r + 1 - len(self.staged))]
                        self.staged[r].append((q, u))
                        u.at = -(-used.get(r, 0) // 64) * 64  # aligned for the casts
                        used[r] = u.at + u.nbytes
                        self.arena = max(self.arena, used[r])
                    if is_sender:  # where it lies in the sent block of its device
                        u.name, u.device = run.name, p.source
                        first, last = list(box_lo), list(box_hi)
                        if run.dim is not None:
                            first[run.dim] += run.start - run.at
                            last[run.dim] += run.start - run.at
                        u.lo = tuple(a - o for a, o in zip(first, origin))
                        u.hi = tuple(b - o for b, o in zip(last, origin))
                    else:
                        for t in p.devices:
                            corner = mine_lo[name][t - off]
                            u.into.append(
                                (
                                    t - off,
                                    tuple(a - o for a, o in zip(box_lo, corner)),
                                    tuple(b - o for b, o in zip(box_hi, corner)),
                                )
                            )
                    units.append(u)
            self.units[q] = units


class _Targets:
    """The receiving side of a transfer: the target resolved against what was sent."""

    def __init__(
        self,
        target: Any,
        sent: dict[str, Any],
        sources: dict[str, Any],
        dtype: Any,
        backend: Any,
        link: Link,
    ) -> None:
        from .checkpoint.tree import flatten
        from .convert import layout_of
        from .registry import get_backend
        from .rules import LayoutMap

        self.link = link
        self.sources = sources
        self.tree: Any = None
        self.treedef: Any = None
        self.names: list[str] = []
        self.layouts: list[Layout] = []
        self.arrays: list[Any] = []  # an existing array per target, or None
        self.dtypes: list[str | None] = []
        self.shapes: list[tuple[int, ...] | None] = []
        self.backends: list[Any] = []
        self.touched: set[str] = set()
        sent_names = [t[0] for t in sent["tensors"]]
        default = backend if backend is not None else link._backend
        if isinstance(target, LayoutMap):
            from .rules import Resolver

            rules = Resolver(target, None, None, "receive()")
            names = list(dict.fromkeys([*sent_names, *sources]))
            leaves: list[Any] = []
            for name in names:
                got = rules.layout(name)
                leaves.append(Layout(target.mesh, ()) if got is None else got)
            self.map = True
        else:
            self.map = False
            names, leaves, self.treedef = flatten(target)
        for name in sources:
            if name not in names:
                raise LinkError(
                    f"sources names target {name!r}, which the target does not have (targets: "
                    f"{short(names, 200)})"
                )
        for name, leaf in zip(names, leaves):
            given = dtype.get(name) if isinstance(dtype, Mapping) else dtype
            if isinstance(leaf, Layout):
                layout, array, shape = leaf, None, None
                be = None if default is None else get_backend(default)
                want = (
                    None
                    if given is None
                    else dtype_text(np.dtype(given) if isinstance(given, str) else given)
                )
            elif isinstance(leaf, np.ndarray):
                if link.mine.count > 1:
                    raise LinkError(
                        f"target {name!r} is a numpy array, which a job of {link.mine.count} "
                        "processes cannot fill (each holds part): give a Layout or a "
                        "distributed array"
                    )
                if not leaf.flags.writeable or not leaf.flags.c_contiguous:
                    raise LinkError(
                        f"target {name!r}: a numpy target must be writable and C-contiguous"
                    )
                layout, array, shape, be = WHOLE, leaf, tuple(leaf.shape), None
                want = dtype_text(leaf.dtype)
            else:
                found = layout_of(leaf)
                if found is None:
                    raise LinkError(
                        f"target {name!r} is {short(leaf, 60)}: give a unimesh.Layout or a "
                        "distributed array (DTensor, jax.Array, MLXArray)"
                    )
                be, layout = found
                array, shape = leaf, tuple(int(n) for n in leaf.shape)
                want = dtype_text(leaf.dtype)
            if layout.spec.partial:
                raise LinkError(
                    f"target {name!r} is laid out as a pending reduction ({layout.spec!r}); "
                    "receive values into a layout without partial"
                )
            if layout is not WHOLE and be is None:
                raise LinkError(
                    f"target {name!r} is a Layout, and this job has no framework to build its "
                    "array in: call unimesh.initialize(backend) first, or pass backend="
                )
            if want is not None:
                _numpy_dtype(want)
            self.names.append(name)
            self.layouts.append(layout)
            self.arrays.append(array)
            self.dtypes.append(want)
            self.shapes.append(shape)
            self.backends.append(be)
        from .convert import to_native

        for name, layout, be in zip(self.names, self.layouts, self.backends):
            if be is not None:  # its mesh on this job's devices (built collectively, once)
                try:
                    to_native(layout.mesh, be)
                except UnimeshError as exc:
                    raise LinkError(
                        f"target {name!r}: its layout {layout!r} is not on this job's devices "
                        f"({exc})"
                    ) from None

    def manifest(self, version: int | None) -> dict[str, Any]:
        tensors = []
        for name, layout, shape, want, be in zip(
            self.names, self.layouts, self.shapes, self.dtypes, self.backends
        ):
            ids = layout.mesh.device_ids.ravel().tolist()
            processes = [0] * len(ids) if be is None else be.transport().processes(ids)
            tensors.append(
                [
                    name,
                    None if shape is None else list(shape),
                    want,
                    _layout_json(layout, processes),
                ]
            )
        return {"version": version, "tensors": tensors, "sources": _encode_sources(self.sources)}

    def blocks(self, schedule: _Schedule) -> dict[str, dict[int, np.ndarray]]:
        """This process's target blocks to fill, by name and device: views of the existing
        arrays where they can be written in place, else new arrays."""
        out: dict[str, dict[int, np.ndarray]] = {}
        self.whole: dict[str, tuple[int, ...]] = {}
        self.kinds: dict[str, np.dtype[Any]] = {}
        for i, name in enumerate(self.names):
            layout, array, be = self.layouts[i], self.arrays[i], self.backends[i]
            shape = schedule.shapes[name]
            self.whole[name] = shape
            kind = self.kinds[name] = schedule.dtypes[name]
            if isinstance(array, np.ndarray):
                out[name] = {0: array}
                self.touched.add(name)
                continue
            views = None
            if array is not None:
                views = be.host_views(array)
            if views is not None:
                out[name] = dict(views)
                self.touched.add(name)
                continue
            ids = list(self.devices(name))
            blocks = {}
            if ids:
                lo, hi = layout.shard_bounds(shape, ids)
                for k, d in enumerate(ids):
                    blocks[d] = np.empty(tuple((hi[k] - lo[k]).tolist()), dtype=kind)
            out[name] = blocks
        return out

    def devices(self, name: str) -> tuple[int, ...]:
        """This process's devices of a target's layout."""
        i = self.names.index(name)
        be = self.backends[i]
        return (0,) if be is None else tuple(be.process_devices(self.layouts[i].mesh))

    def in_place(self) -> list[str]:
        return sorted(self.touched)

    def result(self, blocks: dict[str, dict[int, np.ndarray]]) -> Any:
        import optree

        from .convert import placing_backend

        made = []
        for i, name in enumerate(self.names):
            array, be, layout = self.arrays[i], self.backends[i], self.layouts[i]
            if name in self.touched:
                made.append(array)
                continue
            shape = self.whole[name]
            if be is None:
                made.append(blocks[name][0])
                continue
            be = placing_backend(be, "from_local", layout, shape)
            made.append(be.from_local(blocks[name], layout, shape, self.kinds.get(name)))
        if self.map:
            return dict(zip(self.names, made))
        return optree.tree_unflatten(self.treedef, made)
