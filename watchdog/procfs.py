"""A process's start time as the kernel keeps it, read the one way every part of the project
does (the agent's restart file, the launcher's reaper, the sidecar's pid identity). Stdlib
(psutil only where /proc is not there, imported then)."""
from __future__ import annotations

import os
import time
from typing import Optional

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def start_ticks(pid: int, proc: str = "/proc") -> int:
    """Field 22 of /proc/<pid>/stat: clock ticks from boot to the process's start; with the
    pid, a process no reuse can impersonate. OSError when there is no such process (the
    comm field may hold spaces and parentheses: the fields are counted after the last ')')."""
    with open(f"{proc}/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[19])


def process_start_time(pid: int) -> Optional[float]:
    """When `pid` started, wall-clock seconds, to a clock tick (10 ms); None when there is no
    such process. psutil's create_time() adds /proc/stat's btime, whole seconds: up to 1 s
    early, enough for a pid reused within that second to look older
    than the decision. The process's age on the boot clock, both read now, is exact."""
    try:
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks(pid) / _CLK_TCK
        return time.time() - age
    except (OSError, IndexError, ValueError, AttributeError):  # not Linux, or gone
        import psutil

        try:
            return float(psutil.Process(pid).create_time())
        except psutil.Error:
            return None
