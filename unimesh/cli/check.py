"""``unimesh check [BACKEND ...]``: the conformance suite run as a user runs it (pytest, under
the backend's own launcher where it has one), with a progress bar, then the capability matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..conformance.matrix import VERDICTS, Case, Cell, markdown, merge, text_rows
from ..errors import UnimeshError
from .ending import end_launch


@dataclass
class Run:
    """One backend's suite: its processes' progress lines, merged."""

    backend: str
    processes: int
    how: str
    totals: dict[int, int] = field(default_factory=dict)
    done: dict[int, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    cases: list[Case] = field(default_factory=list)
    reports: int = 0
    running: str = ""
    returncode: int | None = None
    output: str = ""
    seconds: float = 0.0

    def read(self, lines: list[str]) -> None:
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a process that was killed
            pid, kind, data = rec.get("pid"), rec.get("kind"), rec.get("data")
            if kind == "total":
                self.totals[pid] = int(data)
            elif kind == "running":
                self.running = str(data)
            elif kind == "done":
                self.done[pid] = int(data)
            elif kind == "failed":
                self.failed.setdefault(data["test"], data["why"])
            elif kind == "cases":
                self.reports += 1
                self.cases.extend(Case.from_json(row) for row in data)

    @property
    def total(self) -> int:
        known = list(self.totals.values())
        return max(known, default=0) * self.processes

    @property
    def completed(self) -> int:
        return sum(self.done.values())

    def matrix(self) -> dict[str, Cell]:
        """capability -> :class:`~unimesh.conformance.matrix.Cell`, every process's cases
        merged (each case counted once, as its worst outcome)."""
        return merge(self.cases).get(self.backend, {})

    @property
    def title(self) -> str:
        return f"{self.backend} ({self.how})"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.failed and self.reports == self.processes


def _command(
    backend: Any, processes: int, progress: Path
) -> tuple[list[str], dict[str, str], int, str]:
    args = [
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--color=no",
        "--pyargs",
        "unimesh.conformance",
        "--unimesh-backend",
        backend.name,
        "--unimesh-progress",
        str(progress),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("UNIMESH_CONFORMANCE_BACKENDS",)}
    env.setdefault("OMP_NUM_THREADS", "1")
    launch = backend.launcher(processes)
    if launch is None:
        return [sys.executable, *args], env, 1, "1 process"
    prefix, extra = launch
    env.update(extra)
    tool = backend.launcher_name.split(",")[0] or Path(prefix[0]).name
    return [*prefix, *args], env, processes, f"{processes} processes ({tool})"


def run_suite(name: str, processes: int, timeout: float, tick: Any = None) -> Run:
    """Run the suite on backend ``name``; ``tick(run)`` is called as progress lines arrive."""
    from ..registry import get_backend

    backend = get_backend(name)
    with tempfile.TemporaryDirectory(prefix="unimesh-check-") as tmp:
        progress = Path(tmp) / "progress.jsonl"
        progress.touch()
        cmd, env, nproc, how = _command(backend, processes, progress)
        env["TMPDIR"] = tmp  # the launcher's files (torchelastic_*, OpenMPI's) go with it
        run = Run(name, nproc, how)
        log = Path(tmp) / "output.txt"
        t0 = time.perf_counter()
        with open(log, "w") as out, open(progress) as feed:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True
            )
            try:
                while proc.poll() is None:
                    if time.perf_counter() - t0 > timeout:
                        end_launch(proc)
                        run.failed.setdefault(
                            "(timeout)",
                            f"the suite did not finish within {timeout:.0f} s and was killed",
                        )
                        break
                    run.read(feed.readlines())
                    if tick is not None:
                        tick(run)
                    time.sleep(0.2)
            except BaseException:
                end_launch(proc)
                raise
            run.read(feed.readlines())
        run.returncode = proc.returncode
        run.seconds = time.perf_counter() - t0
        run.output = log.read_text(errors="replace")
        if tick is not None:
            tick(run)
    return run


def check(
    names: list[str],
    processes: int = 4,
    timeout: float = 900.0,
    json_path: str | None = None,
    markdown_path: str | None = None,
) -> int:
    """The ``unimesh check`` command: 0 when every chosen backend passes, 1 otherwise."""
    import importlib.util

    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    from ..registry import backends, get_backend, load_backend

    absent = [m for m in ("pytest", "pytest_timeout") if importlib.util.find_spec(m) is None]
    if absent:
        raise UnimeshError(
            f"unimesh check runs the conformance suite with pytest, and {', '.join(absent)} "
            'is not installed here: pip install "unimesh[conformance]"'
        )
    installed = backends()
    missing: list[str] = []
    if not names or names == ["all"]:  # every backend whose framework is there; name the rest
        names = []
        for name in installed:
            (names if load_backend(name).available() else missing).append(name)
    if not names:
        hints = "; ".join(load_backend(n).install_hint() for n in missing)
        raise UnimeshError(
            "no installed backend has its framework installed" + (f": {hints}" if hints else "")
        )
    for name in names:
        load_backend(name)  # not installed: a clear error with the close matches
        get_backend(name)  # unusable (framework missing): its own clear error, before any run
    if processes < 1:
        raise UnimeshError(f"--processes must be >= 1, got {processes}")
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 110))
    runs: list[Run] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=16),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        # the running test's whole name, wrapped rather than cut
        TextColumn("{task.fields[note]}", table_column=Column(no_wrap=False, ratio=1)),
        console=console,
        transient=not console.is_terminal,
    ) as bar:
        for name in names:
            starting = "starting: importing the framework and collecting the suite"
            task = bar.add_task(f"{name:<10}", total=None, note=starting)

            def tick(run: Run, task: Any = task) -> None:
                bad = f"[red]{len(run.failed)} failed[/red]" if run.failed else ""
                now = "" if run.returncode is not None else escape(run.running)
                bar.update(
                    task,
                    total=run.total or None,
                    completed=run.completed,
                    note=f"{bad} {now}".strip() or run.how,
                )

            runs.append(run_suite(name, processes, timeout, tick))
    for table in matrix_tables(runs, console):
        console.print(table)
    console.print(legend_table())
    for run in runs:  # why a cell is not a plain pass
        for cap, cell in run.matrix().items():
            for why in cell.notes():
                console.print(escape(f"{run.backend}, {cap}: {why}"[:300]))
    for name in missing:
        console.print(
            escape(
                f"{name}: not checked, its framework is not installed "
                f"({load_backend(name).install_hint()})"
            )
        )
    failures = 0
    for run in runs:
        if run.ok:
            continue
        failures += 1
        console.print(
            f"[bold red]{run.backend}: the suite failed[/] (exit {run.returncode}, "
            f"{run.reports} of {run.processes} processes reported)"
        )
        for test, why in run.failed.items():
            console.print(f"  FAILED {escape(test)}: {escape(why)}")
        if not run.failed:
            console.print(escape("\n".join(run.output.strip().splitlines()[-15:])))
    if json_path:
        Path(json_path).write_text(json.dumps(report(runs), indent=2) + "\n")
    if markdown_path:
        Path(markdown_path).write_text(markdown_of(runs))
    return 1 if failures else 0


_STYLE = {
    "pass": "green",
    "fail": "bold red",
    "refused": "yellow",
    "skipped": "yellow",
    "not declared": "dim",
}


def legend_table() -> Any:
    """What each verdict means, one per line (it stays readable in 80 columns)."""
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(style="dim")
    for verdict, what in VERDICTS.items():
        table.add_row(f"[{_STYLE[verdict]}]{verdict}[/]", what)
    table.add_row("", "counts are cases")
    return table


def matrix_tables(runs: list[Run], console: Any) -> list[Any]:
    """The matrix as one table, or, where that is wider than the terminal, as several tables of
    as many backends as fit (every row whole: no cut names or wrapped cells)."""
    from rich.measure import Measurement

    groups = [runs]
    while True:
        tables = [matrix_table(group) for group in groups]
        unbounded = console.options.update(max_width=10_000)
        widest = max(Measurement.get(console, unbounded, t).maximum for t in tables)
        size = max(len(g) for g in groups)
        if widest <= console.width or size == 1:
            return tables
        size -= 1
        groups = [runs[i : i + size] for i in range(0, len(runs), size)]


def matrix_table(runs: list[Run]) -> Any:
    """The capability matrix as a rich table: a row per capability, a column per backend, each
    cell the verdict with its case counts."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="unimesh capability matrix")
    table.add_column("capability", no_wrap=True)
    for run in runs:
        table.add_column(run.backend, justify="center", no_wrap=True)
    for cap, cells in text_rows({run.backend: run.matrix() for run in runs}):
        styled = []
        for text in cells:
            verdict = next((v for v in _STYLE if text.startswith(v)), "")
            styled.append(f"[{_STYLE[verdict]}]{escape(text)}[/]" if verdict else escape(text))
        table.add_row(cap, *styled)
    table.add_section()
    table.add_row("processes", *(run.how.split(" (")[0] for run in runs))
    table.add_row("time", *(f"{run.seconds:.0f} s" for run in runs))
    return table


def report(runs: list[Run]) -> dict[str, Any]:
    """The JSON form: the run (command, machine, date, framework versions) and each backend's
    verdicts (what the docs' capability matrix is generated from)."""
    import platform

    from .. import __version__
    from ..registry import get_backend

    return {
        "run": {
            "command": "unimesh check " + " ".join(r.backend for r in runs),
            "machine": f"{platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d"),
            "unimesh": __version__,
        },
        "backends": {
            r.backend: {
                "processes": r.how,
                "ok": r.ok,
                "framework": f"{get_backend(r.backend).framework} "
                f"{get_backend(r.backend).framework_version()}",
                "seconds": round(r.seconds, 1),
                "matrix": {c: cell.verdict for c, cell in r.matrix().items()},
                "cells": {c: cell.to_json() for c, cell in r.matrix().items()},
            }
            for r in runs
        },
    }


def markdown_of(runs: list[Run]) -> str:
    """The matrix as Markdown (the one renderer, :func:`unimesh.conformance.matrix.markdown`)."""
    return markdown({run.title: run.matrix() for run in runs})
