"""One poll of the pipeline, shared by the daemon and `replay`: fold → forecast → decide."""
from __future__ import annotations

from typing import Iterable, Optional

from torch_watchdog.sidecar.core import correlate, policy
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.forecast import Forecast, forecast


def poll(state: correlate.State, ps: policy.PolicyState, observations: Iterable,
         cfg: Config, watched: Optional[set] = None) -> tuple[Forecast, list[policy.Action]]:
    correlate.fold(state, observations, cfg.correlate, watched)
    fc = forecast(state, cfg.forecast, cfg.correlate.min_records, cfg.correlate.jump_bytes)
    return fc, policy.decide(state, fc, ps, cfg.policy)
