"""Replay recorded traces through the very pipeline the daemon runs: fold → forecast → decide.

Observations are folded one at a time; at every sample (a poll, in the daemon) the forecast is
made and the policy decides, as the live loop does. Times stay in the trace's own time base.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from torch_watchdog.sidecar.core import correlate, policy
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.forecast import Forecast
from torch_watchdog.sidecar.core.pipeline import poll
from torch_watchdog.sidecar.sources.samples import ConfigChange, Sample
from torch_watchdog.sidecar.offline.traces import Observation, Reader, read_all

# called after each observation is folded, with what the policy decided on it (the report's hook)
Observer = Callable[[Observation, correlate.State, list], None]


@dataclass
class Run:
    state: correlate.State = field(default_factory=correlate.State)
    actions: list = field(default_factory=list)
    forecast: Optional[Forecast] = None
    observations: int = 0
    config: Optional[Config] = None   # the last one in force

    def outcome(self, config: Config) -> dict[str, Any]:
        estimates = self.state.estimates(config.correlate)
        if self.forecast is not None:
            estimates.update(self.forecast.as_dict())
        return {"findings": [f.as_dict() for f in self.state.findings],
                "actions": [a.as_dict() for a in self.actions], "estimates": estimates}


def run(observations: Iterable[Observation], config: Config,
        observe: Optional[Observer] = None, follow_config: bool = True) -> Run:
    """Fold, forecast, decide over `observations`. With `follow_config`, a config the live
    sidecar recorded in its sample log replaces `config` from then on (as SIGHUP did)."""
    r, ps = Run(config=config), policy.PolicyState()
    state = r.state
    for obs in observations:
        r.observations += 1
        if isinstance(obs, ConfigChange):
            if follow_config:
                config = r.config = obs.config
            continue
        if isinstance(obs, Sample):  # a poll, exactly as the daemon makes one
            r.forecast, decided = poll(state, ps, (obs,), config)
        else:
            correlate.fold(state, (obs,), config.correlate)  # events one by one: exact times
            decided = []
            if r.forecast is None:  # an agent log without samples: causes are still alerted
                decided = policy.decide(state, Forecast(None, None), ps, config.policy)
        r.actions.extend(decided)
        if observe is not None:
            observe(obs, state, decided)
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
    state = r.state
    span = (state.now - state.first_t) if state.first_t is not None else 0.0
    return {
        **r.outcome(r.config),
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
