"""The command line as a person sees it: each command run in a pseudo-terminal of 80 columns,
its screen read through a VT100 emulator (pyte), during the run and at the end."""

from __future__ import annotations

import os
import re
import sys

import pytest

from unimesh.cli.demo import STEPS
from unimesh.conformance.matrix import VERDICTS

from .support.terminal import Screen, run_in_terminal

pytest.importorskip("pyte")

COLUMNS = 80


def unimesh_in_terminal(*args: str, env: dict[str, str] | None = None, **kw: object) -> Screen:
    return run_in_terminal([sys.executable, "-m", "unimesh", *args], columns=COLUMNS, env=env, **kw)


def row(screen: Screen, name: str) -> str:
    return next(line for line in screen.lines if line.startswith(f"│ {name} "))


def test_demo_shows_each_backend_live_and_no_framework_logs():
    """While the demo runs, a line per backend names its step and the time so far (torch's
    processes report theirs as they reach them); at the end, the table fits 80 columns, every
    row checks out, and TensorFlow's C++ log lines (absl, oneDNN) are not on the screen."""
    wanted = [b for b in ("jax", "tensorflow", "torch") if _installed(b)]
    if not wanted:
        pytest.skip("no framework of jax, tensorflow, torch is installed")
    screen = unimesh_in_terminal("demo", "--backends", ",".join(wanted), timeout=340)
    assert screen.returncode == 0, screen.text
    progress = re.compile(r"^\S (\w+)\s+(.+?)\s+(\d+):(\d\d):(\d\d)$")
    seen: dict[str, set[str]] = {}
    live: dict[str, int] = {}  # the longest time each backend's live line showed
    for frame in screen.frames:
        for line in frame:
            found = progress.match(line)
            if found and found.group(1) in wanted:
                seen.setdefault(found.group(1), set()).add(found.group(2))
                h, m, sec = (int(found.group(i)) for i in (3, 4, 5))
                live[found.group(1)] = max(live.get(found.group(1), 0), 3600 * h + 60 * m + sec)
    assert set(seen) == set(wanted), seen
    if "torch" in wanted:  # a launched backend: the launch, then its processes' steps
        steps = seen["torch"]
        assert "launching 8 processes" in steps, steps
        assert any(s.endswith("of 8 processes)") and s.split(" (")[0] in STEPS for s in steps)
    for name in wanted:
        line = row(screen, name)
        assert line.count(" ok ") == 2 and line.endswith("│"), line
        # the table's time counts what the live line counted (import or launch included)
        cell = line.rstrip("│ ").rsplit("│", 1)[1].strip()
        took = float(cell[:-3]) / 1e3 if cell.endswith(" ms") else float(cell[:-2])
        assert took >= live[name] - 1, (name, cell, live[name])
    # the caption's lines are whole: no word left alone on a line of its own
    assert any(x.strip() == "numpy: the core's reference blocks" for x in screen.lines)
    assert any(
        x.strip() == "time: from the framework's import, launch included" for x in screen.lines
    )
    assert max(len(line) for line in screen.lines) <= COLUMNS
    for noise in ("absl", "oneDNN", "WARNING", "I0000", "Traceback"):
        assert noise not in screen.text, screen.text


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_show_never_cuts_an_id_and_keeps_titles_on_one_line():
    """A 4 x 32 mesh at 80 columns: the columns that fit, an ellipsis for the rest and a
    legend; every id shown is whole (the row's first and last ids are there)."""
    screen = unimesh_in_terminal("show", "dp=4,tp=32")
    assert screen.returncode == 0, screen.text
    for dp in range(4):
        line = next(x for x in screen.lines if x.startswith(f"│    dp={dp} "))
        ids = [int(n) for n in re.findall(r"\b\d+\b", line.split("│", 2)[2])]
        assert ids[:3] == [32 * dp, 32 * dp + 1, 32 * dp + 2] and ids[-1] == 32 * dp + 31, line
        assert "…" in line
    assert any("marks rows and columns left out" in x for x in screen.lines), screen.text

    tuple_spec = unimesh_in_terminal(
        "show", "dp=2,tp=4", "--layout", "dp+tp,None", "--shape", "8,4"
    )
    assert tuple_spec.returncode == 0, tuple_spec.text
    assert "tensor (8, 4) as P(('dp', 'tp'), None)" in tuple_spec.lines, tuple_spec.text


