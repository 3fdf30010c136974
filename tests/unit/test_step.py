"""step() on hand-built observations: the host model's bookkeeping (no I/O, fake times)."""
from torch_watchdog import events
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.step import Host, step
from torch_watchdog.sidecar.sources.samples import ProcessSample, Sample

CFG = Config()


def hello(t, pid, server="svc"):
    return events.Hello(t=t, pid=pid, torch="2.13", agent="0", devices=[], config={},
                        capabilities={}, watched=[], argv="x", server=server, ppid=1)


def sample(t, alive):
    return Sample(t=t, processes=tuple(ProcessSample(pid, up, 100) for pid, up in alive.items()))


def test_agent_liveness_drops_at_the_first_poll_with_every_agent_gone():
    host = Host()
    for obs in (sample(0.0, {}), hello(0.5, 11), hello(0.6, 12)):
        step(host, obs, CFG)
    assert host.agents_alive()  # heard, not read yet
    step(host, sample(1.0, {11: True, 12: True}), CFG)
    assert host.agents_alive()
    step(host, sample(2.0, {11: False, 12: True}), CFG)
    assert host.agents_alive()
    step(host, sample(3.0, {11: False, 12: False}), CFG)
    assert not host.agents_alive()  # the next poll, not 30 s later
    step(host, sample(40.0, {11: False, 12: False}), CFG)
    assert host.agents == {} and not host.agents_alive()
