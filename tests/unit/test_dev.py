"""`torch-watchdog sidecar --dev`: its directory, its config kept from run to run, the env file.
The command itself, run: tests/integration/test_dev_process.py."""
from __future__ import annotations

import os
import stat

from torch_watchdog.sidecar import config, dev


def test_the_dev_directory_is_private_and_its_config_valid_and_kept(tmp_path):
    root = tmp_path / "twd"
    setup = dev.prepare(str(root))
    assert setup.created and stat.S_IMODE(os.stat(root).st_mode) == 0o700
    cfg, problems = config.check(setup.config_path)
    assert not problems
    assert cfg.state_dir == f"{root}/state" and cfg.agent.socket_path == f"{root}/run/events.sock"
    with open(setup.config_path, "a") as f:
        f.write("poll_interval_s: 0.5\n")  # the user's edit
    again = dev.prepare(str(root))
    assert not again.created and config.check(again.config_path)[0].poll_interval_s == 0.5
    lines = dev.write_env(again, cfg.agent.socket_path)
    # what a shell sourcing it gets: tests/integration/test_dev_process.py
    assert f"export TORCH_WATCHDOG_SOCKET={root}/run/events.sock" in lines
    assert len(lines) == 3 and all(line.startswith("export TORCH_WATCHDOG_") for line in lines)


def test_a_socket_path_too_long_for_unix_is_refused_with_what_to_do():
    assert dev.socket_problem("/tmp/" + "x" * 120 + "/run/events.sock").endswith(
        "give --dev a shorter directory (e.g. --dev /tmp/twd)")
    assert dev.socket_problem("/tmp/twd/run/events.sock") is None


def test_a_directory_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # as /tmp/twd made by someone else, or left open: files could be swapped
    try:
        dev.prepare(str(shared))
    except OSError as e:
        assert "only it may write" in str(e) and "0777" in str(e)
    else:
        raise AssertionError("a world-writable --dev directory was used")


def test_each_run_has_a_sample_log_of_its_own_and_five_earlier_ones_are_kept(tmp_path):
    """A report of `--dev`'s samples.jsonl covered every run since the first (3 servers over
    7 min); now the last run's is set aside at start, named after its last write."""
    log = tmp_path / "samples.jsonl"
    assert dev.rotate_sample_log(str(log)) is None          # no earlier run
    for i in range(7):
        log.write_text(f'{{"run": {i}}}\n')
        os.utime(log, (1_800_000_000 + i, 1_800_000_000 + i))
        moved = dev.rotate_sample_log(str(log))
        assert moved is not None and not log.exists()
        assert open(moved).read() == f'{{"run": {i}}}\n'
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == dev.KEEP_LOGS and kept[-1] == "samples-20270115T080006Z.jsonl", kept
    log.write_text("")
    assert dev.rotate_sample_log(str(log)) is None and log.exists()  # empty: nothing to keep
