"""Headless Chromium for the tests: a screenshot of a page, and measurements taken by a script
in the page (written into the DOM, read back with ``--dump-dom``). Tests skip, naming why,
where Debian's ``chromium`` is not installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from .launch import run_bounded

#: Seconds one Chromium run may take on a loaded 2-core machine.
TIMEOUT = 120


def chromium() -> str:
    """The browser's path, or skip the test with the reason."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    hint = "headless Chromium is not installed: apt-get install chromium"
    if os.environ.get("CI"):
        pytest.fail(hint + " (.ci/run does)")
    pytest.skip(hint)


def _run(args: list[str], cwd: Path) -> str:
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={cwd / 'profile'}",
        *args,
    ]
    rc, out = run_bounded(cmd, dict(os.environ), TIMEOUT, cwd)
    assert rc == 0, out[-3000:]
    return out


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 1000) -> Path:
    """``page`` drawn at ``width`` x ``height`` CSS pixels, saved as ``png``."""
    with tempfile.TemporaryDirectory() as tmp:
        _run([f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri()], Path(tmp))
    assert png.exists() and png.stat().st_size > 0, png
    return png


def measure(page: Path, script: str, width: int = 1400, height: int = 1000) -> Any:
    """Load a copy of ``page`` at ``width`` x ``height`` and return the JSON value of
    ``script`` (a JavaScript expression) evaluated after the page loaded."""
    probe = page.with_name(f".probe-{page.name}")
    hook = (
        "<script>window.addEventListener('load', () => { const out = "
        "document.createElement('pre'); out.id = 'unimesh-probe'; out.textContent = "
        f"JSON.stringify({script}); document.body.appendChild(out); }});</script>"
    )
    probe.write_text(page.read_text().replace("</body>", hook + "</body>"))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dom = _run(
                [
                    f"--window-size={width},{height}",
                    "--virtual-time-budget=5000",
                    "--dump-dom",
                    probe.as_uri(),
                ],
                Path(tmp),
            )
    finally:
        probe.unlink()
    found = re.search(r'<pre id="unimesh-probe">(.*?)</pre>', dom, re.DOTALL)
    assert found, dom[-3000:]
    text = found.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">")
    return json.loads(text.replace("&amp;", "&"))
