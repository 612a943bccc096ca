"""pytest plugin of the conformance suite (entry point ``pytest11: unimesh``).

Import-light: it imports no framework; backends are loaded when the suite's tests run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from .matrix import Case, Cell, markdown, merge, text_rows, verdict_legend

ENV = "UNIMESH_CONFORMANCE_BACKENDS"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("unimesh", "unimesh conformance suite")
    group.addoption(
        "--unimesh-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="backend to check (repeatable; 'all' = every installed backend); "
        f"also the {ENV} environment variable",
    )
    group.addoption(
        "--unimesh-matrix-json",
        metavar="PATH",
        default=None,
        help="write the capability matrix as JSON here",
    )
    group.addoption(
        "--unimesh-matrix-md",
        metavar="PATH",
        default=None,
        help="write the capability matrix as Markdown here",
    )
    group.addoption(
        "--unimesh-progress",
        metavar="PATH",
        default=None,
        help="append one line per finished test to PATH (for unimesh check)",
    )


def pytest_configure(config: pytest.Config) -> None:
    _config["config"] = config
    config.addinivalue_line(
        "markers", "unimesh_capability(name): the capability a conformance test exercises"
    )


def selected_backends(config: pytest.Config) -> list[str]:
    names: list[str] = []
    for item in list(config.getoption("--unimesh-backend")) + [
        n for n in os.environ.get(ENV, "").split(",") if n.strip()
    ]:
        names.extend(n.strip() for n in item.split(",") if n.strip())
    if "all" in names:
        import unimesh

        names = [n for n in names if n != "all"] + unimesh.backends()
    return list(dict.fromkeys(names))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" in metafunc.fixturenames:
        names = selected_backends(metafunc.config)
        if not names:
            raise pytest.UsageError(
                f"the unimesh conformance suite needs a backend: --unimesh-backend NAME (or {ENV})"
            )
        metafunc.parametrize("backend_name", names, scope="session")


_cases: list[Case] = []
_progress = {"done": 0, "total": 0}


def _report(config: pytest.Config, kind: str, payload: object) -> None:
    """One JSON line for ``unimesh check`` (appended: every process of a launch shares it)."""
    path = config.getoption("--unimesh-progress", None)
    if path:
        line = json.dumps({"pid": os.getpid(), "kind": kind, "data": payload}) + "\n"
        with open(path, "a") as fh:
            fh.write(line)


def pytest_collection_finish(session: pytest.Session) -> None:
    _progress["total"] = len(session.items)
    _report(session.config, "total", len(session.items))


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    config = _config.get("config")
    if config is not None:
        _report(config, "running", location[2])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _config.get("config")
    if config is None:
        return
    if report.failed:
        message = str(report.longrepr).strip().splitlines()
        _report(
            config, "failed", {"test": report.nodeid, "why": message[-1][:300] if message else ""}
        )
    if report.when == "teardown":
        _progress["done"] += 1
        _report(config, "done", _progress["done"])


_config: dict[str, pytest.Config] = {}


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _outcome(report: pytest.TestReport, refusal: bool) -> tuple[str, str] | None:
    """A finished phase as (case outcome, why), or None when it is no case of its capability
    (a refusal test of a declared capability, which the capability's own tests cover)."""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or str(report.longrepr)
        lines = message.strip().splitlines()
        return "failed", lines[0][:300] if lines else ""
    if report.skipped:
        why = _skip_reason(report)
        if "its own tests check it" in why:
            return None
        if "not declared by backend" in why:
            return "undeclared", ""
        if why.startswith("refused: "):  # its first sentence says what was refused
            return "refused", why.removeprefix("refused: ").split(". ")[0][:300]
        return "skipped", why[:300]
    return ("refusal checked" if refusal else "passed"), ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("unimesh_capability")
    callspec = getattr(item, "callspec", None)
    if marker is None or callspec is None or "backend_name" not in callspec.params:
        return
    if report.when != "call" and report.outcome == "passed":
        return
    found = _outcome(report, bool(marker.kwargs.get("refusal")))
    if found is not None:
        _cases.append(Case(callspec.params["backend_name"], marker.args[-1], item.nodeid, *found))


def matrix() -> dict[str, dict[str, Cell]]:
    """backend -> capability -> :class:`~unimesh.conformance.matrix.Cell` of this process."""
    return merge(_cases)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    m = matrix()
    _report(config, "cases", [c.to_json() for c in _cases])
    if not m:
        return
    terminalreporter.section("unimesh capability matrix")
    names = sorted(m)
    rows = text_rows({b: m[b] for b in names})
    first = max(len(cap) for cap, _ in rows) + 2
    widths = [max(len(b), *(len(cells[i]) for _, cells in rows)) + 2 for i, b in enumerate(names)]
    terminalreporter.write_line(" " * first + "".join(f"{b:>{w}s}" for b, w in zip(names, widths)))
    for cap, cells in rows:
        terminalreporter.write_line(
            f"{cap:<{first}s}" + "".join(f"{c:>{w}s}" for c, w in zip(cells, widths))
        )
    terminalreporter.write_line(f"(counts are cases) {verdict_legend()}")
    for b in names:
        for cap, cell in m[b].items():
            for why in cell.notes():
                terminalreporter.write_line(f"{b}, {cap}: {why}"[:240])
    path = config.getoption("--unimesh-matrix-json")
    if path:
        with open(path, "w") as fh:
            json.dump(
                {b: {c: cell.to_json() for c, cell in m[b].items()} for b in names},
                fh,
                indent=2,
                sort_keys=True,
            )
    path = config.getoption("--unimesh-matrix-md")
    if path:
        with open(path, "w") as fh:
            fh.write(markdown({b: m[b] for b in names}))
