"""A stuck sidecar loop, for the watchdog test (installed as sitecustomize.py on the sidecar's
PYTHONPATH by a drop-in the test adds): once /run/tw-fault/hang exists, the loop's next poll
blocks for ever; the sidecar's other threads (the status page, NVML's worker) run on."""
import os
import threading

from torch_watchdog.sidecar import daemon

_tick = daemon.Daemon.tick


def tick(self):
    if os.path.exists("/run/tw-fault/hang"):
        threading.Event().wait()
    return _tick(self)


daemon.Daemon.tick = tick
