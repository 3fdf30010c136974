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
    assert check(str(SHIPPED), host=False) == (Config(), [])


def test_every_field_is_documented_in_the_shipped_file():
    documented = _dotted_keys(yaml.safe_load(SHIPPED.read_text(encoding="utf-8")))
    fields = _dotted_fields(Config)
    assert len(fields) > 20  # the walk reached the nested sections
    # a deprecated key is accepted, not shipped
    deprecated = {f"{section}.{key}" for section, key in cfg.loading.DEPRECATED}
    assert sorted(set(fields) - documented - deprecated) == []


def test_every_documented_key_has_a_comment():
    for line in SHIPPED.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.endswith(":"):
            assert "#" in line, f"no comment on {line!r}"


@pytest.mark.parametrize("text", ["{}\n", "server:\n", "# a note\n{}\n"])
def test_an_empty_mapping_gives_defaults(tmp_path, text):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    assert load(str(path)) == Config()


@pytest.mark.parametrize("text", ["", "\n\n", "# only comments\n"])
def test_an_empty_file_is_an_error_so_sighup_keeps_the_old_config(tmp_path, text):
    """A file caught half-written by an editor must not silently become every default."""
    path = tmp_path / "w.yaml"
    path.write_text(text)
    config, problems = check(str(path))
    assert config is None and len(problems) == 1 and "empty config" in problems[0]
    assert "{}" in problems[0]  # says how to ask for the defaults


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
    ({"poll_interval_s": 0.049}, "poll_interval_s"),
    ({"sample_log_max_bytes": 1000}, "sample_log_max_bytes"),
    ({"alerts": {"resend_s": 0.5}}, "alerts.resend_s"),
    ({"alerts": {"timeout_s": 0}}, "alerts.timeout_s"),
    ({"reload": {"timeout_s": 0}}, "reload.timeout_s"),
    ({"poll_interval_s": True}, "poll_interval_s"),
    ({"correlate": {"min_confidence": False}}, "correlate.min_confidence"),
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
    {"poll_interval_s": 60}, {"poll_interval_s": 0.05}, {"metrics_port": 1},
    {"metrics_port": 65535}, {"sample_log_max_bytes": 1 << 20}, {"alerts": {"resend_s": 1}},
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
    assert check(str(path)) == (None, ["no such file"])  # the caller names the file


def test_check_reports_a_directory(tmp_path):
    assert check(str(tmp_path)) == (None, ["is a directory, not a config file"])


