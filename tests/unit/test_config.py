import pytest

from torch_watchdog.agent.config import DEFAULT_SOCKET, AgentConfig, resolve


def test_defaults_without_env():
    config, problems = resolve({}, environ={})
    assert config == AgentConfig() and problems == []
    assert config.socket_path == DEFAULT_SOCKET and config.graph_budget == 0


def test_env_is_read_and_args_win():
    env = {"TORCH_WATCHDOG_SOCKET": "/tmp/a.sock", "TORCH_WATCHDOG_STALL_S": "0.2",
           "TORCH_WATCHDOG_GRAPH_BUDGET": "64", "TORCH_WATCHDOG_DEBUG": "yes",
           "TORCH_WATCHDOG_EVENT_LOG": "/tmp/ev.jsonl"}
    config, problems = resolve({"stall_threshold_s": 0.5}, environ=env)
    assert problems == []
    assert config.socket_path == "/tmp/a.sock" and config.event_log == "/tmp/ev.jsonl"
    assert config.stall_threshold_s == 0.5 and config.graph_budget == 64 and config.debug


def test_empty_socket_disables_it():
    config, _ = resolve({}, environ={"TORCH_WATCHDOG_SOCKET": ""})
    assert config.socket_path is None


@pytest.mark.parametrize("var, value", [
    ("TORCH_WATCHDOG_STALL_S", "fast"), ("TORCH_WATCHDOG_STALL_S", "-1"),
    ("TORCH_WATCHDOG_ENABLED", "maybe"), ("TORCH_WATCHDOG_QUEUE_SIZE", "0"),
    ("TORCH_WATCHDOG_GRAPH_BUDGET_MODE", "magic"), ("TORCH_WATCHDOG_MAX_SHAPES", "nan"),
])
def test_bad_env_value_is_reported_and_defaulted(var, value):
    config, problems = resolve({}, environ={var: value})
    assert config == AgentConfig()
    assert len(problems) == 1 and var in problems[0] and "default" in problems[0]


@pytest.mark.parametrize("args", [{"stall_threshold_s": "x"}, {"queue_size": -3},
                                  {"graph_budget_mode": "fast"}, {"no_such": 1},
                                  {"heartbeat_s": True}])
def test_bad_argument_raises(args):
    with pytest.raises(ValueError):
        resolve(args, environ={})


def test_server_name_from_env_and_argument():
    config, problems = resolve({}, environ={"TORCH_WATCHDOG_SERVER": "llm-a"})
    assert config.server == "llm-a" and problems == []
    config, _ = resolve({"server": "llm-b"}, environ={"TORCH_WATCHDOG_SERVER": "llm-a"})
    assert config.server == "llm-b"
    config, _ = resolve({}, environ={"TORCH_WATCHDOG_SERVER": ""})
    assert config.server is None  # empty: found automatically (systemd unit, process group)


@pytest.mark.parametrize("value", ["two\nlines", "x" * 300, "  "])
def test_bad_server_name_in_env_is_reported_and_found_automatically(value):
    config, problems = resolve({}, environ={"TORCH_WATCHDOG_SERVER": value})
    assert config.server is None
    assert len(problems) == 1 and "TORCH_WATCHDOG_SERVER" in problems[0]


def test_bad_server_argument_raises():
    with pytest.raises(ValueError, match="server"):
        resolve({"server": "a\tb"}, environ={})
