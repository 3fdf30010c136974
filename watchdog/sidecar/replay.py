"""Replay recorded traces through the very pipeline the daemon runs: fold → forecast → decide.

Observations are folded one at a time; at every sample (a poll, in the daemon) the forecast is
made and the policy decides, as the live loop does. Times stay in the trace's own time base.
"""
from __future__ import annotations

import time
from typing import Any

from watchdog.sidecar import correlate, policy
from watchdog.sidecar.config import Config
from watchdog.sidecar.forecast import Forecast
from watchdog.sidecar.pipeline import poll
from watchdog.sidecar.samples import Sample
from watchdog.sidecar.traces import Reader, merged


def replay(paths: list[str], config: Config) -> dict[str, Any]:
    started = time.perf_counter()
    readers = [Reader(p) for p in paths]
    state, ps = correlate.State(), policy.PolicyState()
    actions: list[policy.Action] = []
    fc, observations = None, 0
    for obs in merged(readers):
        observations += 1
        if isinstance(obs, Sample):  # a poll, exactly as the daemon makes one
            fc, decided = poll(state, ps, (obs,), config)
            actions.extend(decided)
            continue
        correlate.fold(state, (obs,), config.correlate)  # events one by one: exact finding times
        if fc is None:  # an agent log without samples: no forecast, causes are still alerted
            actions.extend(policy.decide(state, Forecast(None, None), ps, config.policy))
    wall = time.perf_counter() - started
    span = (state.now - state.first_t) if state.first_t is not None else 0.0
    estimates = state.estimates(config.correlate)
    if fc is not None:
        estimates.update(fc.as_dict())
    return {
        "findings": [f.as_dict() for f in state.findings],
        "actions": [a.as_dict() for a in actions],
        "estimates": estimates,
        "replay": {"files": paths, "observations": observations,
                   "bad_lines": sum(r.bad_lines for r in readers),
                   "trace_seconds": round(span, 3), "wall_seconds": round(wall, 3),
                   "speed": round(span / wall, 1) if wall > 0 else None},
    }
