"""Shared fixtures: a real Unix datagram receiver that decodes with the shared schema."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from typing import Callable, Optional

import psutil
import pytest

from torch_watchdog import events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The agent keeps its restart request in /run by default, and compile bundles in
# /var/cache/torch-watchdog when turned on: not from the tests (nor the servers they start);
# the warm-restart tests turn the bundle on, in a temporary directory of their own.
os.environ.setdefault("TORCH_WATCHDOG_WARM", "0")
os.environ.setdefault("TORCH_WATCHDOG_RESTART_FILE",
                      os.path.join(tempfile.mkdtemp(prefix="tw-test-"), "restart-requested"))
# Debian's prometheus-alertmanager; WATCHDOG_ALERTMANAGER names a binary carried elsewhere
ALERTMANAGER = (os.environ.get("WATCHDOG_ALERTMANAGER") or shutil.which("prometheus-alertmanager")
                or shutil.which("alertmanager"))


def free_port() -> int:
    """A loopback TCP port nobody listens on (for the servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], object], timeout: float, what: str, tick: float = 0.1):
    """`cond()`'s first truthy value within `timeout` seconds, else fail saying `what`; an
    OSError, ValueError, KeyError or psutil.Error (a server, a process, a file not there yet)
    counts as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = cond()
        except (OSError, ValueError, KeyError, psutil.Error):
            got = None
        if got:
            return got
        time.sleep(tick)
    pytest.fail(f"not within {timeout:g} s: {what}")


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll `cond` until true; OSError (a server still starting) or KeyError (a metric not
    exported yet) count as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            met = cond()
        except (OSError, KeyError):
            met = False
        if met:
            return True
        time.sleep(0.1)
    return False


def start_alertmanager(tmp: str, port: int, config: Optional[str] = None) -> subprocess.Popen:
    """A real Alertmanager on loopback with a temp storage path, ready to take alerts; its
    configuration `config` (YAML text), else one receiver that notifies nobody."""
    cfg = os.path.join(tmp, "am.yml")
    with open(cfg, "w") as fh:
        fh.write(config or "route:\n  receiver: blackhole\nreceivers:\n  - name: blackhole\n")
    proc = subprocess.Popen([ALERTMANAGER, f"--config.file={cfg}",
                             f"--storage.path={tmp}/am-data",
                             f"--web.listen-address=127.0.0.1:{port}",
                             "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if wait_for(lambda: bool(urllib.request.urlopen(
            f"http://127.0.0.1:{port}/-/ready", timeout=1).read()), 30):
        return proc
    proc.kill()
    raise RuntimeError("alertmanager did not become ready")


def am_alerts(port: int) -> dict[str, dict]:
    """The alerts an Alertmanager holds, by alertname."""
    data = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/alerts", timeout=5).read()
    return {a["labels"]["alertname"]: a for a in json.loads(data)}


def with_root() -> str:
    """PYTHONPATH for a child process: this checkout first, keeping what the environment had
    (on the GPU machine, a --target directory of carried wheels)."""
    return os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))


@contextlib.contextmanager
def restart_requester(path: str):
    """A live process that asked for a restart the agent's way (drain.write_restart_file: the
    request names it, and it holds the file open): yields it, killed after."""
    import sys
    code = ("import sys, time; from torch_watchdog.agent.drain import write_restart_file; "
            "why = write_restart_file(sys.argv[1], 'drain'); print(why or 'ok', flush=True); "
            "time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=with_root()))
    try:
        assert proc.stdout.readline().strip() == "ok"
        yield proc
    finally:
        proc.kill()
        proc.wait()


class Collector:
    """Binds a datagram socket like the sidecar will, and keeps every decoded event."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.events: list[events.Event] = []
        self.garbage: list[bytes] = []
        self.datagrams = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(events.MAX_DATAGRAM_BYTES + 1)
            except OSError:  # socket.timeout is a TimeoutError, an OSError
                continue
            self.datagrams += 1
            for line in data.split(b"\n"):  # a datagram carries one or more events
                try:
                    self.events.append(events.decode(line))
                except events.EventDecodeError:
                    self.garbage.append(line)

    def of(self, kind: str) -> list:
        return [e for e in list(self.events) if e.kind == kind]

    def wait(self, cond: Callable[["Collector"], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond(self):
                return True
            time.sleep(0.02)
        return cond(self)

    def close(self) -> None:
        self._stop = True
        self._thread.join(1)
        self.sock.close()


@pytest.fixture
def short_tmp():
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer
    with tempfile.TemporaryDirectory(prefix="tw-") as d:
        yield d


@pytest.fixture
def collector(short_tmp):
    c = Collector(os.path.join(short_tmp, "events.sock"))
    yield c
    c.close()


# Tiers by cost (issue 53): `pytest -m "not slow"` is the inner loop; `make test` (CI) runs
# both. tests/unit holds unit tests only, all in the fast tier: no process started, no real
# sleep (tests/fakes.py: a clock). Slow: every test outside tests/unit: real processes,
# sockets with threads, servers (integration, chaos, systemd), a GPU (gpu), and the long
# computations (scoreboard: the judgment boards and golden replays of the corpus, the
# lifecycles' stateful search). In the fast tier a test that starts a process or sleeps
# fails, saying so: give it a fake (a clock, a fake NVML), or move it out of tests/unit.
SLOW_DIRS = ("chaos", "gpu", "integration", "scoreboard", "systemd")
SLOW_UNIT: set[str] = set()  # unit files slow as a whole: none
TESTS = os.path.join(ROOT, "tests")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = os.path.relpath(str(item.fspath), TESTS).split(os.sep)
        if parts[0] in SLOW_DIRS or (parts[0] == "unit" and parts[-1] in SLOW_UNIT):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fast_tier(request, monkeypatch):
    """A fast-tier test neither starts a process nor sleeps in its own code (the code under
    test may: a sender thread's backoff, Inductor's compiler)."""
    if request.node.get_closest_marker("slow") is not None:
        return
    real_sleep, real_init = time.sleep, subprocess.Popen.__init__

    def sleep(seconds: float) -> None:
        import sys
        if sys._getframe(1).f_code.co_filename.startswith(TESTS):
            raise AssertionError(f"a fast-tier test slept {seconds} s: use a fake clock "
                                 "(tests/fakes.py), or move "
                                 f"{os.path.basename(str(request.node.fspath))}'s test out "
                                 "of tests/unit (tests/conftest.py)")
        real_sleep(seconds)

    def popen(self, *args, **kwargs):
        import sys
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename == subprocess.__file__:
            frame = frame.f_back   # subprocess.run -> Popen: who called it
        if frame is not None and frame.f_code.co_filename.startswith(TESTS):
            raise AssertionError(f"a fast-tier test started a process "
                                 f"({args[0] if args else ''}): move "
                                 f"{os.path.basename(str(request.node.fspath))}'s test to "
                                 "tests/integration (tests/conftest.py)")
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen)


@pytest.fixture(autouse=True)
def _structlog_defaults():
    """`torch-watchdog sidecar` run in-process configures structlog for its stderr, which
    pytest closes after that test: later tests' daemons would log to a closed file."""
    yield
    import structlog
    structlog.reset_defaults()


def scrape(port: int) -> dict[str, float]:
    """A sidecar's /metrics as {series: value}; a per-server family (labelled only by server)
    is also summed under its bare name (the agent's default server name varies by host)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
            if name.endswith("}") and name.split("{", 1)[1].startswith('server="') and \
                    name.count('="') == 1:
                bare = name.split("{", 1)[0]
                out[bare] = out.get(bare, 0.0) + float(value)
    return out


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch):
    """Each agent test on both hot paths of watch(): the C one (_hotpath.c) and calls.py's
    Python one, which serves where the C one is not built (watch() picks at wrap time)."""
    from torch_watchdog.agent import calls

    if request.param == "python":
        monkeypatch.setattr(calls, "_hotpath", None)
    elif calls._hotpath is None:
        pytest.skip("the C hot path is not built here (test_the_c_hot_path_is_built_here)")
    return request.param
