"""`torch-watchdog sidecar --dev [DIR]`: the sidecar in a directory you own, no root.

The shipped config keeps its files under /run/torch-watchdog and /var/lib/torch-watchdog (root
or the systemd units); a first try on a laptop or a dev box should not need either. `--dev`
makes DIR (default `./.torch-watchdog`, mode 0700), writes `DIR/watchdog.yaml` there the first
time (state, socket and sample log inside DIR; kept afterwards, so edits stay) and
`DIR/env` every time: the exact environment the server needs, as `export` lines to source in
the server's shell. Each run has a sample log of its own: the last run's is renamed
`samples-<its last write, UTC>.jsonl` at start (the newest KEEP_LOGS kept), so
`torch-watchdog report DIR/samples.jsonl` covers this run's servers only (renamed once this
run holds the state_dir's lock, sidecar/lock.py: a second run beside a live one renames
nothing). The socket's directory is the user's own and no one else's, so the drain channel
trusts it (agent/drain.py `dir_owner`) without `control_uid`.
"""
from __future__ import annotations

import glob
import os
import shlex
import stat
import time
from dataclasses import dataclass
from typing import Optional

DEFAULT_DIR = ".torch-watchdog"
MAX_SOCKET_PATH = 107          # a Unix socket path has at most 107 bytes (sun_path, Linux)
CONFIG_NAME = "watchdog.yaml"
ENV_NAME = "env"
KEEP_LOGS = 5                  # earlier runs' sample logs kept beside this run's


@dataclass(frozen=True)
class DevSetup:
    root: str            # DIR, absolute
    config_path: str     # DIR/watchdog.yaml
    env_path: str        # DIR/env
    created: bool        # the config was written now (not found from an earlier run)


def config_text(root: str) -> str:
    return (f"# written by `torch-watchdog sidecar --dev`, kept from run to run: edit it freely\n"
            f"# (config/watchdog.yaml in the checkout documents every key)\n"
            f"state_dir: {root}/state\n"
            f"sample_log: {root}/samples.jsonl    # for `torch-watchdog report` and `replay`\n"
            f"agent:\n"
            f"  socket_path: {root}/run/events.sock\n")


def env_lines(root: str, socket_path: str) -> list[str]:
    """What the server's processes need, for a sidecar whose socket is `socket_path`."""
    return [f"export TORCH_WATCHDOG_SOCKET={shlex.quote(socket_path)}",
            f"export TORCH_WATCHDOG_RESTART_FILE={shlex.quote(root + '/run/restart-requested')}",
            f"export TORCH_WATCHDOG_WARM_DIR={shlex.quote(root + '/warm')}"]


def prepare(directory: Optional[str]) -> DevSetup:
    """Make DIR and its config (first time only). OSError when DIR cannot be made, or is not
    this user's alone (another user could then swap its files: the config, the socket)."""
    root = os.path.abspath(directory or DEFAULT_DIR)
    for sub in ("", "/state", "/run", "/warm"):
        os.makedirs(root + sub, mode=0o700, exist_ok=True)
        st = os.lstat(root + sub)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise OSError(f"{root + sub} is not a directory of this user's that only it may "
                          f"write (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): "
                          "give --dev a directory of your own")
    config_path = os.path.join(root, CONFIG_NAME)
    created = not os.path.exists(config_path)
    if created:
        with open(config_path, "x", encoding="utf-8") as f:
            f.write(config_text(root))
    return DevSetup(root, config_path, os.path.join(root, ENV_NAME), created)


def socket_problem(socket_path: str) -> Optional[str]:
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
        return (f"agent.socket_path {socket_path} is {len(os.fsencode(socket_path))} bytes, "
                f"over a Unix socket's {MAX_SOCKET_PATH}: give --dev a shorter directory "
                f"(e.g. --dev /tmp/twd)")
    return None


def rotate_sample_log(path: Optional[str]) -> Optional[str]:
    """Before the daemon opens it: an earlier run's sample log at `path` renamed
    `<stem>-<its last write, UTC>.jsonl` (the oldest beyond KEEP_LOGS removed); where it went,
    or None (no earlier log, or it could not be moved: then appended to, as without --dev)."""
    if not path or not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    stem, ext = os.path.splitext(path)
    when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(os.path.getmtime(path)))
    moved = f"{stem}-{when}{ext}"
    try:
        os.replace(path, moved)
        for old in sorted(glob.glob(glob.escape(stem) + "-*" + ext))[:-KEEP_LOGS]:
            os.unlink(old)
    except OSError:
        return None
    return moved


def write_env(setup: DevSetup, socket_path: str) -> list[str]:
    lines = env_lines(setup.root, socket_path)
    tmp = setup.env_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("# the server's environment for this sidecar: `. " + setup.env_path + "`\n")
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, setup.env_path)
    return lines


def banner(setup: DevSetup, lines: list[str], metrics_url: str,
           previous_log: Optional[str] = None) -> str:
    """What `--dev` prints before the daemon's log: where things are, how to connect a server."""
    said = "written" if setup.created else "kept from an earlier run"
    return "\n".join([
        f"torch-watchdog sidecar: dev mode, files in {setup.root}",
        f"  config: {setup.config_path} ({said})",
        *([f"  the last run's sample log: {previous_log}"] if previous_log else []),
        f"  status page and /metrics: {metrics_url}",
        f"Start the server with this environment (saved in {setup.env_path}):",
        *(f"  {line}" for line in lines),
        f"e.g.  . {shlex.quote(setup.env_path)} && uvicorn app:app --workers 2",
        "",
    ])
