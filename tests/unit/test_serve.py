"""agent/serve.py: a Ray Serve replica's server name, its health check during a drain, and a
drain handed to Serve (the process left for Serve to stop) or, Serve not stopping it within
the grace, drained as usual (exit 75). No ray here: a stand-in `ray.serve` module."""
from __future__ import annotations

import atexit
import os
import sys
import threading
import types

import pytest

from torch_watchdog import events
from torch_watchdog.agent import drain, identity, serve
from torch_watchdog.sidecar.actions.alerting import Alerting
from torch_watchdog.sidecar.config import AlertsConfig


def context(app="llm", deployment="Model", rank=1):
    return types.SimpleNamespace(app_name=app, deployment=deployment,
                                 rank=types.SimpleNamespace(rank=rank, node_rank=0,
                                                            local_rank=rank))


class FakeServe(types.ModuleType):
    """`ray.serve` as a replica sees it (get_replica_context), or a driver (it raises)."""

    def __init__(self, ctx=None):
        super().__init__("ray.serve")
        self.ctx = ctx

    def get_replica_context(self):
        if self.ctx is None:
            raise RuntimeError("`serve.get_replica_context()` may only be called from within a "
                               "Ray Serve deployment.")
        return self.ctx


@pytest.fixture(autouse=True)
def fresh_drain_state(monkeypatch):
    monkeypatch.setattr(drain, "_state", drain._State())
    monkeypatch.setattr(drain, "handover", None)
    monkeypatch.setattr(serve, "_handover", serve._Handover())
    monkeypatch.delitem(sys.modules, "ray.serve", raising=False)


@pytest.mark.parametrize("ctx,name", [
    (context(), "serve:llm/Model/1"),
    (context(rank=0), "serve:llm/Model/0"),
    (types.SimpleNamespace(app_name="a", deployment="D", rank=3), "serve:a/D/3"),  # an int rank
    (context(rank=None), None),        # a replica before Serve gave it a rank
    (context(rank=-1), None),
    (context(rank=True), None),
    (context(app="bad\nname"), None),  # not a printable name: no label, no datagram field
    (types.SimpleNamespace(app_name="a"), None),  # an older context: no rank, no deployment
])
def test_a_replica_is_named_after_its_application_deployment_and_rank(ctx, name):
    assert serve.replica_name(ctx) == name


def test_a_long_name_is_clipped_to_the_longest_name_a_server_may_have():
    name = serve.replica_name(context(app="a" * 300))
    assert name is not None and len(name) == identity.MAX_NAME_CHARS


def test_the_name_comes_from_the_replica_context_of_this_process(monkeypatch):
    assert serve.replica_name() is None  # ray.serve not loaded: not a replica
    fake = FakeServe()
    monkeypatch.setitem(sys.modules, "ray.serve", fake)
    assert serve.replica_name() is None  # loaded, but no replica here (a driver)
    fake.ctx = context(rank=0)
    assert serve.replica_name() == "serve:llm/Model/0"


def test_in_a_replica_the_serve_name_comes_before_the_automatic_ones_and_after_an_explicit(
        monkeypatch):
    kw = dict(env={"CUDA_VISIBLE_DEVICES": "0"}, read_cgroup=lambda: "0::/system.slice/a.service",
              getpgid=lambda _: 7)
    assert identity.server_name(None, **kw) == "a.service/cuda:0"
    monkeypatch.setitem(sys.modules, "ray.serve", FakeServe(context()))
    assert identity.server_name(None, **kw) == "serve:llm/Model/1"
    assert identity.server_name("my-llm", **kw) == "my-llm"  # the override


@pytest.mark.parametrize("server,deployment", [
    ("serve:llm/Model/1", "llm/Model"),
    ("serve:app/with/slash/0", "app/with/slash"),
    ("serve:llm/Model", None),  # no rank
    ("pgid:7/cuda:0", None),
    ("llm", None),
])
def test_alerts_of_a_replica_carry_its_deployment(server, deployment):
    assert events.serve_deployment(server) == deployment
    view = {"forecast": {"gpu_uuid": None}, "gpus": [], "estimates": {}}
    built = Alerting(AlertsConfig(), lambda *_: None)._alerts(
        server, {"oom_forecast": {"t": 1.0}}, view, {"service": "s", "instance": "h"})
    labels = [a["labels"] for a in built.values()]
    assert labels and all(x.get("deployment") == deployment for x in labels), labels


