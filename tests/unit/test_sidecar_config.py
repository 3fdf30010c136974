"""Sidecar config: the shipped file documents the real defaults, and every problem is listed."""
from __future__ import annotations

import dataclasses
import pathlib
import typing

import pytest
import yaml

from torch_watchdog.sidecar import config as cfg
from torch_watchdog.sidecar.config import Config, ConfigError, check, from_mapping, load

SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "config" / "watchdog.yaml"


def _dotted_fields(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _dotted_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _dotted_keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        if isinstance(value, dict):
            keys |= _dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.add(prefix + key)
    return keys


def _problems(data) -> list[str]:
    with pytest.raises(ConfigError) as info:
        from_mapping(data)
    return info.value.problems


def _keys_of(problems: list[str]) -> set[str]:
    return {p.split(":", 1)[0] for p in problems}


def test_shipped_file_holds_exactly_the_defaults():
    assert load(str(SHIPPED)) == Config()
    assert check(str(SHIPPED)) == (Config(), [])


def test_every_field_is_documented_in_the_shipped_file():
    documented = _dotted_keys(yaml.safe_load(SHIPPED.read_text(encoding="utf-8")))
    fields = _dotted_fields(Config)
    assert len(fields) > 20  # the walk reached the nested sections
    assert sorted(set(fields) - documented) == []


def test_every_documented_key_has_a_comment():
    for line in SHIPPED.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.endswith(":"):
            assert "#" in line, f"no comment on {line!r}"


@pytest.mark.parametrize("text", ["", "# only comments\n", "{}\n", "server:\n"])
def test_empty_file_gives_defaults(tmp_path, text):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    assert load(str(path)) == Config()


def test_from_mapping_none_and_empty_give_defaults():
    assert from_mapping(None) == Config() and from_mapping({}) == Config()


def test_all_problems_are_listed_at_once():
    problems = _problems({
        "bogus": 1,
        "server": {"unit": "vllm.service", "pidfile": "/run/vllm.pid", "nonsense": True},
        "metrics_port": 70000,
        "poll_interval_s": "fast",
        "policy": {"cooldown_s": -5, "hold_polls": 0},
        "agent": {"socket_path": "relative/events.sock"},
    })
    assert _keys_of(problems) == {
        "bogus", "server.nonsense", "metrics_port", "poll_interval_s", "policy.cooldown_s",
        "policy.hold_polls", "agent.socket_path", "server"}
    assert len(problems) == 8  # each bad value reported once
    assert any("server.unit" in p and "server.pidfile" in p for p in problems)


@pytest.mark.parametrize("data, key", [
    ({"poll_interval_s": 0}, "poll_interval_s"),
    ({"poll_interval_s": 61}, "poll_interval_s"),
    ({"metrics_port": 0}, "metrics_port"),
    ({"metrics_port": 65536}, "metrics_port"),
    ({"metrics_address": ""}, "metrics_address"),
    ({"metrics_address": "  "}, "metrics_address"),
    ({"state_dir": "state"}, "state_dir"),
    ({"agent": {"socket_path": "events.sock"}}, "agent.socket_path"),
    ({"agent": {"socket_mode": 0o1000}}, "agent.socket_mode"),
    ({"agent": {"socket_mode": "rw-rw----"}}, "agent.socket_mode"),
    ({"agent": {"socket_mode": "0668"}}, "agent.socket_mode"),
    ({"agent": {"allowed_uids": [1000, "root"]}}, "agent.allowed_uids"),
    ({"correlate": {"min_confidence": 1.5}}, "correlate.min_confidence"),
    ({"correlate": {"min_records": 0}}, "correlate.min_records"),
    ({"correlate": {"storm_recompiles": 0}}, "correlate.storm_recompiles"),
    ({"correlate": {"fallback_new_shapes": 0}}, "correlate.fallback_new_shapes"),
    ({"forecast": {"window_s": 0}}, "forecast.window_s"),
    ({"forecast": {"headroom_bytes": float("nan")}}, "forecast.headroom_bytes"),
    ({"policy": {"hold_polls": 0}}, "policy.hold_polls"),
    ({"policy": {"max_reloads_per_hour": -1}}, "policy.max_reloads_per_hour"),
    ({"policy": {"reload_lead_s": float("inf")}}, "policy.reload_lead_s"),
    ({"policy": {"dry_run": "yes"}}, "policy.dry_run"),
    ({"policy": {"dry_run": 1}}, "policy.dry_run"),
    ({"metrics_port": 1.5}, "metrics_port"),
    ({"metrics_port": True}, "metrics_port"),
    ({"server": ["vllm.service"]}, "server"),
])
def test_bad_value_is_named_by_its_dotted_key(data, key):
    assert _keys_of(_problems(data)) == {key}


@pytest.mark.parametrize("data", [
    {"poll_interval_s": 60}, {"metrics_port": 1}, {"metrics_port": 65535},
    {"correlate": {"min_confidence": 0}}, {"correlate": {"min_confidence": 1}},
    {"policy": {"max_reloads_per_hour": 0}}, {"server": {"unit": "vllm.service"}},
    {"server": {"pidfile": "/run/vllm.pid"}}, {"agent": {"allowed_uids": [0, 1000]}},
])
def test_boundary_values_are_accepted(data):
    from_mapping(data)


def test_int_field_takes_whole_float_but_not_fraction():
    assert from_mapping({"metrics_port": 2.0}).metrics_port == 2
    assert type(from_mapping({"metrics_port": 2.0}).metrics_port) is int
    assert _keys_of(_problems({"metrics_port": 1.5})) == {"metrics_port"}


def test_float_field_takes_an_int():
    value = from_mapping({"policy": {"cooldown_s": 10}}).policy.cooldown_s
    assert value == 10.0 and type(value) is float


@pytest.mark.parametrize("raw", ["0660", "0o660", "660", " 0O660 ", 0o660, 432])
def test_socket_mode_given_as_octal_text_or_int(raw):
    assert from_mapping({"agent": {"socket_mode": raw}}).agent.socket_mode == 0o660


def test_socket_mode_written_unquoted_in_yaml_is_octal(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("agent:\n  socket_mode: 0640\n")
    assert load(str(path)).agent.socket_mode == 0o640
    path.write_text("agent:\n  socket_mode: 0o640\n")  # PyYAML reads this as text
    assert load(str(path)).agent.socket_mode == 0o640


def test_quoted_yes_in_yaml_is_not_a_bool(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text('policy:\n  dry_run: "yes"\n')
    config, problems = check(str(path))
    assert config is None and _keys_of(problems) == {"policy.dry_run"}


@pytest.mark.parametrize("text", [
    "poll_interval_s: [unclosed\n",       # invalid YAML
    "- poll_interval_s\n- 1\n",            # a list, not a mapping
    "just some text\n",                    # a scalar
    "metrics_port: 0\nbogus: 1\n",         # valid YAML, bad values
])
def test_check_reports_a_bad_file_without_raising(tmp_path, text):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    config, problems = check(str(path))
    assert config is None and problems and all(isinstance(p, str) for p in problems)


def test_check_reports_a_missing_file(tmp_path):
    path = tmp_path / "missing.yaml"
    config, problems = check(str(path))
    assert config is None and len(problems) == 1 and str(path) in problems[0]


def test_check_reports_a_binary_file(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    config, problems = check(str(path))
    assert config is None and len(problems) == 1


def test_check_reports_invalid_yaml_with_the_path(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("a: [unclosed\n")
    config, problems = check(str(path))
    assert config is None and len(problems) == 1 and "not valid YAML" in problems[0]


def test_check_reports_a_list_as_not_a_mapping(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("- 1\n- 2\n")
    assert check(str(path)) == (None, ["config: expected a mapping, got list"])


def test_semantic_checks_see_only_well_typed_values():
    # a value that fails its type check is not also reported by a range check
    assert _problems({"metrics_port": "http"}) == ["metrics_port: expected an integer, got 'http'"]
    assert cfg.semantic_problems(Config()) == []
