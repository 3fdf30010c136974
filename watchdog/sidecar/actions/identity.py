"""A pid is signalled only while it is still the process that was seen: its start time, read
once when it was first seen, and never one that started after the reload was decided.
"""
from __future__ import annotations

import os
from typing import Optional

import psutil

from torch_watchdog.procfs import process_start_time

# A pid's start time read twice for the same process differs by rounding (clock ticks, 10 ms)
# and by a step of the wall clock in between; a reused pid starts later by far more than this.
START_SLACK_S = 0.5


def refusal(pid: int, decided_t: Optional[float] = None,
            expected_start: Optional[float] = None) -> Optional[str]:
    """Why `pid` must not be signalled, or None. Never pid <= 1 (init; 0 and -1 are process
    groups to kill(2)), the sidecar or its parent; never a process that started after the
    decision (`decided_t`, wall-clock time) or at another time than the one seen
    (`expected_start`, `process_start_time` when the pid was seen): the server exited and its
    pid was reused."""
    if pid <= 1:
        return f"pid {pid}: never signalled"
    if pid == os.getpid():
        return f"pid {pid}: the sidecar itself"
    if pid == os.getppid():
        return f"pid {pid}: the sidecar's parent"
    if decided_t is None and expected_start is None:
        return None
    created = process_start_time(pid)
    if created is None:
        return None  # gone: nothing to signal, signal_processes finds out
    if expected_start is not None and abs(created - expected_start) > START_SLACK_S:
        return (f"pid {pid}: started at {created:.2f}, not the server seen (started at "
                f"{expected_start:.2f}): pid reused")
    if decided_t is not None and created > decided_t:
        return (f"pid {pid}: started {created - decided_t:.1f} s after the reload decision: "
                f"pid reused")
    return None


def parent_of(pid: int) -> Optional[int]:
    try:
        return int(psutil.Process(pid).ppid())
    except psutil.Error:
        return None
