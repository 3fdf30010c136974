"""Each server's view (present/views.py) is built again only when what it shows changed: after
every observation of the step's differential traces and recorded fixtures, the kept views
must equal views built from scratch, as the daemon built them every poll."""
from __future__ import annotations

import dataclasses
import os

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.step import Host, step
from torch_watchdog.sidecar.offline.traces import Reader, read_all
from torch_watchdog.sidecar.present import snapshot
from torch_watchdog.sidecar.present.snapshot import Snapshot
from torch_watchdog.sidecar.present.views import ServerViews
from torch_watchdog.sidecar.core.observations import (ConfigChange, DeviceSample, ProcessSample,
    Sample)
from tests.unit.test_step import CFG, GB, MB, calls, compile_event, hello
from tests.unit.test_step_repeats import FIX, eight_by_eight_trace, host_trace, \
    time_alone_trace


def fresh(host: Host, cfg: Config) -> dict:
    """The views as the daemon built them every poll before."""
    return {name: {"estimates": s.state.estimates(cfg.correlate),
                   "forecast": s.forecast.as_dict(), "active_causes": tuple(s.state.active),
                   "pids": sorted(s.pids), "gpus": sorted(s.state.gpus or s.gpus)}
            for name, s in host.servers.items()}


def compare(trace: list, cfg: Config) -> tuple[int, int]:
    """Steps through `trace`, comparing kept and fresh views after every observation; returns
    (views asked for, estimates dicts built)."""
    host, views, asked = Host(), ServerViews(), 0
    for i, obs in enumerate(trace):
        if isinstance(obs, ConfigChange):
            cfg = obs.config
            continue
        step(host, obs, cfg)
        kept = views.build(host.servers, cfg.correlate)
        asked += len(kept)
        assert kept == fresh(host, cfg), f"observation {i}: {obs!r}"[:300]
    return asked, views.built


def test_kept_views_equal_fresh_ones_on_two_replicas_with_a_leak_and_a_restart():
    asked, built = compare(host_trace(), CFG)
    assert built < asked / 3  # most polls show what the last one did


def test_kept_views_equal_fresh_ones_on_a_big_host_with_moving_memory():
    asked, built = compare(eight_by_eight_trace(), CFG)
    assert built < asked / 2


def test_kept_views_follow_what_time_alone_changes():
    """Still memory while pending steps age into unexplained growth and the recordings'
    MB/graph gains confidence with every still poll."""
    trace, cfg = time_alone_trace()
    asked, built = compare(trace, cfg)
    assert built < asked / 3


@pytest.mark.parametrize("name", ["h200x2-two-replicas-samples.jsonl.gz",
                                  "h200-leak-bucketed-samples.jsonl.gz",
                                  "h200-torch2.11-batchseq-dynamic.jsonl.gz"])
def test_kept_views_equal_fresh_ones_on_recorded_traces(name):
    compare(read_all([Reader(os.path.join(FIX, name))]), Config())


def padding_trace() -> list:
    """The agent's padding totals, changed in place in the state by each `padding` event, a
    check refusing one model, and still polls between."""
    out, t, pid = [hello(1000.0, 7, "srv", ["GPU-a"])], 1000.0, 7
    for k in range(300):
        t += 0.1
        if k % 20 == 5:
            out.append(events.Padding(
                t=t, pid=pid, name="llm", on=True, buckets=[256, 512 + k], calls=10 * k,
                padded_calls=9 * k, real_tokens=900 * k, padding_tokens=100 * k, checks=k // 20,
                check_seconds=0.01 * k, max_error={"float16": 0.001 * k},
                recordings_saved=k))
        if k == 150:
            out.append(events.Mitigation(t=t, pid=pid, name="padding", action="refused",
                                         detail="differs", model="llm", error=0.3,
                                         buckets=[32]))
        if k % 10 == 0:
            out.append(calls(t, pid, 20, 3))
        out.append(Sample(t=t, devices=(DeviceSample("GPU-a", 20 * GB, 80 * GB, 60 * GB),),
                          processes=(ProcessSample(pid, True, GB, {"GPU-a": 10 * GB}),)))
    return out


def test_kept_views_follow_padding_changed_in_place():
    asked, built = compare(padding_trace(), CFG)
    assert built < asked / 2


def test_a_config_change_builds_the_views_again():
    """The same state under a config needing fewer recordings: the MB/graph now shows."""
    cfg = CFG
    trace = [hello(1000.0, 7, "srv", ["GPU-a"]), compile_event(1000.0, 7)]
    used, t = 20 * GB, 1020.0
    for k in range(30):
        t += 0.1
        trace.append(events.CudagraphRecord(t=t, pid=7, phase="record", compile_id="0/1",
                                            key=[k], shape=[[1, k]], seconds=0.01))
        used += 10 * MB
        trace.append(Sample(t=t, devices=(DeviceSample("GPU-a", used, 80 * GB, 80 * GB - used),),
                            processes=(ProcessSample(7, True, GB, {"GPU-a": used - GB}),)))
    host, views = Host(), ServerViews()
    for obs in trace:
        step(host, obs, cfg)
    strict = dataclasses.replace(cfg, correlate=dataclasses.replace(cfg.correlate,
                                                                    min_records=1000))
    assert views.build(host.servers, strict.correlate)["srv"]["estimates"]["mb_per_graph"] \
        is None
    loose = views.build(host.servers, cfg.correlate)
    assert loose["srv"]["estimates"]["mb_per_graph"] == pytest.approx(10 * MB / 1e6, rel=0.01)
    assert loose == fresh(host, cfg)


def test_a_snapshot_made_at_once_is_the_one_init_makes():
    """snapshot.make (the daemon's, each poll) fills the frozen instance's dict at once."""
    values = {f.name: f"value of {f.name}" for f in dataclasses.fields(Snapshot)}
    made = snapshot.make(values)
    assert type(made) is Snapshot and made == Snapshot(**values)
    assert vars(made) == vars(Snapshot(**values))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.t = 1.0  # type: ignore[misc]
    assert snapshot.make({"t": 2.0}) == Snapshot(t=2.0)  # a field left out: its default
    with pytest.raises(TypeError):
        snapshot.make({**values, "nonsense": 1})