def test_check_reports_a_binary_file(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    config, problems = check(str(path))
    assert config is None and len(problems) == 1


def test_check_reports_invalid_yaml_with_its_line_once(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("poll_interval_s: 0.1\na: [unclosed\n")
    config, problems = check(str(path))
    assert config is None and len(problems) == 1
    assert problems[0].startswith("not valid YAML at line 3, column 1: ")
    assert str(path) not in problems[0]  # check-config prefixes it: once, not twice


def test_an_unknown_key_is_answered_with_the_nearest_known_one(tmp_path, capsys):
    from torch_watchdog import cli

    path = tmp_path / "w.yaml"
    path.write_text("poll_intervall_s: 0.1\npolicy: {reload_lead: 5, zzz: 1}\n")
    assert cli.main(["check-config", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"torch-watchdog check-config: {path}: poll_intervall_s: unknown key "
        "(did you mean poll_interval_s?)",
        f"torch-watchdog check-config: {path}: policy.reload_lead: unknown key "
        "(did you mean policy.reload_lead_s?)",
        f"torch-watchdog check-config: {path}: policy.zzz: unknown key"]


def test_check_config_names_the_file_once(tmp_path, capsys):
    from torch_watchdog import cli

    path = tmp_path / "w.yaml"
    path.write_text("a: [unclosed\n")
    assert cli.main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err.count(str(path)) == 1


@pytest.mark.parametrize("text, kind", [("- 1\n- 2\n", "list"), ("hello\n", "line of text"),
                                        ("42\n", "int")])
def test_check_reports_a_file_that_is_not_a_mapping(tmp_path, text, kind):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    assert check(str(path)) == (None, [f"not a watchdog config: a YAML {kind}, not a mapping "
                                       "of keys (key: value)"])


def test_a_file_over_1_mib_is_refused_unread(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("# padding\n" * (cfg.MAX_FILE_BYTES // 10 + 1))
    config, problems = check(str(path))
    assert config is None and problems == [
        "larger than 1 MiB: not a watchdog config (the documented one is 7 KB)"]


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * 10) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]"
              for i in range(1, levels + 1)]
    return "\n".join(lines) + "\nmetrics_address: *a9\n"  # 10^10 strings, if expanded


@pytest.mark.parametrize("text", [_alias_bomb(), "a: &x [1, *x]\n"], ids=["bomb", "recursive"])
def test_an_alias_bomb_is_refused_quickly(tmp_path, text):
    import time

    path = tmp_path / "w.yaml"
    path.write_text(text)
    started = time.monotonic()
    config, problems = check(str(path))
    assert time.monotonic() - started < 2.0  # expanded, it would never finish
    assert config is None and len(problems) == 1 and "alias" in problems[0]


def test_a_few_aliases_are_fine(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("reload:\n  timeout_s: &t 45.0\n  grace_s: *t\n"
                    "alerts:\n  timeout_s: *t\n")
    config, problems = check(str(path), host=False)
    assert problems == [] and config.reload.grace_s == config.alerts.timeout_s == 45.0


def test_deep_nesting_is_refused_not_a_crash(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
    config, problems = check(str(path))
    assert config is None and len(problems) == 1


# --- where the sidecar writes: state_dir and the sample log's directory -----------------------

def _write(tmp_path, text: str) -> str:
    path = tmp_path / "w.yaml"
    path.write_text(text)
    return str(path)


def test_a_state_dir_that_exists_or_can_be_made_is_fine(tmp_path):
    for state in (tmp_path, tmp_path / "new" / "state"):
        config, problems = check(_write(tmp_path, f"state_dir: {state}\n"))
        assert problems == [] and config.state_dir == str(state)
    assert not (tmp_path / "new").exists()  # checked, not created


@pytest.mark.parametrize("make, says", [
    (lambda tmp: tmp / "f", "exists and is not a directory"),
    (lambda tmp: tmp / "f" / "state", "cannot be created: {tmp}/f is a file"),
    (lambda tmp: "/proc/torch-watchdog", "under /proc"),
    (lambda tmp: "/sys/fs/torch-watchdog", "under /sys"),
])
def test_a_state_dir_that_cannot_be_a_directory_is_a_problem(tmp_path, make, says):
    (tmp_path / "f").write_text("a file")
    config, problems = check(_write(tmp_path, f"state_dir: {make(tmp_path)}\n"))
    assert config is None and len(problems) == 1
    assert problems[0].startswith("state_dir: ") and says.format(tmp=tmp_path) in problems[0]


@pytest.mark.parametrize("make, says", [
    (lambda tmp: tmp / "nodir" / "s.jsonl", "does not exist"),
    (lambda tmp: tmp, "is a directory, not a file"),
    (lambda tmp: tmp / "f" / "s.jsonl", "does not exist"),
    (lambda tmp: "/proc/s.jsonl", "under /proc"),
])
def test_a_sample_log_that_cannot_be_written_is_a_problem(tmp_path, make, says):
    (tmp_path / "f").write_text("a file")
    config, problems = check(_write(tmp_path, f"state_dir: {tmp_path}\n"
                                              f"sample_log: {make(tmp_path)}\n"))
    assert config is None and len(problems) == 1
    assert problems[0].startswith("sample_log: ") and says in problems[0]


def test_host_problems_are_listed_with_the_others_and_skipped_on_request(tmp_path):
    path = _write(tmp_path, "poll_interval_s: 0.001\nstate_dir: /proc/x\n")
    config, problems = check(path)
    assert _keys_of(problems) == {"poll_interval_s", "state_dir"}
    # a bad value is reported once: its default is not checked in its place
    assert _keys_of(check(_write(tmp_path, "state_dir: 3\n"))[1]) == {"state_dir"}
    # status/replay/report read the values only: another user's directories are not theirs
    ok = _write(tmp_path, "state_dir: /proc/x\n")
    assert check(ok, host=False) == (from_mapping({"state_dir": "/proc/x"}), [])


def test_the_sidecar_refuses_to_start_where_it_cannot_write(tmp_path, capsys):
    from torch_watchdog import cli

    path = _write(tmp_path, f"state_dir: {tmp_path}/f/state\n")
    (tmp_path / "f").write_text("a file")
    assert cli.main(["sidecar", "--config", path]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_semantic_checks_see_only_well_typed_values():
    # a value that fails its type check is not also reported by a range check
    assert _problems({"metrics_port": "http"}) == ["metrics_port: expected an integer, got 'http'"]
    assert cfg.semantic_problems(Config()) == []


def test_servers_list_is_checked_entry_by_entry(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("servers:\n  - {unit: llm@0.service}\n  - {name: b, pidfile: /run/b.pid}\n"
                    "  - {pidfile: rel.pid}\n  - {unit: x.service, pidfile: /run/x.pid}\n"
                    "  - {name: b, unit: y.service}\n  - 7\n")
    cfg_, problems = cfg.check(str(path))
    assert cfg_ is None
    text = "\n".join(problems)
    assert "servers[2]: a server found by its pidfile needs a name" in text
    assert "servers[2].pidfile: must be an absolute path" in text
    assert "servers[3]: set one of unit and pidfile, not both" in text
    assert "servers: names must differ" in text
    assert "servers[5]: expected a mapping" in text
    good = tmp_path / "g.yaml"
    good.write_text("servers:\n  - {unit: llm@0.service}\n  - {name: b, pidfile: /run/b.pid}\n")
    loaded = cfg.load(str(good))
    assert [n for n, _, _ in cfg.server_sources(loaded)] == ["llm@0.service", "b"]


SIGNAL_GUARD = ("any local process able to write to the socket could get processes killed: "
                "set server.unit, server.pidfile, servers or agent.allowed_uids")


def test_signal_reloads_with_pids_from_anyone_on_the_socket_are_refused(tmp_path):
    # the pids come from the agents' hellos only, and any local uid may send one
    problems = _problems({"reload": {"method": "signal"}})
    assert len(problems) == 1 and problems[0].startswith("reload.method: ")
    assert SIGNAL_GUARD in problems[0]
    path = tmp_path / "w.yaml"
    path.write_text("reload: {method: signal}\n")  # check-config says the same
    config, problems = check(str(path), host=False)
    assert config is None and any(SIGNAL_GUARD in p for p in problems)


@pytest.mark.parametrize("narrowed", [
    {"server": {"unit": "vllm.service"}}, {"server": {"pidfile": "/run/vllm.pid"}},
    {"agent": {"allowed_uids": [1000]}}, {"agent": {"allowed_uids": []}},
])
def test_signal_reloads_are_fine_once_the_pids_or_senders_are_narrowed(narrowed):
    assert from_mapping({"reload": {"method": "signal"}, **narrowed}).reload.method == "signal"


def test_headroom_bytes_still_loads_but_is_deprecated(caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        cfg = from_mapping({"forecast": {"headroom_bytes": 64 << 20}})
    assert cfg.forecast.headroom_bytes == 64 << 20
    assert "forecast.headroom_bytes: deprecated" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        from_mapping({"forecast": {"window_s": 30.0}})
    assert "deprecated" not in caplog.text
