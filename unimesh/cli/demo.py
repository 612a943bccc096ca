"""``unimesh demo``: one mesh and one layout on every installed backend, each checked against
the core's reference blocks and numpy.

Nothing here names a backend: each row comes from the backend's own declarations
(:meth:`~unimesh.Backend.launcher`, :meth:`~unimesh.Backend.demo_compute`). A backend that runs
one process per device runs :func:`trial` in every process of its launcher
(``python -m unimesh.cli.demo_worker``); the others run it here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from ..backend import Backend
from ..errors import UnimeshError
from ..layout import Layout
from ..mesh import Mesh
from ..spec import PartitionSpec
from .ending import end_launch

#: Launched demos larger than this are not started (one process per device).
MAX_PROCESSES = 16
#: Seconds a launched demo may take, launch included.
LAUNCH_TIMEOUT = 100.0
#: Held while a launcher is started and registered, and while the demo ends the registered.
_STARTING = threading.Lock()


def demo_problem(mesh: Mesh) -> tuple[Layout, Any, Any]:
    """The demo's layout and data: a 2-D tensor, rows over the mesh's first axis and columns
    over its second, and a replicated weight to multiply it with."""
    import numpy as np

    axes = mesh.axis_names[:2]
    layout = Layout(mesh, PartitionSpec(axes[0], axes[1] if len(axes) > 1 else None))
    shape = (2 * mesh.shape[0], 2 * (mesh.shape[1] if mesh.ndim > 1 else 1))
    x = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
    w = np.linspace(-1.0, 1.0, shape[1] * 3, dtype=np.float32).reshape(shape[1], 3)
    return layout, x, w


#: What :func:`trial` does, in order; the progress display names the step under way.
STEPS = ("starting", "building the mesh", "distributing", "multiplying", "checking")


def trial(
    backend: Backend, mesh: Mesh, step: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """What this process sees of the demo on ``backend``: the native mesh's type, how many
    shards it holds, whether they are the reference blocks, and whether the framework's own
    product with a replicated weight equals numpy's (None when the backend computes none).
    ``step`` hears the name of each of :data:`STEPS` as it begins."""
    import numpy as np

    from ..convert import distribute, to_native

    layout, x, w = demo_problem(mesh)
    try:
        step(STEPS[1])
        native_mesh = to_native(mesh, backend)
        step(STEPS[2])
        array = distribute(x, layout, backend)
        shards = backend.local_shards(array)
        step(STEPS[3])
        result = backend.demo_compute(array, w)
    except UnimeshError as exc:  # the same in every process: nobody waits for anybody
        return {"error": f"{type(exc).__name__}: {exc}"}
    step(STEPS[4])
    ok_shards = bool(shards) and all(
        np.array_equal(np.asarray(block), x[layout.shard_slices(x.shape, d)])
        for d, block in shards.items()
    )
    ok_result = (
        None
        if result is None
        else bool(np.allclose(np.asarray(result), x @ w, rtol=1e-5, atol=1e-4))
    )
    return {
        "native": type(native_mesh).__name__,
        "shards": ok_shards,
        "count": len(shards),
        "result": ok_result,
    }


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else "[green]ok[/green]" if ok else "[red]FAIL[/red]"


def _reference(mesh: Mesh) -> tuple[int, bool, bool, float]:
    """The neutral reference: each device's block, then a sharded matmul reassembled from
    blocks. Returns (blocks, tiles cover the tensor, product equals numpy, ms)."""
    import numpy as np

    layout, x, w = demo_problem(mesh)
    t0 = time.perf_counter()
    blocks = layout.device_slices(x.shape)
    covered = np.zeros(x.shape, dtype=np.int64)
    out = np.zeros((x.shape[0], w.shape[1]), dtype=np.float32)
    for sl in blocks.values():
        covered[sl] += 1
    reps = mesh.size // int(np.prod([mesh.axis_size(a) for a in layout.spec.axes()]))
    for sl in blocks.values():
        out[sl[0]] += x[sl] @ w[sl[-1]] / reps
    ok_tiles = bool((covered == reps).all())
    ok_matmul = bool(np.allclose(out, x @ w, rtol=1e-5, atol=1e-4))
    return len(blocks), ok_tiles, ok_matmul, (time.perf_counter() - t0) * 1e3


def _cells(name: str, report: dict[str, Any], runs: str, seconds: float) -> tuple[str, ...]:
    from rich.markup import escape

    if "error" in report:
        kind, _, text = report["error"].partition(": ")
        return (name, f"[yellow]{escape(kind)}[/yellow]", runs, "-", "-", escape(text[:70]))
    return (
        name,
        report["native"],
        runs,
        _mark(report["shards"]),
        _mark(report["result"]),
        _seconds(seconds),
    )


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


@contextlib.contextmanager
def stderr_kept(kept: list[str]) -> Iterator[None]:
    """Send this process's file descriptor 2 to a file while the block runs (frameworks write
    their C++ log lines there, around Python), and append what was written to ``kept``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept.append(sink.read().decode(errors="replace"))


