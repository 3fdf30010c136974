"""The C hot path (_hotpath.c) where it is built and not turned off, else None."""
from __future__ import annotations

from typing import Any

from torch_watchdog import pure_python

# Without it, or with TORCH_WATCHDOG_PURE_PYTHON=1 (set before the agent is imported), the
# Python path (calls.py) serves every call. Read at use, not imported by name, so that setting
# it to None here (the tests do) takes every user to the Python path.
_hotpath: Any = None
if not pure_python():
    try:
        from torch_watchdog.agent import _hotpath
    except ImportError:  # not built here (no compiler at install, a free-threaded CPython)
        _hotpath = None
