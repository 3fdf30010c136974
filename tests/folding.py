"""A server's correlation state from a list of observations, as the step builds it: each one
applied in turn, then the causes evaluated once (the step: once a poll)."""
from __future__ import annotations

from typing import Iterable

from torch_watchdog.sidecar.config import CorrelateConfig
from torch_watchdog.sidecar.core import correlate


def fold(state: correlate.State, observations: Iterable, cfg: CorrelateConfig
         ) -> correlate.State:
    for obs in observations:
        correlate.apply(state, obs, cfg)
    correlate.evaluate_causes(state, cfg)
    return state
