"""The agents' hellos, as a reload's thread sees them: masters and their workers, and the
replacements a reload waits for (said hello, then answered a watched call: ready to serve).
The daemon's loop adds them; reload threads read and wait.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from torch_watchdog.sidecar.actions.identity import parent_of


# -- the agents' hellos, and masters with workers ----------------------------------------------
@dataclass(frozen=True)
class Heard:
    """A hello as the sidecar received it; `seq` orders arrivals."""
    seq: int
    pid: int
    ppid: Optional[int]
    server: Optional[str]


class Hellos:
    """The agents' hellos, fed by the daemon's loop each poll, read by a reload's thread: who
    said hello (a worker has an agent; a master's other children, inductor's compile workers
    or multiprocessing's resource tracker, have none) and who said it since a reload began.
    Bounded: the last `keep` hellos and the latest of `keep` pids."""

    def __init__(self, keep: int = 4096):
        self._cond = threading.Condition()
        self._seq = 0
        self._keep = keep
        self._recent: collections.deque[Any] = collections.deque(maxlen=keep)
        self._last: dict[int, Heard] = {}
        self._served: dict[int, None] = {}  # pids whose agents reported an answered call

    def add(self, received: Iterable[Any]) -> None:
        """The hellos among `received` (agent events), and who answered a watched call (a
        `calls` event with calls > 0)."""
        hellos, served = [], []
        for e in received:
            if e.kind == "hello":
                hellos.append(e)
            elif e.kind == "calls" and isinstance(e.calls, int) and e.calls > 0 \
                    and e.pid not in self._served:
                served.append(e.pid)
        if not hellos and not served:
            return
        with self._cond:
            for pid in served:
                self._served[pid] = None
                if len(self._served) > self._keep:
                    del self._served[next(iter(self._served))]
            for h in hellos:
                self._seq += 1
                heard = Heard(self._seq, h.pid, h.ppid if isinstance(h.ppid, int) else None,
                              h.server if isinstance(h.server, str) else None)
                self._recent.append(heard)
                self._last.pop(h.pid, None)
                self._last[h.pid] = heard
                if len(self._last) > self._keep:
                    del self._last[next(iter(self._last))]
            self._cond.notify_all()

    def served(self, pid: int) -> bool:
        """Whether `pid`'s agent reported an answered watched call."""
        with self._cond:
            return pid in self._served

    def wait_served(self, pid: int, timeout: float,
                    give_up: Callable[[], bool] = lambda: False) -> bool:
        """Until `pid` answered a watched call (True), `timeout` seconds or `give_up()`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while pid not in self._served:
                left = deadline - time.monotonic()
                if left <= 0 or give_up():
                    return False
                self._cond.wait(min(left, 0.2))
            return True

    def mark(self) -> int:
        with self._cond:
            return self._seq

    def heard(self, pid: int) -> Optional[Heard]:
        with self._cond:
            return self._last.get(pid)

    def since(self, mark: int) -> list[Heard]:
        with self._cond:
            return [h for h in self._recent if h.seq > mark]

    def wait_for(self, match: Callable[[Heard], bool], mark: int, timeout: float,
                 give_up: Callable[[], bool] = lambda: False) -> Optional[Heard]:
        """The first hello after `mark` that `match`es, waiting up to `timeout` seconds for it;
        None on time out or once `give_up()` (checked every 0.2 s)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((h for h in self._recent if h.seq > mark and match(h)), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0 or give_up():
                    return found
                self._cond.wait(min(left, 0.2))


def master_and_workers(pids: set[int], hellos: Hellos) -> tuple[Optional[int], list[int]]:
    """The server's master and its workers. Workers are processes among `pids` whose agents
    said hello and whose parent (read now) is the master: one process among `pids`
    (`gunicorn --preload`, or a configured unit or pidfile whose main pid is the master), else
    the common parent of two or more of them (uvicorn --workers, gunicorn without --preload: a
    master without the agent; one worker alone cannot be told from a shell that started one
    server). (None, []) for a single process, even with children of its own (inductor's
    compile workers say no hello), and when it is ambiguous (parents at several levels)."""
    parents = {pid: parent_of(pid) for pid in pids if hellos.heard(pid) is not None}
    agents = {pid: pp for pid, pp in parents.items() if pp is not None and pp > 1}
    inside = {pp for pp in agents.values() if pp in pids}
    if len(inside) == 1:
        master = inside.pop()
    elif not inside and len(agents) >= 2 and len(set(agents.values())) == 1:
        master = next(iter(agents.values()))
    else:
        return None, []
    return master, sorted(pid for pid, pp in agents.items() if pp == master)
