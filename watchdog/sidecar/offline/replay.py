"""Replay recorded traces through the very step the daemon runs (core/step.py).

Observations are stepped one at a time, in the order the live sidecar wrote them to its sample
log: the same decisions at the same times on the same targets. Times stay in the trace's own
time base.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from torch_watchdog.sidecar.core import step, views
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.observations import ConfigChange
from torch_watchdog.sidecar.core.results import Action, HostOutcome
from torch_watchdog.sidecar.offline.traces import Observation, Reader, read_all


@dataclass
class Run:
    # the step's state, handed to it and read by no one here (what a replay shows of it:
    # core/views.py)
    host: step.Host = field(default_factory=step.Host)
    actions: list[Action] = field(default_factory=list)
    observations: int = 0
    config: Optional[Config] = None   # the last one in force

    def end(self, config: Config) -> HostOutcome:
        """The host at the end: the focus server, every server's numbers, the findings."""
        return views.outcome(self.host, config)

    def outcome(self, config: Config, end: Optional[HostOutcome] = None) -> dict[str, Any]:
        end = end or self.end(config)
        return {"findings": end.findings, "actions": [a.as_dict() for a in self.actions],
                "estimates": end.estimates, "server": end.server, "servers": end.servers}


def run(observations: Iterable[Observation], config: Config,
        follow_config: bool = True) -> Run:
    """Step over `observations` as the live sidecar did. With `follow_config`, a config the
    live sidecar recorded in its sample log replaces `config` from then on (as SIGHUP did)."""
    r = Run(config=config)
    for obs in observations:
        r.observations += 1
        if isinstance(obs, ConfigChange):
            if follow_config:
                config = r.config = obs.config
            continue
        decided = step.step(r.host, obs, config).actions
        r.actions.extend(decided)
    return r


EPOCH_T = 1e9  # agent and sample logs count epoch seconds (> 2001); recorded traces from 0


def time_base(t: float) -> str:
    """"epoch" (agent logs, the sidecar's sample log) or "trace" (a recorded trace's own
    seconds since its process started)."""
    return "epoch" if t >= EPOCH_T else "trace"


def replay(paths: list[str], config: Config,
           progress: Optional[Callable[[str], None]] = None,
           follow_config: bool = True) -> dict[str, Any]:
    """Raises jsonl.InputError (naming the file) for a file that cannot be read or of which
    no line can be used."""
    started = time.perf_counter()
    readers = [Reader(p) for p in paths]
    first_t: dict[str, float] = {}  # per time base: where "the start of the trace" is

    def timed(observations: Iterable[Observation]) -> Iterable[Observation]:
        for obs in observations:
            first_t.setdefault(time_base(obs.t), obs.t)
            yield obs

    r = run(timed(read_all(readers, progress, "replay")), config, follow_config=follow_config)
    wall = time.perf_counter() - started
    # the recording's length, from its first observation to its last (not the focus
    # server's state, which starts again at each reset: "17.4 s of recording" for 75 s)
    end = r.end(r.config or config)
    last = end.last_t  # an agent's log: no samples, the focus state's time
    start = None if last is None else first_t.get(time_base(last))
    span = last - start if last is not None and start is not None else 0.0
    return {
        **r.outcome(r.config or config, end),
        "replay": {"files": paths, "observations": r.observations,
                   "bad_lines": sum(rd.bad_lines for rd in readers),
                   "used_lines": sum(rd.used_lines for rd in readers),
                   "first_t": first_t,
                   "trace_seconds": round(span, 3), "wall_seconds": round(wall, 3),
                   "speed": round(span / wall, 1) if wall > 0 else None},
    }


def since_start(t: float, first_t: dict[str, float]) -> float:
    """`t` as seconds from the start of its recording: a recorded trace's `t` already counts
    from its process's start (as `--json` prints it); an epoch time counts from the first
    observation in that time base."""
    base = time_base(t)
    return t - first_t.get(base, t) if base == "epoch" else t
