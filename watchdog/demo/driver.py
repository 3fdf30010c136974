"""The demo's driver: starts the real sidecar and the demo server, supervises the server as
systemd's Restart=always would, prints the timeline, and stops everything it started.

Never imports torch (the server does). Children run in their own sessions (a Ctrl-C in the
terminal reaches only the driver, which stops them in order) and get SIGTERM if the driver
dies (PR_SET_PDEATHSIG); each one carries TORCH_WATCHDOG_DEMO=<work dir> in its environment.
"""
from __future__ import annotations

import ctypes
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import IO, Any, Optional, TextIO

import psutil

from torch_watchdog.demo.profile import Profile, render_config
from torch_watchdog.demo.timeline import Timeline, line_time, progress_text

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOCKET_MAX = 100          # AF_UNIX paths are limited to 108 bytes
STOP_WAIT_S = 15.0        # a child's grace after SIGTERM, then SIGKILL
MAX_STARTS = 3            # server starts (the first, the restart after the reload, one spare)
FILES = ("watchdog.yaml", "sidecar.log", "sidecar-samples.jsonl", "events.jsonl",
         "server-1.log", "server-2.log", "server-3.log", "report.html", "state/reloads.json")


class DemoError(Exception):
    """Something the demo cannot go on without; the message says what."""


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP to the driver."""


def _die_with_parent() -> None:  # preexec_fn: Linux only, best effort
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Demo:
    def __init__(self, profile: Profile, work: str, device: str, keep: bool,
                 out: TextIO = sys.stdout, port: Optional[int] = None):
        self.p, self.work, self.device, self.keep, self.out = profile, work, device, keep, out
        self.start = time.time()
        self.tl = Timeline(self.start)
        self.lines: queue.Queue = queue.Queue()
        self.sidecar: Optional[subprocess.Popen] = None
        self.servers: list[subprocess.Popen] = []
        self.server_logs: list[IO] = []
        self.socket_dir: Optional[str] = None
        self.port = port or free_port()  # the status page's and /metrics' port
        self.config_path = os.path.join(work, "watchdog.yaml")
        self.events_path = os.path.join(work, "events.jsonl")
        self.samples_path = os.path.join(work, "sidecar-samples.jsonl")
        self.report_path = os.path.join(work, "report.html")
        self.events_offset, self.events_rest = 0, b""
        self.budget: Optional[int] = None
        self.serving_t: Optional[float] = None
        self.next_progress = 0.0
        self.last_progress: Optional[dict] = None
        # the agent's TORCH_WATCHDOG_* settings and systemd's NOTIFY_SOCKET are the caller's,
        # not the demo's: left out of the children's environment
        inherited = {k: v for k, v in os.environ.items()
                     if not k.startswith("TORCH_WATCHDOG_") and k != "NOTIFY_SOCKET"}
        self.env = dict(inherited, TORCH_WATCHDOG_DEMO=work, PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT,
                                                                 os.environ.get("PYTHONPATH")])))

    # -- output -----------------------------------------------------------------------------
    def say(self, text: str, source: str = "demo") -> None:
        self.emit([self.tl.line(time.time(), source, text)])

    def emit(self, lines: list[str]) -> None:
        for line in lines:
            print(line, file=self.out, flush=True)

    # -- set-up -----------------------------------------------------------------------------
    def prepare(self) -> None:
        os.makedirs(os.path.join(self.work, "state"), exist_ok=True)
        for name in FILES:  # a re-used work dir: a reload record would hold the cooldown
            try:
                os.remove(os.path.join(self.work, name))
            except FileNotFoundError:
                pass
        sock = os.path.join(self.work, "events.sock")
        if len(sock) > SOCKET_MAX:
            self.socket_dir = tempfile.mkdtemp(prefix="tw-demo-")
            sock = os.path.join(self.socket_dir, "events.sock")
        self.socket_path = sock
        self.write_config(psutil.virtual_memory().total)

    def write_config(self, budget: int) -> None:
        from torch_watchdog.sidecar import config

        text = render_config(self.p, work=self.work, socket_path=self.socket_path,
                             port=self.port, budget_bytes=budget)
        tmp = self.config_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        _, problems = config.check(tmp)
        if problems:
            raise DemoError(f"the demo wrote a bad config: {problems}")
        os.replace(tmp, self.config_path)

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=self.work, env=self.env, start_new_session=True,
                                preexec_fn=_die_with_parent, **kw)

    def start_sidecar(self) -> None:
        self.sidecar = self.popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                   "--config", self.config_path], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        log = open(os.path.join(self.work, "sidecar.log"), "w", encoding="utf-8")
        threading.Thread(target=self._read, args=(self.sidecar.stderr, "sidecar", log),
                         daemon=True).start()
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket_path):
            self.pump()
            if self.sidecar.poll() is not None or time.monotonic() > deadline:
                raise DemoError(f"the sidecar did not start (see {log.name})")
            time.sleep(0.05)

    def start_server(self) -> None:
        n = len(self.servers) + 1
        if n > MAX_STARTS:
            raise DemoError(f"the server was started {MAX_STARTS} times; giving up")
        p = self.p
        log = open(os.path.join(self.work, f"server-{n}.log"), "w", encoding="utf-8")
        self.server_logs.append(log)
        proc = self.popen([sys.executable, "-m", "torch_watchdog.demo.server", "--socket",
                           self.socket_path, "--event-log", self.events_path, "--device",
                           self.device, "--rate", str(p.rate), "--warm-requests",
                           str(p.warm_requests), "--warm-lengths",
                           ",".join(map(str, p.warm_lengths)),
                           "--lengths", f"{p.lengths[0]}:{p.lengths[1]}", "--limit",
                           str(p.limit), "--standin-mb", str(p.standin_mb)],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        self.servers.append(proc)
        threading.Thread(target=self._read, args=(proc.stdout, "server", None),
                         daemon=True).start()
        what = "starting the demo server" if n == 1 else \
            "starting the server again (as systemd's Restart=always would: stop, then start)"
        self.say(f"{what}: pid {proc.pid}, log {log.name}")

    def _read(self, pipe: IO[bytes], source: str, copy: Optional[IO]) -> None:
        for raw in pipe:
            text = raw.decode("utf-8", "replace").rstrip("\n")
            if copy is not None:
                copy.write(text + "\n")
                copy.flush()
            self.lines.put((source, text))
        if copy is not None:
            copy.close()

    # -- the loop ---------------------------------------------------------------------------
    def pump(self) -> None:
        """Print what the children reported since the last call, in time order."""
        lines = self.read_events()
        while True:
            try:
                source, text = self.lines.get_nowait()
            except queue.Empty:
                break
            try:
                d = json.loads(text)
            except ValueError:
                continue  # a traceback or a stray line: in the log files
            if not isinstance(d, dict):
                continue
            if source == "sidecar":
                lines += self.tl.sidecar(d)
            else:
                lines += self.tl.server(d)
                if d.get("ev") == "serving" and self.serving_t is None:
                    self.serving_t = time.monotonic()
                if d.get("ev") == "progress" and d.get("pid") == self.servers[-1].pid:
                    self.last_progress = d
                if d.get("ev") == "stopping":
                    self.last_progress = None
        self.emit(sorted(lines, key=line_time))

    def read_events(self) -> list[str]:
        try:
            with open(self.events_path, "rb") as fh:
                fh.seek(self.events_offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.events_offset += len(data)
        *complete, self.events_rest = (self.events_rest + data).split(b"\n")
        out = []
        for line in complete:
            try:
                out += self.tl.agent(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def run_until_done(self) -> bool:
        """True once the restarted server has served `serve_again` requests; False after
        `timeout_s`."""
        deadline = time.monotonic() + self.p.timeout_s
        while time.monotonic() < deadline:
            self.pump()
            if self.sidecar is not None and self.sidecar.poll() is not None:
                raise DemoError(f"the sidecar exited (code {self.sidecar.returncode}); see "
                                f"{os.path.join(self.work, 'sidecar.log')}")
            self.supervise()
            self.maybe_set_budget()
            self.progress()
            if self.tl.facts.served_again >= self.p.serve_again:
                self.say(f"the restarted server has served {self.tl.facts.served_again} "
                         "requests: the demo is over; " + (
                             "the server and the sidecar keep running (--keep)" if self.keep
                             else "stopping the server and the sidecar"))
                return True
            time.sleep(0.1)
        self.say(f"gave up after {self.p.timeout_s:.0f} s")
        return False

    def supervise(self) -> None:
        """Restart=always: once the server has exited after a reload, start it again."""
        proc = self.servers[-1]
        if proc.poll() is None:
            return
        deadline = time.monotonic() + 2.0  # its last lines, and the sidecar's, first
        self.pump()
        while self.tl.facts.sigterm_t is None and time.monotonic() < deadline:
            time.sleep(0.1)
            self.pump()
        code = proc.returncode
        if self.tl.facts.sigterm_t is None:
            raise DemoError(f"the server (pid {proc.pid}) exited with code {code} before any "
                            f"reload; {_tail(self.server_logs[-1].name)}")
        self.say(f"pid {proc.pid} exited with code {code}")
        self.last_progress = None
        self.start_server()

    def maybe_set_budget(self) -> None:
        """After warm-up (the recompile limit, then `settle_s`): budget = the server's memory
        as the sidecar measures it + the margin; the config is rewritten, the sidecar HUPed."""
        if self.budget is not None or self.serving_t is None:
            return
        limits = [c.limit_t for c in self.tl.calls.values() if c.limit_t is not None]
        now = time.time()
        if limits and now < min(limits) + self.p.settle_s:
            return
        if not limits and time.monotonic() < self.serving_t + self.p.budget_anyway_s:
            return
        status = self.status()
        level = ((status or {}).get("forecast") or {}).get("level_bytes")
        if level is None:
            return
        from torch_watchdog.sidecar.present.status import fmt_bytes

        margin = self.p.margin_bytes
        self.budget = int(level) + margin
        self.write_config(self.budget)
        source = ((status or {}).get("memory") or {}).get("source")
        self.say(f"warm-up over: budget = the server's memory now ({fmt_bytes(level)}, "
                 f"{source}) + {fmt_bytes(margin)} = {fmt_bytes(self.budget)}, "
                 "the demo's stand-in for a full GPU; config rewritten, SIGHUP to the sidecar")
        assert self.sidecar is not None
        self.sidecar.send_signal(signal.SIGHUP)

    def progress(self) -> None:
        if self.last_progress is None or time.monotonic() < self.next_progress:
            return
        self.next_progress = time.monotonic() + (4.0 if self.p.name == "short" else 5.0)
        self.say(progress_text(self.last_progress, self.status()), "server")
        self.last_progress = None

    def status(self) -> Optional[dict]:
        try:
            with urllib.request.urlopen(f"{self.url}/status.json", timeout=2) as resp:
                return json.load(resp)
        except (OSError, ValueError):
            return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- the end ----------------------------------------------------------------------------
    def stop_all(self) -> None:
        """Servers first (the sidecar must not see them vanish as a crash it acts on)."""
        for proc in self.servers:
            _stop(proc)
        if self.sidecar is not None:
            _stop(self.sidecar)
        self.pump()
        for log in self.server_logs:
            log.close()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def write_report(self) -> Optional[str]:
        from torch_watchdog.sidecar import config
        from torch_watchdog.sidecar.offline import report

        if not os.path.exists(self.samples_path):
            return None
        try:
            report.write_report([self.samples_path], self.report_path,
                                config.load(self.config_path))
        except (report.ReportError, config.ConfigError) as err:
            self.say(f"no report: {err}")
            return None
        return self.report_path


def _tail(path: str, lines: int = 6) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            last = fh.read().splitlines()[-lines:]
    except OSError:
        last = []
    return f"the end of {path}:\n    " + "\n    ".join(last) if last else f"see {path}"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM; after STOP_WAIT_S, SIGKILL to the child's process group (its compile workers
    too) while the child is not yet reaped, so that group is still ours; then any descendant
    seen before that is still running (psutil checks it is the same process)."""
    if proc.poll() is not None:
        return
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()
    for child in family:
        try:
            child.kill()
        except psutil.Error:
            pass
