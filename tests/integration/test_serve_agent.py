"""The agent in a process that Ray Serve runs as a replica (a stand-in `ray.serve` module; the
real engine: test_ray_serve.py): its hellos name the replica's slot, and follow it when Serve
gives the rank late (an agent installed at import) or renumbers the replica (a replacement
started while the replica it replaces was still stopping takes a spare rank first)."""
from __future__ import annotations

import os
import sys
import types

import pytest

import torch_watchdog.agent as agent_mod
from tests.unit.test_serve import FakeServe, context


@pytest.fixture
def replica(monkeypatch):
    fake = FakeServe()
    monkeypatch.setitem(sys.modules, "ray.serve", fake)
    yield fake
    agent_mod.uninstall()


def names(collector) -> list[str]:
    return [h.server for h in collector.of("hello") if h.pid == os.getpid()]


def test_a_replica_says_hello_under_its_slot_and_again_when_serve_renumbers_it(
        collector, replica):
    replica.ctx = context(rank=2)  # a spare rank: the replica it replaces is still stopping
    agent = agent_mod.install(socket_path=collector.path, tick_s=0.02, event_log=None)
    assert agent is not None and agent.server == "serve:llm/Model/2"
    assert collector.wait(lambda c: "serve:llm/Model/2" in names(c), 5)
    replica.ctx.rank = types.SimpleNamespace(rank=1)  # Serve's reconfigure, once it stopped
    assert collector.wait(lambda c: names(c)[-1:] == ["serve:llm/Model/1"], 5), names(collector)
    assert agent.server == "serve:llm/Model/1"


def test_an_agent_installed_before_serve_gave_the_rank_takes_the_name_once_it_has_it(
        collector, replica):
    replica.ctx = context(rank=None)  # the actor is built; Serve's initialize() comes next
    agent = agent_mod.install(socket_path=collector.path, tick_s=0.02, event_log=None)
    assert agent is not None and not agent.server.startswith("serve:")
    replica.ctx.rank = types.SimpleNamespace(rank=0)
    assert collector.wait(lambda c: names(c)[-1:] == ["serve:llm/Model/0"], 5), names(collector)


def test_an_explicit_name_is_kept_in_a_replica(collector, replica):
    replica.ctx = context(rank=1)
    agent = agent_mod.install(socket_path=collector.path, tick_s=0.02, event_log=None,
                              heartbeat_s=0.1, server="llm-a")
    assert agent is not None
    assert collector.wait(lambda c: len(c.of("heartbeat")) >= 2, 5)
    assert set(names(collector)) == {"llm-a"}
