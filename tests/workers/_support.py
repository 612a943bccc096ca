"""Imported first by a worker: puts ``tests/support`` (the cases and checks a worker shares with
the tests) on ``sys.path``, as a worker runs as a script from ``tests/workers``."""

import sys
from pathlib import Path

_SUPPORT = str(Path(__file__).resolve().parents[1] / "support")
if _SUPPORT not in sys.path:
    sys.path.insert(1, _SUPPORT)
