"""A process outside the server unit's cgroup that says hello for it (server "llm.service"),
then heartbeats: the sidecar must not take it for the server."""
import os
import sys
import time

from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter

em = Emitter(sys.argv[1], None)
hello = events.Hello(t=time.time(), pid=os.getpid(), torch="", agent="impostor", devices=[],
                     config={}, capabilities={}, watched=[], argv="impostor",
                     server="llm.service", ppid=os.getppid())
for i in range(600):
    if i % 10 == 0:
        em.emit(hello)
    em.emit(events.Heartbeat(t=time.time(), pid=os.getpid(), seq=i, uptime_s=i / 2,
                             queue_depth=0, errors=0))
    em.drain()
    time.sleep(0.5)