def test_show_notes_an_uneven_layout_and_who_refuses_it():
    """4 rows over dp=3: the drawing says the blocks are uneven and names the installed
    backends that refuse such a layout (from their declared features) and those that take it."""
    import unimesh

    screen = unimesh_in_terminal("show", "dp=3,tp=2", "--layout", "dp,tp", "--shape", "4,4")
    assert screen.returncode == 0, screen.text
    note = " ".join(screen.text.split("uneven:", 1)[1].split())
    assert note.startswith("dim 0 (4) does not cut into 3 blocks"), note
    refuse = [n for n in unimesh.backends() if "uneven_shards" not in _features(n)]
    take = [n for n in unimesh.backends() if "uneven_shards" in _features(n)]
    if refuse:
        assert f"{', '.join(refuse)} refuse this layout" in note, note
    if take:
        assert f"{', '.join(take)} take it" in note, note
    even = unimesh_in_terminal("show", "dp=2,tp=2", "--layout", "dp,tp", "--shape", "4,4")
    assert "uneven" not in even.text


def _features(name: str) -> frozenset[str]:
    from unimesh.registry import load_backend

    return load_backend(name).features


def test_check_names_the_test_that_runs_and_its_legend_fits(example_site):
    """`unimesh check` on a third-party backend: the progress line names the test under way;
    the matrix and the legend fit 80 columns, one verdict per line."""
    env = {**os.environ, "PYTHONPATH": str(example_site)}
    screen = unimesh_in_terminal("check", "example", env=env, timeout=400)
    assert screen.returncode == 0, screen.text
    running = {
        m.group(1)
        for frame in screen.frames
        for line in frame
        for m in [re.search(r"\b(test_\w+)", line)]
        if m and line.startswith("example")
    }
    assert running, "no progress line named a test"
    assert max(len(line) for line in screen.lines) <= COLUMNS
    for verdict, what in VERDICTS.items():
        assert any(
            line.strip().startswith(verdict) and line.strip().endswith(what)
            for line in screen.lines
        ), (verdict, screen.text)


def test_the_matrix_of_five_backends_fits_80_columns_whole() -> None:
    """Issue 40: five backends side by side are wider than 80 columns; the matrix is then
    printed as tables of as many backends as fit, with no row name cut or cell wrapped."""
    from rich.console import Console

    from unimesh.cli.check import Run, matrix_tables
    from unimesh.conformance import CHECKED
    from unimesh.conformance.matrix import Case

    runs = []
    for name in ("torch", "jax", "keras", "tensorflow", "mlx"):
        run = Run(name, 4, "torchrun 4", returncode=0, reports=4, seconds=61.0)
        for i, cap in enumerate(CHECKED):
            outcome = ("passed", "refused", "undeclared")[(i + len(name)) % 3]
            run.cases += [Case(name, cap, f"t{k}", outcome, "why") for k in range(29)]
        runs.append(run)
    wide = Console(width=200, record=True)
    assert len(matrix_tables(runs, wide)) == 1  # room for all: one table
    console = Console(width=COLUMNS, record=True)
    tables = matrix_tables(runs, console)
    assert len(tables) > 1
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= COLUMNS
    for cap in CHECKED:  # each capability's name whole, once per table
        assert sum(f"│ {cap} " in line for line in text.splitlines()) == len(tables), cap
    assert "…" not in text
    assert all(sum(f" {n} " in line for line in text.splitlines()) for n in ("mlx", "torch"))