def _in_process_row(
    backend: Backend,
    mesh: Mesh,
    step: Callable[[str], None],
    log: list[str],
    imported: float = 0.0,
) -> tuple[str, ...]:
    """The row of a backend run in this process; its time counts the framework's import
    (``imported`` seconds, spent before) as the launched rows count their launch."""
    t0 = time.perf_counter()
    with stderr_kept(log):
        report = trial(backend, mesh, step)
    runs = f"1 ({report['count']} devices)" if "count" in report else "1"
    return _cells(backend.name, report, runs, imported + time.perf_counter() - t0)


def _launched_row(
    backend: Backend,
    spec: str,
    size: int,
    step: Callable[[str], None],
    log: list[str],
    started: list[subprocess.Popen[str]] | None = None,
    stop: threading.Event | None = None,
) -> tuple[str, ...]:
    """Run :func:`trial` in ``size`` processes under the backend's launcher; summarise. The
    workers' ``UNIMESH_STEP`` lines feed ``step`` as they arrive. The launcher gets a
    temporary directory of its own, removed afterwards (torchrun and OpenMPI leave files);
    its process is added to ``started`` (for the caller to end on an interruption), unless
    ``stop`` is set by then."""
    with tempfile.TemporaryDirectory(prefix="unimesh-demo-") as scratch:
        return _launched_row_in(backend, spec, size, step, log, scratch, started, stop)


def _launched_row_in(
    backend: Backend,
    spec: str,
    size: int,
    step: Callable[[str], None],
    log: list[str],
    scratch: str,
    started: list[subprocess.Popen[str]] | None = None,
    stop: threading.Event | None = None,
) -> tuple[str, ...]:
    from rich.markup import escape

    name = backend.name
    if size > MAX_PROCESSES:
        return (name, "[dim]skipped[/dim]", str(size), "-", "-", "too many here")
    prefix, extra = backend.launcher(size) or ([sys.executable], {})
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=scratch, **extra)
    cmd = [*prefix, "-m", "unimesh.cli.demo_worker", name, spec]
    runs = f"{size} ({backend.launcher_name or os.path.basename(prefix[0])})"
    step(f"launching {size} processes")
    t0 = time.perf_counter()
    with _STARTING:  # started and registered at once, or not at all once the demo stops
        if stop is not None and stop.is_set():
            return (name, "[red]failed[/red]", runs, "-", "-", "not started")
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        if started is not None:
            started.append(proc)
    lines: list[str] = []
    reached = [0] * size  # each process's furthest step, as an index into STEPS

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("UNIMESH_STEP "):
                rank, _, what = line[len("UNIMESH_STEP ") :].strip().partition(" ")
                if rank.isdigit() and int(rank) < size and what in STEPS:
                    reached[int(rank)] = max(reached[int(rank)], STEPS.index(what))
                    low = min(reached)
                    step(f"{STEPS[low]} ({reached.count(low)} of {size} processes)")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        end_launch(proc)
        reader.join(5)
        log.append("".join(lines))
        return (name, "[red]launcher timed out[/red]", runs, "-", "-", f"> {LAUNCH_TIMEOUT:.0f} s")
    reader.join(5)
    seconds = time.perf_counter() - t0
    out = "".join(lines)
    reports = [
        json.loads(line[len("UNIMESH_DEMO ") :])
        for line in out.splitlines()
        if line.startswith("UNIMESH_DEMO ")
    ]
    if proc.returncode != 0 or len(reports) != size:
        log.append(out)
        tail = out.strip().splitlines()[-1] if out.strip() else f"exit {proc.returncode}"
        return (name, "[red]launcher failed[/red]", runs, "-", "-", escape(tail[:70]))
    errors = [r for r in reports if "error" in r]
    if errors:
        return _cells(name, errors[0], runs, seconds)
    merged = {
        "native": reports[0]["native"],
        "shards": all(r["shards"] for r in reports),
        "result": None
        if any(r["result"] is None for r in reports)
        else all(r["result"] for r in reports),
    }
    return _cells(name, merged, runs, seconds)


