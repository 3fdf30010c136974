import gzip
import os

import pytest

from tests.unit.test_events import SAMPLES
from torch_watchdog import events
from torch_watchdog import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_events_check_counts_kinds_and_flags_bad_lines(tmp_path, capsys):
    good = tmp_path / "events.jsonl.gz"
    with gzip.open(good, "wt") as fh:
        for e in SAMPLES:
            fh.write(events.encode(e).decode() + "\n")
    assert cli.main(["events", str(good)]) == 0
    assert f"{len(SAMPLES)} valid events, 0 invalid lines" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(events.encode(SAMPLES[1]).decode() + "\n{\"v\": 9}\n")
    assert cli.main(["events", str(bad)]) == 2
    captured = capsys.readouterr()
    assert "bad.jsonl:2: unsupported schema version 9" in captured.err
    assert cli.main(["events", str(tmp_path / "missing.jsonl")]) == 2


def test_events_lists_the_first_bad_lines_of_a_file_then_a_count(tmp_path, capsys):
    path = tmp_path / "mixed.jsonl"
    path.write_text(events.encode(SAMPLES[1]).decode() + "\n" + "oops\n" * 50)
    assert cli.main(["events", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == cli.MAX_LINE_PROBLEMS + 1
    assert err[0].startswith(f"{path}:2: not JSON") and "and 30 more invalid line(s)" in err[-1]
    assert "1 valid events, 50 invalid lines" in captured.out


@pytest.mark.parametrize("url", ["notaurl", "127.0.0.1:9464", "http://", "ftp://host:1",
                                 "http://host:port"])
def test_status_with_an_invalid_url_says_so(capsys, url):
    assert cli.main(["status", "--url", url]) == 2
    err = capsys.readouterr().err
    assert "is not a URL" in err and "no sidecar" not in err and repr(url) in err


def test_status_with_a_valid_url_and_nothing_there_says_no_sidecar(capsys):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # a port nobody listens on (bound, not listening: refused)
    port = s.getsockname()[1]
    try:
        assert cli.main(["status", "--url", f"http://127.0.0.1:{port}"]) == 1
    finally:
        s.close()
    assert "no sidecar is running" in capsys.readouterr().err


def test_status_in_a_dev_directory_asks_the_port_its_config_says(tmp_path, monkeypatch, capsys):
    """In the `--dev` directory plain `status` (the README's) ignored the edited metrics_port
    and asked the default one."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # a port nobody listens on: the address asked is in the message
    port = s.getsockname()[1]
    (tmp_path / ".torch-watchdog").mkdir()
    (tmp_path / ".torch-watchdog" / "watchdog.yaml").write_text(f"metrics_port: {port}\n")
    monkeypatch.chdir(tmp_path)
    try:
        assert cli.main(["status"]) == 1
    finally:
        s.close()
    assert f"no sidecar is running at http://127.0.0.1:{port}" in capsys.readouterr().err


def test_events_reads_the_sidecars_sample_log_skipping_its_own_lines(capsys):
    path = os.path.join(ROOT, "tests", "fixtures", "h200-seed-oom-samples.jsonl.gz")
    assert cli.main(["events", path]) == 0
    out = capsys.readouterr().out
    assert "3625 valid events, 0 invalid lines (1192 sidecar sample/config lines skipped)" in out


def test_demo_takes_the_port_it_is_given_and_refuses_one_that_is_none(tmp_path, capsys):
    from torch_watchdog.demo.driver import Demo
    from torch_watchdog.demo.profile import SHORT

    assert Demo(SHORT, str(tmp_path), "cpu", False, port=18123).port == 18123
    assert Demo(SHORT, str(tmp_path), "cpu", False).port > 0  # a free one
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--port", "70000"])
    assert exit_.value.code == 2
    assert "--port: must be a TCP port 1..65535, got 70000" in capsys.readouterr().err


def _every_parser():
    import argparse

    from torch_watchdog import cli, launcher
    top = cli.build_parser()
    yield "torch-watchdog", top
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"torch-watchdog {name}", sub
    yield "torch-watchdog run (launcher)", launcher.build_parser()


def test_every_subcommand_and_option_says_what_it_is_for():
    """`--help` had options with no text (listen --socket, events FILES, run --restart,
    --drain-exit-code) and a top-level description reading "command-line entry point"."""
    missing = []
    for prog, parser in _every_parser():
        if not parser.description or "entry point" in parser.description:
            missing.append(f"{prog}: description")
        for action in parser._actions:
            if action.dest != "help" and not action.help:
                missing.append(f"{prog}: {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing
