"""A toy server for the reload tests: announces itself to the sidecar like the agent does (hello),
grows its memory 5 MB every 0.1 s (not with a third argument `flat`: a server that came back
and holds still), and stops gracefully on SIGTERM (writing a marker)."""
import os
import signal
import sys
import time

from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter


def main(sock: str, marker: str, grow: bool = True) -> None:
    def stop(*_):
        with open(marker, "w") as fh:
            fh.write("graceful")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    em = Emitter(sock, None)
    em.emit(events.Hello(t=time.time(), pid=os.getpid(), torch="", agent="toy", devices=[],
                         config={}, capabilities={}, watched=[], argv="toy_server", server=None,
                         ppid=os.getppid()))
    hoard = []
    for i in range(600):
        if grow:
            hoard.append(bytearray(5 << 20))  # touched: it counts in RSS
        em.emit(events.Heartbeat(t=time.time(), pid=os.getpid(), seq=i, uptime_s=i / 10,
                                 queue_depth=0, errors=0))
        em.drain()
        time.sleep(0.1)


if __name__ == "__main__":  # a script: importing it (pytest given its path) does nothing
    main(sys.argv[1], sys.argv[2], grow=sys.argv[3:4] != ["flat"])
