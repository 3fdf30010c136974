"""A budget per server (issue 54, item 1): `servers[].budget_bytes`, for a configured server
or one its agents announce by name; the host's `forecast.process_budget_bytes` elsewhere."""
from __future__ import annotations

import dataclasses
import re

import pytest

from tests.unit.test_lifecycle import BUDGET, flat_host
from tests.unit.test_step import GB, A, B, MB, hello, sample
from torch_watchdog.sidecar.config import (ConfigError, ServerEntry, from_mapping,
                                          semantic_problems, server_budgets, server_sources)
from torch_watchdog.sidecar.core.host import Host
from torch_watchdog.sidecar.core.step import forecast_config, step


def with_budgets(**budgets: int):
    return dataclasses.replace(BUDGET, servers=[ServerEntry(name=n, budget_bytes=b)
                                                for n, b in budgets.items()])


def test_a_server_with_its_own_budget_is_forecast_against_it_and_the_other_is_not():
    """Two flat 262 MiB servers under a 400 MiB host budget: to make one act, every server had
    to get the same budget. With llm-b's own 200 MiB, llm-b alone is over its budget."""
    cfg = with_budgets(**{"llm-b": 200 * MB})
    host = Host()
    for pid, name, gpu in ((101, "llm-a", A), (202, "llm-b", B)):
        step(host, hello(1000.0, pid, name, [gpu]), cfg)
    actions = flat_host(host, 1000.25, 200, cfg)
    acted = {a.server for a in actions if a.kind in ("alert", "reload")}
    assert acted == {"llm-b"}
    budgets = {n: host.servers[n].forecast.budget_bytes for n in host.servers}
    assert budgets == {"llm-a": 400 * MB, "llm-b": 200 * MB}
    assert host.servers["llm-b"].forecast.seconds == 0.0
    poll = step(host, sample(1100.0, {A: (GB, 10 * GB), B: (GB, 10 * GB)},
                             {101: {A: 262 * MB}, 202: {B: 262 * MB}}), cfg).poll
    assert {n: v["forecast"]["budget_bytes"] for n, v in poll.views.items()} == budgets


def test_the_host_budget_is_the_forecast_s_own_where_no_entry_names_the_server():
    cfg = with_budgets(**{"llm-b": 200 * MB})
    assert forecast_config(cfg, "llm-a") is cfg.forecast
    assert forecast_config(cfg, "llm-b").process_budget_bytes == 200 * MB
    assert forecast_config(cfg, "llm-b").window_s == cfg.forecast.window_s


def test_config_entries_for_announced_servers_need_a_name_and_a_budget():
    ok = from_mapping({"servers": [{"name": "llm", "budget_bytes": 2 << 30},
                                   {"unit": "chat.service", "budget_bytes": 1 << 30}]})
    assert semantic_problems(ok) == [] and server_budgets(ok) == {"llm": 2 << 30,
                                                                  "chat.service": 1 << 30}
    assert server_sources(ok) == [("chat.service", "chat.service", None)]  # llm: announced
    for bad, says in (({"name": "llm"}, "or name and budget_bytes"),
                      ({"budget_bytes": 5}, "or name and budget_bytes"),
                      ({"name": "llm", "budget_bytes": 0}, "budget_bytes: must be > 0"),
                      ({"unit": "a.service", "pidfile": "/run/a.pid"}, "not both"),
                      ([{"name": "llm", "budget_bytes": 5}, {"unit": "x.service", "name": "llm"}],
                       "names must differ")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            from_mapping({"servers": bad if isinstance(bad, list) else [bad]})
