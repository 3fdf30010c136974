"""The suite's container (machine.py): booted once, the sidecar and a server unit running.

Skipped, with the reason, where the machine cannot run it (not root, no debootstrap or
systemd-nspawn); where it can, a container that does not build or boot is a failure that shows
the journal. TORCH_WATCHDOG_NSPAWN=0 skips the suite on purpose.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import tempfile
import time
from typing import Callable, Iterator

import pytest

from tests.systemd import machine as machine_mod
from tests.systemd.machine import HERE, ROOT, Machine

SIDECAR, SERVER = "torch-watchdog.service", "llm.service"
CONFIG = "/etc/torch-watchdog/watchdog.yaml"
# the user's own unit for the inference server; the shipped drop-in goes beside it
SERVER_UNIT = """[Unit]
Description=toy inference server (torch and the agent)
[Service]
User=llm
ExecStart=/opt/llm/bin/python /opt/llm/server.py
[Install]
WantedBy=multi-user.target
"""
# the session's config: the server found by its unit, nothing reloaded
BASE_CONFIG = "server:\n  unit: llm.service\n"
SETUP = """
useradd --system --user-group --no-create-home --shell /usr/sbin/nologin torch-watchdog
useradd --system --user-group --no-create-home --shell /usr/sbin/nologin llm
/opt/torch-watchdog/bin/pip install -q --no-index --no-deps /wheels/{wheel}
/opt/llm/bin/pip install -q --no-index --no-deps /wheels/{wheel}
systemctl enable torch-watchdog.service llm.service
"""


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as fh:
        return fh.read()


@pytest.fixture(scope="package")  # powered off once its tests are done, not at make test's end
def machine():
    if os.environ.get("TORCH_WATCHDOG_NSPAWN") == "0":
        pytest.skip("TORCH_WATCHDOG_NSPAWN=0")
    reason = machine_mod.why_not_capable()
    if reason:
        pytest.skip(reason)
    with booted() as box:
        yield box


@contextlib.contextmanager
def booted() -> Iterator["Box"]:
    """The container, booted with the sidecar and the server unit enabled."""
    os.makedirs(machine_mod.CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=machine_mod.CACHE, prefix="wheels-") as wheels:
        wheel = machine_mod.build_wheels(wheels)
        m = Machine(machine_mod.cached_root(wheels), wheels)
        try:
            m.install({
                # as shipped: the units, the drop-in and the polkit rule, unmodified
                "/etc/systemd/system/torch-watchdog.service":
                    _read("systemd", "torch-watchdog.service"),
                "/etc/systemd/system/llm.service.d/torch-watchdog.conf":
                    _read("systemd", "inference-server.service.d", "torch-watchdog.conf"),
                "/etc/polkit-1/rules.d/50-torch-watchdog.rules":
                    _read("systemd", "polkit", "50-torch-watchdog.rules"),
                "/etc/systemd/system/llm.service": SERVER_UNIT,
                CONFIG: BASE_CONFIG,
                "/opt/llm/server.py": _read(HERE, "server.py"),
                "/opt/llm/plain_server.py": _read(HERE, "plain_server.py"),
                "/opt/tw-test/impostor.py": _read(HERE, "impostor.py"),
                "/opt/tw-test/probe.py": _read(HERE, "probe.py"),
                "/opt/tw-fault/sitecustomize.py": _read(HERE, "fault_sitecustomize.py"),
            }, SETUP.format(wheel=os.path.basename(wheel)))
            m.boot()
            yield Box(m)
        finally:
            m.close()


class Box:
    """The booted container, with what the checks ask of it."""

    def __init__(self, m: Machine):
        self.m = m
        self.sh, self.show, self.journal, self.write = m.sh, m.show, m.journal, m.write

    def main_pid(self, unit: str) -> int:
        return int(self.show(unit, "MainPID")["MainPID"])

    def wait(self, cond: Callable[[], object], timeout: float, what: str,
             unit: str = SIDECAR) -> object:
        """Poll `cond` until it is truthy; else fail with the unit's journal."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = cond()
            except (AssertionError, ValueError, KeyError):
                got = None
            if got:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {timeout} s\n--- journal of {unit}:\n"
                            f"{self.journal(unit)}\n--- journal of {SERVER}:\n"
                            f"{self.journal(SERVER, 30)}")
            time.sleep(0.3)

    def status(self) -> dict:
        """What `torch-watchdog status --json` says (the sidecar's status endpoint)."""
        out = self.sh("/opt/torch-watchdog/bin/torch-watchdog status --json").stdout
        return json.loads(out)

    def reloads(self) -> list[dict]:
        done = self.sh("cat /var/lib/torch-watchdog/reloads.json", check=False)
        return json.loads(done.stdout)["reloads"] if done.returncode == 0 else []

    def served_by(self) -> int:
        """The pid of the server process that answers a request."""
        out = self.sh("/opt/llm/bin/python -c 'import urllib.request; print(urllib.request."
                      "urlopen(\"http://127.0.0.1:8000/\", timeout=5).read().decode())'").stdout
        return json.loads(out)["pid"]

    def configure(self, text: str, restart: bool = True) -> None:
        """A new sidecar config; with `restart`, a fresh start (no reload record)."""
        self.write(CONFIG, text)
        if restart:
            self.sh(f"systemctl stop {SIDECAR}; rm -f /var/lib/torch-watchdog/reloads.json; "
                    f"systemctl start {SIDECAR}", timeout=60)

    def dropin(self, unit: str, name: str, text: str) -> None:
        self.write(f"/etc/systemd/system/{unit}.d/{name}.conf", text)
        self.sh("systemctl daemon-reload")

    def remove_dropin(self, unit: str, name: str) -> None:
        self.sh(f"rm -f {shlex.quote(f'/etc/systemd/system/{unit}.d/{name}.conf')} && "
                f"systemctl daemon-reload")
