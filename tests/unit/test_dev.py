"""`torch-watchdog sidecar --dev`: its directory, its config kept from run to run, the env file."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

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
    env = subprocess.run(["bash", "-c", f". {again.env_path} && env"], capture_output=True,
                         text=True).stdout
    assert f"TORCH_WATCHDOG_SOCKET={root}/run/events.sock" in env.splitlines()
    assert len(lines) == 3 and all(line.startswith("export TORCH_WATCHDOG_") for line in lines)


def test_a_socket_path_too_long_for_unix_is_refused_with_what_to_do():
    assert dev.socket_problem("/tmp/" + "x" * 120 + "/run/events.sock").endswith(
        "give --dev a shorter directory (e.g. --dev /tmp/twd)")
    assert dev.socket_problem("/tmp/twd/run/events.sock") is None


def test_dev_and_config_together_are_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--dev",
                           str(tmp_path), "--config", str(tmp_path / "x.yaml")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "give --dev or --config, not both" in done.stderr


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
    done = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--dev",
                           str(shared)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give --dev a directory of your own" in done.stderr


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


def _files(root):
    """Every file under `root`: path -> (inode, size)."""
    out = {}
    for here, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(here, name))
            out[os.path.relpath(os.path.join(here, name), root)] = (st.st_ino, st.st_size)
    return out


def test_a_second_sidecar_in_the_same_directory_is_refused_and_changes_nothing(tmp_path):
    """A second `--dev` in the directory of a running one exited 1 having renamed the first's
    samples.jsonl (the README's `report DIR/samples.jsonl` then found none): now it is refused
    before any file is touched, saying whose the directory is, and the first runs on."""
    import time

    from tests.conftest import free_port
    root = tmp_path / "twd"
    setup = dev.prepare(str(root))
    with open(setup.config_path, "a") as f:
        f.write(f"metrics_port: {free_port()}\npoll_interval_s: 0.5\n")
    command = [sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--dev", str(root)]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = root / "samples.jsonl"
    try:
        deadline = time.monotonic() + 30
        settled = [root / "env", root / "state" / "servers.json", log]  # its first poll's
        while not (all(p.exists() for p in settled) and log.stat().st_size > 0):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        before = _files(root)
        second = subprocess.run(command, capture_output=True, text=True, timeout=60)
        after = _files(root)
        assert second.returncode == 1, second.stderr
        assert after.keys() == before.keys(), (before, after)  # nothing renamed or new
        for path, (inode, size) in before.items():
            assert after[path][0] == inode and after[path][1] >= size, (path, before, after)
        assert f"another sidecar (pid {first.pid}) is running with this state_dir" \
            in second.stderr and str(root / "state" / "sidecar.lock") in second.stderr
        assert "Start the server" not in second.stdout  # no banner: nothing started
        time.sleep(1.5)  # the first one polls on, into the same file
        assert first.poll() is None and log.stat().st_ino == before["samples.jsonl"][0]
        assert log.stat().st_size > after["samples.jsonl"][1]
    finally:
        first.terminate()
        assert first.wait(30) == 0
