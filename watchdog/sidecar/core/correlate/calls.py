"""The calls a server served, from the agents' `calls` windows and `stall` events: requests,
the steady latency (calls that were not stalls), before and after the recompile limit."""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from torch_watchdog import events


MAX_MARKS = 20_000


class Window(NamedTuple):
    """One `calls` event: a window of the agent's calls."""
    t: float
    calls: int
    seconds: float
    stall_calls: int
    stall_seconds: float


@dataclass
class Calls:
    requests: int = 0
    windows: collections.deque[Window] = field(
        default_factory=lambda: collections.deque(maxlen=10_000))
    steady_totals: tuple[int, float] = (0, 0.0)         # non-stall calls, their seconds
    steady_at_limit: Optional[tuple[int, float]] = None  # steady_totals when the limit came
    stalls: int = 0
    stall_seconds: float = 0.0
    stall_causes: collections.Counter[str] = field(default_factory=collections.Counter)
    # (t, requests, distinct shapes) after each `calls` window, in time order, at most
    # MAX_MARKS (then the older half goes): the counts at a moment back, found by bisection
    marks: list[tuple[float, int, int]] = field(default_factory=list)

    def on_calls(self, e: events.Calls, distinct: int = 0) -> None:
        self.requests += e.calls
        if len(self.marks) >= MAX_MARKS:
            del self.marks[:MAX_MARKS // 2]
        self.marks.append((e.t, self.requests, distinct))
        self.windows.append(Window(e.t, e.calls, e.seconds, e.stall_calls, e.stall_seconds))
        calls, seconds = self.steady_totals
        self.steady_totals = (calls + e.calls - e.stall_calls,
                              seconds + e.seconds - e.stall_seconds)

    def at(self, t: float) -> Optional[tuple[float, int, int]]:
        """The counts (t, requests, distinct) of the last `calls` window at or before `t`."""
        i = bisect.bisect_right(self.marks, t, key=lambda m: m[0])
        return self.marks[i - 1] if i > 0 else None

    def on_stall(self, e: events.Stall) -> None:
        self.stalls += 1
        self.stall_seconds += e.seconds
        self.stall_causes[e.cause or "unknown"] += 1

    def mark_limit(self) -> None:
        """The recompile limit is reached now: the steady latency before it is what came so far."""
        self.steady_at_limit = self.steady_totals

    def steady_ms(self, part: str = "all") -> Optional[float]:
        """Mean latency of the calls that were not stalls: "all", or "before"/"after" the
        recompile limit was reached."""
        calls, seconds = self.steady_totals
        if part != "all":
            at = self.steady_at_limit
            if at is None:
                return None
            calls, seconds = at if part == "before" else (calls - at[0], seconds - at[1])
        return 1e3 * seconds / calls if calls > 0 else None
