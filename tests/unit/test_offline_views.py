"""`replay` and `report` read what the core gives out (core/views.py, core/results.py), never
the step's state: a read of the host model, a server, or a server's correlation, policy or
forecast state from an offline module fails here (issue 38: core state private)."""
import os
import sys

import pytest

from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core import correlate, forecast, host, policy
from torch_watchdog.sidecar.offline import replay, report

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
STATE = (host.Host, host.Server, correlate.State, policy.PolicyState, forecast.Forecast)


@pytest.fixture
def reads(monkeypatch):
    """(module, class, attribute) of each read of the step's state from an offline module."""
    found = set()

    def watched(cls):
        plain = cls.__getattribute__

        def getattribute(self, name):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("torch_watchdog.sidecar.offline"):
                found.add((caller, cls.__name__, name))
            return plain(self, name)
        return getattribute

    for cls in STATE:
        monkeypatch.setattr(cls, "__getattribute__", watched(cls))
    return found


@pytest.mark.parametrize("name", ["h200-oom300.jsonl.gz", "h200x2-two-replicas-samples.jsonl.gz"])
def test_replay_and_report_read_views_not_the_steps_state(reads, tmp_path, name):
    path = os.path.join(FIX, name)
    replayed = replay.replay([path], Config())
    built = report.write_report([path], str(tmp_path / "report.html"), Config())
    assert replayed["servers"] and built["servers"]  # they ran, and saw a server
    assert sorted(reads) == []


def test_the_watch_sees_a_read(reads):
    """The check itself: a Host read from an offline module is seen."""
    from torch_watchdog.sidecar.core.step import Host
    code = compile("host.servers", "<offline>", "eval")
    eval(code, {"__name__": "torch_watchdog.sidecar.offline.x", "host": Host()})
    assert reads == {("torch_watchdog.sidecar.offline.x", "Host", "servers")}
