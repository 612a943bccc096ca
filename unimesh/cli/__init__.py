"""The command line, ``unimesh`` or ``python -m unimesh``: ``demo``, ``backends``, ``show``,
``convert`` and ``check``. It names no backend: every list comes from the installed plugins."""

from __future__ import annotations

from .main import main

__all__ = ["main"]
