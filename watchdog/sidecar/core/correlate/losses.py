"""The events a server's agents said they dropped: per process, the larger of its drop reports'
totals (per reason) and its heartbeats' `lost` (every reason at once)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Losses:
    total: int = 0
    # pid -> reason -> the highest `total` its drop reports gave, and "" -> the highest `lost`
    # its heartbeats gave
    by_pid: dict[int, dict[str, int]] = field(default_factory=dict)

    def told(self, pid: int, reason: str, total: int) -> None:
        """An agent's loss count since it started, per reason (a drop report: a report lost on
        the way is counted by the next one) or all at once (reason "", a heartbeat)."""
        totals = self.by_pid.setdefault(pid, {})
        if total <= totals.get(reason, 0):
            return
        before = _lost_of(totals)
        totals[reason] = total
        self.total += _lost_of(totals) - before


def _lost_of(totals: dict[str, int]) -> int:
    return max(totals.get("", 0), sum(v for r, v in totals.items() if r))
