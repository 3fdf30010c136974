"""A process's start time as the kernel keeps it, read the one way every part of the project
does (the agent's restart file, the launcher's reaper, the sidecar's pid identity). Stdlib."""
from __future__ import annotations


def start_ticks(pid: int, proc: str = "/proc") -> int:
    """Field 22 of /proc/<pid>/stat: clock ticks from boot to the process's start; with the
    pid, a process no reuse can impersonate. OSError when there is no such process (the
    comm field may hold spaces and parentheses: the fields are counted after the last ')')."""
    with open(f"{proc}/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[19])