def test_the_health_check_passes_until_a_drain_and_fails_from_then_on():
    serve.check_health()
    assert drain.handover is serve._handover  # Serve health-checks through the agent
    drain._state.ready = False
    with pytest.raises(serve.ReplicaDraining):
        serve.check_health()


class FakeAgent:
    def __init__(self, restart_file=None):
        self.config = types.SimpleNamespace(drain_exit_code=75, restart_file=restart_file)
        self.sent, self.emitted, self.errors = [], [], []
        self.emitter = types.SimpleNamespace(emit=self.emitted.append)
        self.warm = None
        self.control = types.SimpleNamespace(send=lambda obj: self.sent.append(obj) or True)

    def on_error(self, e):
        self.errors.append(e)


@pytest.fixture
def drainer():
    """A Drainer of a FakeAgent whose exits are only recorded; its hold on the interpreter's
    exit (a drain's atexit hook) is lifted after the test."""
    made = []

    def make():
        agent, exits = FakeAgent(), []
        made.append(drain.Drainer(agent, lambda: None, exit=exits.append))
        return made[-1], agent, exits

    yield make
    for d in made:
        atexit.unregister(d._hold_exit)


def drained(agent: FakeAgent) -> events.Drain:
    (done,) = [e for e in agent.emitted if e.phase == "drained"]
    return done


def test_a_drain_handed_to_serve_refuses_no_call_and_leaves_the_exit_to_serve(
        short_tmp, monkeypatch, drainer):
    serve.check_health()  # Serve's controller health-checks this replica
    refused = []
    monkeypatch.setattr(drain, "refuse_new_calls", lambda: refused.append(True))
    waiting, wait_stopped = threading.Event(), serve._handover.wait_stopped
    monkeypatch.setattr(serve._handover, "wait_stopped",
                        lambda deadline: waiting.set() or wait_stopped(deadline))
    drainer, agent, exits = drainer()
    agent.config.restart_file = f"{short_tmp}/restart"
    assert drainer.start(30.0)
    assert not drain.ready() and not refused  # calls go on until Serve routes elsewhere
    with pytest.raises(serve.ReplicaDraining):
        serve.check_health()
    assert waiting.wait(10)  # the drain thread waits for Serve to stop the replica ...
    assert drainer.thread.is_alive() and not agent.sent  # ... and has sent no reply yet
    serve._handover.stopped.set()  # the deployment's __del__: Serve is stopping it
    drainer.thread.join(5)
    assert not drainer.thread.is_alive()
    assert exits == [] and not refused  # Serve kills the process, not the agent
    done = drained(agent)
    assert done.exit_code is None and "stopped by Ray Serve" in done.detail
    assert agent.sent and agent.sent[0]["exit_code"] is None
    assert not os.path.exists(f"{short_tmp}/restart")  # no pod restart asked


def test_a_drain_serve_does_not_carry_out_within_the_grace_ends_as_usual(drainer):
    serve.check_health()
    drainer, agent, exits = drainer()
    assert drainer.start(0.3)
    drainer.thread.join(5)
    assert exits == [75]
    done = drained(agent)
    assert done.exit_code == 75 and "did not stop this process" in done.detail


def test_without_serve_health_checks_a_drain_is_the_usual_one(drainer):
    drainer, agent, exits = drainer()
    assert drainer.start(0.3)
    drainer.thread.join(5)
    assert exits == [75] and drained(agent).exit_code == 75


def test_stopping_outside_a_replica_or_without_an_agent_does_nothing():
    serve.stopping(timeout_s=0.1)  # no agent installed: returns at once, never raises
    assert not serve._handover.stopped.is_set()


def test_the_mixin_wires_the_health_check_and_the_destructor(monkeypatch):
    called = []
    monkeypatch.setattr(serve, "stopping", lambda: called.append("stopping"))

    class Model(serve.WatchdogReplica):
        pass

    m = Model()
    m.check_health()
    assert drain.handover is serve._handover
    m.__del__()
    assert called == ["stopping"]
