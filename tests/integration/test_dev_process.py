"""`torch-watchdog sidecar --dev` run as a process: the env file a shell sources, the options
and directories refused, a second sidecar in the same directory. Its directory and files
in-process: tests/unit/test_dev.py."""
from __future__ import annotations

import os
import subprocess
import sys

from torch_watchdog.sidecar import dev


def test_a_shell_sourcing_the_env_file_gets_the_socket(tmp_path):
    root = tmp_path / "twd"
    setup = dev.prepare(str(root))
    dev.write_env(setup, f"{root}/run/events.sock")
    env = subprocess.run(["bash", "-c", f". {setup.env_path} && env"], capture_output=True,
                         text=True).stdout
    assert f"TORCH_WATCHDOG_SOCKET={root}/run/events.sock" in env.splitlines()


def test_dev_and_config_together_are_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--dev",
                           str(tmp_path), "--config", str(tmp_path / "x.yaml")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "give --dev or --config, not both" in done.stderr


def test_the_sidecar_refuses_a_directory_others_may_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # as /tmp/twd made by someone else, or left open: files could be swapped
    done = subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "sidecar", "--dev",
                           str(shared)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give --dev a directory of your own" in done.stderr


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
