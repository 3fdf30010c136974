"""The freeze remedy on recorded runs (issue 52): the corpus's sample logs of real GPU servers
replayed with `policy.remedy` changed in the config they recorded. Graph growth is frozen at
the moment the recorded sidecar decided its reload; a leak is reloaded as before; the recorded
servers were never asked, so no answer comes and the reload follows as the fallback."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.observations import ConfigChange, Sample
from torch_watchdog.sidecar.core.policy import FREEZE_ANSWER_S, FROZEN_GROWTH_BYTES
from torch_watchdog.sidecar.core import step
from torch_watchdog.sidecar.offline.traces import Reader

CORPUS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "corpus")


def label(name: str) -> dict:
    with open(os.path.join(CORPUS, "labels.json")) as fh:
        (truth,) = json.load(fh)[name]["servers"].values()
    return truth


def replayed(name: str, remedy: str, answer: str = "") -> list:
    """The remedy actions (freeze, reload) of a replay with `remedy`, stepped as
    offline.replay.run steps; `answer`: the agent's reply to the freeze, heard at the first
    sample 0.3 s after it ("": none)."""
    with open(os.path.join(CORPUS, "labels.json")) as fh:
        pid = int(next(iter(json.load(fh)[name]["servers"])))
    host, cfg, actions, asked_t = step.Host(), Config(), [], None
    for o in Reader(os.path.join(CORPUS, f"{name}.jsonl.gz")):
        if isinstance(o, ConfigChange):
            cfg = dataclasses.replace(o.config, policy=dataclasses.replace(o.config.policy,
                                                                           remedy=remedy))
            continue
        if answer and asked_t is not None and isinstance(o, Sample) and o.t >= asked_t + 0.3:
            step.step(host, events.Mitigation(
                t=o.t, pid=pid, name="freeze", action=answer, detail="312 sizes recorded; "
                "new sizes now run without CUDA graphs (cudagraph_capture_sizes)"), cfg)
            asked_t = None
        got = step.step(host, o, cfg).actions
        actions += got
        if any(a.kind == "freeze" for a in got):
            asked_t = o.t
    return [a for a in actions if a.kind in ("freeze", "reload")]


def test_graph_growth_is_frozen_when_the_reload_was_due_and_reloaded_when_none_answers():
    reload_only = replayed("real-gpt2-variable-seq", "reload")
    frozen = replayed("real-gpt2-variable-seq", "freeze_then_reload")
    truth = label("real-gpt2-variable-seq")
    assert [a.kind for a in reload_only] == ["reload"]
    assert [a.kind for a in frozen] == ["freeze", "reload"]
    freeze, fallback = frozen
    assert freeze.t == reload_only[0].t and freeze.detail["cause"] == "cudagraph_per_shape"
    assert FREEZE_ANSWER_S <= fallback.t - freeze.t < FREEZE_ANSWER_S + 1.0
    assert fallback.t < truth["oom_t"]


def test_a_leak_is_reloaded_as_before_and_never_frozen():
    assert [(a.kind, a.t) for a in replayed("real-leak-medium", "freeze_then_reload")] == \
        [(a.kind, a.t) for a in replayed("real-leak-medium", "reload")] != []


def test_remedy_freeze_never_reloads():
    assert [a.kind for a in replayed("real-gpt2-variable-seq", "freeze")] == ["freeze"]


@pytest.mark.parametrize("name", ["real-gpt2-variable-seq", "gpt2-variable-seq"])
def test_a_freeze_that_took_but_did_not_stop_the_recorded_growth_is_reloaded(name):
    """The agent said "engaged", but this recording's memory grows on (it was never frozen):
    the reload comes once it grew FROZEN_GROWTH_BYTES past the memory at the freeze."""
    freeze, fallback = replayed(name, "freeze_then_reload", answer="engaged")
    assert (freeze.kind, fallback.kind) == ("freeze", "reload")
    assert fallback.detail["level_bytes"] - freeze.detail["level_bytes"] > FROZEN_GROWTH_BYTES