def _failed(cells: tuple[str, ...]) -> bool:
    """Whether a row says its backend failed."""
    return "FAIL" in "".join(cells) or "failed" in cells[1] or "timed out" in cells[1]


def demo(args: argparse.Namespace) -> int:
    """The ``unimesh demo`` command: 0 when every row checks out, 1 otherwise."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import Progress, ProgressColumn, SpinnerColumn, TextColumn
    from rich.text import Text

    class Took(ProgressColumn):
        """Time the backend's row has taken: its framework's import (``offset``, spent before
        the row started) plus the row so far; the table's time column says the same."""

        def render(self, task: Any) -> Text:
            seconds = int(task.fields.get("offset", 0.0) + (task.elapsed or 0.0))
            return Text(f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}")

    from rich.table import Table

    from ..registry import backends, get_backend, load_backend

    console = Console()
    mesh = Mesh.from_string(args.mesh)
    layout, x, _ = demo_problem(mesh)
    installed = backends()
    chosen = (
        [n.strip() for n in args.backends.split(",") if n.strip()] if args.backends else installed
    )
    plugins = {name: load_backend(name) for name in chosen}  # a typo: the close match

    console.print(
        f"[bold]mesh[/bold] {mesh!r}   [bold]layout[/bold] {layout.spec!r}   "
        f"[bold]tensor[/bold] {x.shape}"
    )
    grid = Table(title="device ids", show_header=True)
    names = mesh.axis_names
    flat = mesh.device_ids.reshape(mesh.shape[0], -1)
    grid.add_column(f"{names[0]} \\ {','.join(names[1:]) or '-'}")
    for j in range(flat.shape[1]):
        grid.add_column(str(j), justify="right")
    for i, ids in enumerate(flat.tolist()):
        grid.add_row(str(i), *map(str, ids))
    console.print(grid)

    count, ok_tiles, ok_matmul, ref_ms = _reference(mesh)
    table = Table(
        title="one mesh, every backend",
        caption="numpy: the core's reference blocks\n"
        "time: from the framework's import, launch included",
    )
    for col in ("backend", "native", "processes", "blocks", "matmul", "time"):
        table.add_column(col)
    table.add_row(
        "numpy", f"{count} blocks", "-", _mark(ok_tiles), _mark(ok_matmul), f"{ref_ms:.1f} ms"
    )
    failures = 0 if ok_tiles and ok_matmul else 1
    launched = {name for name, be in plugins.items() if be.launcher(mesh.size) is not None}
    absent = [be for be in plugins.values() if not be.available()]
    runnable = [name for name, be in plugins.items() if be.available()]
    logs: dict[str, list[str]] = {name: [] for name in runnable}
    progress = Progress(
        SpinnerColumn(finished_text="[green]✓[/green]"),
        TextColumn("[bold]{task.description:<12}"),
        TextColumn("{task.fields[step]}"),
        Took(),
        console=console,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,  # frameworks' writes go to the log kept for a failed row
    )
    rows: dict[str, tuple[str, ...]] = {}
    started: list[subprocess.Popen[str]] = []  # the launchers, ended if the demo is stopped
    with progress:
        tasks = {
            name: progress.add_task(name, step="waiting", total=1, start=False) for name in runnable
        }

        def step_of(name: str) -> Callable[[str], None]:
            return lambda what: progress.update(tasks[name], step=what)

        def finish(name: str, cells: tuple[str, ...]) -> None:
            failed = _failed(cells)
            progress.update(
                tasks[name], step="[red]failed[/red]" if failed else "done", completed=1
            )
            progress.stop_task(tasks[name])
            rows[name] = cells
            if not failed:
                logs[name].clear()

        stop = threading.Event()  # set when the demo ends early: no further launch starts

        def run_launched() -> None:  # one launch at a time, beside the in-process rows
            for name in runnable:
                if name not in launched:
                    continue
                cells: tuple[str, ...] = (name, "[red]failed[/red]", "-", "-", "-", "not started")
                try:
                    if stop.is_set():
                        continue
                    progress.reset(tasks[name], total=1, step="starting")
                    cells = _launched_row(get_backend(name), args.mesh, mesh.size,
                                          step_of(name), logs[name], started, stop)  # fmt: skip
                except BaseException as exc:  # noqa: BLE001 - its row and log say what failed
                    logs[name].append("".join(traceback.format_exception(exc)))
                    cells = (name, "[red]failed[/red]", "-", "-", "-", escape(str(exc)[:70]))
                finally:
                    finish(name, cells)

        beside = threading.Thread(target=run_launched, daemon=True)
        beside.start()
        try:
            imported: dict[str, float] = {}  # seconds each in-process framework took to start
            for name in runnable:  # in-process frameworks hear how many devices, first
                if name not in launched:
                    progress.start_task(tasks[name])
                    progress.update(tasks[name], step=f"importing {plugins[name].framework}")
                    t0 = time.perf_counter()
                    with stderr_kept(logs[name]), contextlib.suppress(ImportError, UnimeshError):
                        plugins[name].request_devices(max(8, mesh.size))  # its row says why
                    imported[name] = time.perf_counter() - t0
                    progress.stop_task(tasks[name])  # its clock waits with it
                    progress.update(tasks[name], step="imported; waiting")
            for name in runnable:
                if name not in launched:
                    progress.reset(tasks[name], total=1, step="starting", offset=imported[name])
                    finish(name, _in_process_row(get_backend(name), mesh, step_of(name),
                                                 logs[name], imported[name]))  # fmt: skip
            while beside.is_alive():  # a short wait at a time: ^C still reaches the demo
                beside.join(0.2)
        finally:
            stop.set()  # stopped early (^C): no launch starts after this, none is left running
            with _STARTING:
                for proc in started:
                    end_launch(proc)
            beside.join(5)
    for name in runnable:  # the table in the backends' order, whichever finished first
        cells = rows.get(name, (name, "[red]failed[/red]", "-", "-", "-", "no row"))
        failures += _failed(cells)
        table.add_row(*cells)
    console.print(table)
    for be in absent:  # a note under the table, not a row of dashes
        console.print(
            f"[dim]not run:[/dim] {be.name} ({be.framework} is not installed: "
            f"{escape(be.install_hint())})"
        )
    for name, kept in logs.items():  # what a failed backend wrote, for its diagnosis
        text = "".join(kept).strip()
        if text:
            console.print(f"[dim]{name} wrote:[/dim]")
            console.print(escape("\n".join(text.splitlines()[-20:])), highlight=False)
    return 1 if failures else 0
