"""pytest plugin of the conformance suite (entry point ``pytest11: unimesh``).

Import-light: it imports no framework; backends are loaded when the suite's tests run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from . import CHECKED

ENV = "UNIMESH_CONFORMANCE_BACKENDS"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("unimesh", "unimesh conformance suite")
    group.addoption("--unimesh-backend", action="append", default=[], metavar="NAME",
                    help="backend to check (repeatable; 'all' = every installed backend); "
                         f"also the {ENV} environment variable")
    group.addoption("--unimesh-matrix-json", metavar="PATH", default=None,
                    help="write the capability matrix as JSON here")
    group.addoption("--unimesh-matrix-md", metavar="PATH", default=None,
                    help="write the capability matrix as Markdown here")
    group.addoption("--unimesh-progress", metavar="PATH", default=None,
                    help="append one line per finished test to PATH (for unimesh check)")


def pytest_configure(config: pytest.Config) -> None:
    _config["config"] = config
    config.addinivalue_line("markers", "unimesh_capability(name): the capability a conformance "
                                       "test exercises")


def selected_backends(config: pytest.Config) -> list[str]:
    names: list[str] = []
    for item in list(config.getoption("--unimesh-backend")) + [
            n for n in os.environ.get(ENV, "").split(",") if n.strip()]:
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
                f"the unimesh conformance suite needs a backend: --unimesh-backend NAME (or {ENV})")
        metafunc.parametrize("backend_name", names, scope="session")


_results: dict[tuple[str, str], list[str]] = {}
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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _config.get("config")
    if config is None:
        return
    if report.failed:
        message = str(report.longrepr).strip().splitlines()
        _report(config, "failed", {"test": report.nodeid,
                                   "why": message[-1][:300] if message else ""})
    if report.when == "teardown":
        _progress["done"] += 1
        _report(config, "done", _progress["done"])


_config: dict[str, pytest.Config] = {}


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
    if report.outcome == "skipped":
        verdict = "not declared" if "not declared" in str(report.longrepr) else "skipped"
    elif report.outcome == "passed":
        verdict = "not declared" if marker.kwargs.get("refusal") else "pass"
    else:
        verdict = "fail"
    _results.setdefault((callspec.params["backend_name"], marker.args[-1]), []).append(verdict)


def matrix() -> dict[str, dict[str, str]]:
    """backend -> capability -> 'pass' | 'fail' | 'not declared' | 'skipped'."""
    out: dict[str, dict[str, str]] = {}
    for (backend, cap), outcomes in _results.items():
        if "fail" in outcomes:
            verdict = "fail"
        elif "pass" in outcomes:
            verdict = "pass"
        elif "not declared" in outcomes:
            verdict = "not declared"
        else:
            verdict = "skipped"
        out.setdefault(backend, {})[cap] = verdict
    return out


def _markdown(m: dict[str, dict[str, str]]) -> str:
    lines = ["| backend | " + " | ".join(CHECKED) + " |",
             "| --- | " + " | ".join("---" for _ in CHECKED) + " |"]
    for backend in sorted(m):
        lines.append(f"| {backend} | " + " | ".join(m[backend].get(c, "-") for c in CHECKED)
                     + " |")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    m = matrix()
    _report(config, "matrix", m)
    if not m:
        return
    terminalreporter.section("unimesh capability matrix")
    width = max(len(b) for b in m) + 2
    terminalreporter.write_line(" " * width + "".join(f"{c:>15s}" for c in CHECKED))
    for backend in sorted(m):
        row = "".join(f"{m[backend].get(c, '-'):>15s}" for c in CHECKED)
        terminalreporter.write_line(f"{backend:<{width}s}{row}")
    path = config.getoption("--unimesh-matrix-json")
    if path:
        with open(path, "w") as fh:
            json.dump(m, fh, indent=2, sort_keys=True)
    path = config.getoption("--unimesh-matrix-md")
    if path:
        with open(path, "w") as fh:
            fh.write(_markdown(m))
