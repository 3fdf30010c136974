"""`torch-watchdog unfreeze SERVER`: a request file in the state directory, taken (and removed)
by the sidecar's next poll; a bad file is said once and removed, never taken."""
import json
import os

from torch_watchdog import cli
from torch_watchdog.sidecar.actions.requests import requests_dir, take_requests, write_request
from torch_watchdog.sidecar.core.observations import OperatorRequest


def test_a_request_written_by_the_cli_is_taken_once(tmp_path, capsys):
    cfg = tmp_path / "w.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\n")
    assert cli.main(["unfreeze", "lm-server", "--config", str(cfg)]) == 0
    assert "asked the sidecar to unfreeze lm-server" in capsys.readouterr().out
    got, bad = take_requests(str(tmp_path / "state"), 5.0)
    assert got == [OperatorRequest(5.0, "lm-server", "unfreeze")] and bad == []
    assert take_requests(str(tmp_path / "state"), 6.0) == ([], [])   # removed once taken
    assert os.stat(requests_dir(str(tmp_path / "state"))).st_mode & 0o077 == 0


def test_bad_request_files_are_said_once_and_removed(tmp_path):
    where = tmp_path / "requests"
    where.mkdir()
    (where / "a").write_text("not json")
    (where / "b").write_text(json.dumps({"server": "x", "request": "reload_everything"}))
    (where / "c").write_text("x" * 5000)
    (where / ".partial").write_text("{}")       # a write in progress: left alone
    write_request(str(tmp_path), "ok", "unfreeze")
    got, bad = take_requests(str(tmp_path), 1.0)
    assert [r.server for r in got] == ["ok"]
    assert [b.split(": ", 1)[1] for b in bad] == [
        "not JSON", "not a request (a server's name and one of unfreeze)", "over 4096 bytes"]
    assert sorted(os.listdir(where)) == [".partial"]
    assert take_requests(str(tmp_path / "none"), 1.0) == ([], [])   # no directory: nothing


def test_the_cli_says_why_it_cannot_write_the_request(tmp_path, capsys):
    cfg = tmp_path / "w.yaml"
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg.write_text(f"state_dir: {blocker}\n")     # a file where the directory should be
    assert cli.main(["unfreeze", "lm", "--config", str(cfg)]) == 1
    assert "cannot write the request in" in capsys.readouterr().err
    cfg.write_text("state_dir: relative\n")
    assert cli.main(["unfreeze", "lm", "--config", str(cfg)]) == 2


def test_a_link_or_a_fifo_in_the_requests_directory_is_refused_without_waiting(tmp_path):
    where = tmp_path / "requests"
    where.mkdir()
    target = tmp_path / "secret"
    target.write_text(json.dumps({"server": "x", "request": "unfreeze"}))
    os.symlink(target, where / "link")
    os.mkfifo(where / "fifo")
    got, bad = take_requests(str(tmp_path), 1.0)
    assert got == [] and len(bad) == 2 and "not a regular file" in " ".join(bad)
