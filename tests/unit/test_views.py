"""What a sample's step shows (StepResult.poll): each server's view under the config in force,
the focus, and the snapshot the daemon makes of it, which is the one Snapshot(...) makes."""
from __future__ import annotations

import dataclasses

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.core.observations import DeviceSample, ProcessSample, Sample
from torch_watchdog.sidecar.core.step import Host, server_view, step
from torch_watchdog.sidecar.present import snapshot
from torch_watchdog.sidecar.present.snapshot import Snapshot
from tests.unit.test_step import CFG, GB, MB, compile_event, hello


def test_a_view_follows_the_config_in_force():
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
    host = Host()
    for obs in trace:
        result = step(host, obs, cfg)
    assert result.poll is not None and result.poll.focus == "srv"
    loose = result.poll.views["srv"]
    assert result.poll.focus_view is loose
    assert loose["estimates"]["mb_per_graph"] == pytest.approx(10 * MB / 1e6, rel=0.01)
    assert loose["pids"] == [7] and loose["gpus"] == ["GPU-a"]
    assert loose["forecast"]["gpu_uuid"] == "GPU-a"
    assert result.poll.agents_alive  # a CUDA graph per size, 10 MB each: it fires
    assert list(result.poll.firing["srv"]) == ["cudagraph_per_shape"]
    assert [c["cause"] for c in result.poll.focus_causes] == ["cudagraph_per_shape"]
    strict = dataclasses.replace(cfg, correlate=dataclasses.replace(cfg.correlate,
                                                                    min_records=1000))
    assert server_view(host.servers["srv"], strict)["estimates"]["mb_per_graph"] is None
    assert step(host, hello(t, 7, "srv", ["GPU-a"]), cfg).poll is None  # an event: no poll


def test_before_any_server_the_poll_shows_an_empty_focus():
    result = step(Host(), Sample(t=1000.0), CFG)
    assert result.actions == [] and result.poll is not None
    assert result.poll.focus is None and result.poll.views == {}
    assert result.poll.focus_view["estimates"]["recordings"] == 0
    assert result.poll.focus_view["forecast"]["seconds_to_oom"] is None


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
