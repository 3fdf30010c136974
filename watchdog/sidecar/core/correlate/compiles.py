"""The compiler's part of a server's state: compiles and recompiles (counted per process: each
worker of a multi-worker server compiles its own frames), the recompile limit, reached as the
agent says or inferred, and whether new shapes keep arriving without a compile after it."""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Optional, Union

from torch_watchdog import events


@dataclass
class Compiles:
    limit: Optional[int] = None           # the recompile limit the agent's hello reported
    first_t: Optional[float] = None       # the first compile's end
    last_end: float = -math.inf           # the latest compile's end
    compiles: int = 0
    recompiles: int = 0
    seconds: float = 0.0
    fx_cache_hits: int = 0         # Inductor FX-graph cache, as the agent reports (torch 2.6+)
    fx_cache_misses: int = 0
    graph_breaks: int = 0
    # pid -> its recompile times, within the storm window (evaluate_causes trims them)
    recompile_times: dict[int, collections.deque[float]] = field(default_factory=dict)
    # (pid, frame id) -> compiles seen
    frame_attempts: dict[tuple[int, str], int] = field(default_factory=dict)
    limit_hits: int = 0                   # the agent's recompile_limit events
    limit_t: Optional[float] = None       # the limit is reached (maybe inferred)
    limit_frame: Optional[tuple[int, str]] = None  # (pid, frame id) that reached it
    new_shapes_after_limit: int = 0       # new shapes seen with no compile since the limit

    def on_hello(self, e: events.Hello) -> None:
        limit = e.config.get("recompile_limit", e.config.get("cache_size_limit"))
        if isinstance(limit, int) and not isinstance(limit, bool):
            self.limit = limit

    def on_compile(self, e: Union[events.Compile, events.Recompile],
                   default_limit: int) -> bool:
        """One compile or recompile; True when it is the one that reached the limit
        (inferred: the agent did not say)."""
        recompile = isinstance(e, events.Recompile)
        self.recompiles += recompile
        self.compiles += not recompile
        self.seconds += e.seconds or 0.0
        self.fx_cache_hits += e.fx_cache_hits or 0
        self.fx_cache_misses += e.fx_cache_misses or 0
        if self.first_t is None:
            self.first_t = e.t
        if recompile:
            self.recompile_times.setdefault(e.pid, collections.deque()).append(e.t)
        self.last_end = max(self.last_end, e.t)
        frame = (e.pid, (e.compile_id or "").split("/")[0])
        attempts = self.frame_attempts[frame] = self.frame_attempts.get(frame, 0) + 1
        limit = self.limit or default_limit
        if self.limit_hits:
            return False  # the agent told us when the limit was hit; nothing to infer
        if attempts == limit:
            self.limit_t, self.limit_frame = e.t, frame  # the fallback shows once new shapes
            self.new_shapes_after_limit = 0              # stop compiling
            return True
        if attempts > limit and frame == self.limit_frame:
            self.limit_t = None  # it compiled again: the limit is not what we assumed
        return False

    def on_limit(self, e: events.RecompileLimit) -> None:
        self.limit_hits += 1
        self.limit_t = e.t

    def on_new_shape(self, t: float) -> None:
        """A new shape: after an inferred limit, one more that no compile answered."""
        if self.limit_t is not None and t > self.limit_t and self.limit_hits == 0 and \
                t > self.last_end:
            self.new_shapes_after_limit += 1

    def recompiles_in_window(self, now: float, window_s: float) -> int:
        """The most recompiles one process made within `window_s` before `now` (older ones
        are forgotten)."""
        most = 0
        for pid, times in list(self.recompile_times.items()):
            while times and times[0] < now - window_s:
                times.popleft()
            if not times:
                del self.recompile_times[pid]
            most = max(most, len(times))
        return most
