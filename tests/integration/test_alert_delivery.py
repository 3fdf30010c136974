"""Alerts as shipped reach a person, once: the real sidecar, a real Prometheus loading the
shipped rules, and a real Alertmanager running the shipped example's routing tree and inhibit
rules, all on loopback; a small webhook receiver here stands for the pager and the ticket
system and counts their notifications.

A toy server (toy_server.py, host-memory mode) grows past its budget: the sidecar's
TorchCompileOomForecast pages once, and the rule's TorchCompileOomSoon for the same server
(host and server paired) is inhibited, not a second page. The sidecar reloads it (SIGTERM,
started again flat, as its supervisor would): TorchCompileReload pages once, though the reload
is over in well under a second. Then the sidecar stops: TorchWatchdogDown is notified.

Only the timings are the test's (group_wait 1 s, group_interval 2 s, the rules' `for` 2 s,
a 1 s scrape, reload_min_firing_s 8 s); the routes, receivers, matchers and inhibit rules are
config/alertmanager-example.yml's, the expressions and labels config/prometheus/'s.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

import pytest
import yaml

from tests.conftest import ALERTMANAGER, ROOT, free_port, start_alertmanager, wait_for, with_root

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    ALERTMANAGER is None or PROMETHEUS is None,
    reason="needs prometheus-alertmanager and prometheus (.ci/run installs them)")

TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_server.py")
EXAMPLE = os.path.join(ROOT, "config", "alertmanager-example.yml")
RULES = os.path.join(ROOT, "config", "prometheus", "torch-watchdog-rules.yml")
MIN_FIRING_S = 8.0  # the sidecar's reload_min_firing_s here: over group_wait, scrape + eval


class Webhook:
    """Alertmanager's webhook receiver on 127.0.0.1: every notification, with its path (the
    example's receivers: /pager, /tickets), its status and its alerts' names."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.got.append({"t": round(time.monotonic() - hook.t0, 1), "path": self.path,
                                 "status": body["status"],
                                 "alerts": sorted((a["labels"]["alertname"], a["status"])
                                                  for a in body["alerts"])})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def firing(self, path: str, name: str) -> list[dict[str, Any]]:
        """The notifications to `path` that tell `name` firing."""
        return [n for n in list(self.got) if n["path"] == path and (name, "firing") in n["alerts"]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_config(webhook_port: int) -> str:
    """The example's routing tree, receivers and inhibit rules, with the test's timings and its
    webhook for the integrations."""
    cfg = yaml.safe_load(open(EXAMPLE))

    def shorten(route: dict) -> None:
        for key, value in (("group_wait", "1s"), ("group_interval", "2s")):
            if key in route:
                route[key] = value
        for child in route.get("routes", ()):
            shorten(child)

    shorten(cfg["route"])
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", ()):
            path = urllib.parse.urlparse(hook["url"]).path
            hook["url"] = f"http://127.0.0.1:{webhook_port}{path}"
    return yaml.safe_dump(cfg)


def test_rules() -> dict:
    """The shipped rules with `for` 2 s: their expressions and labels unchanged."""
    rules = yaml.safe_load(open(RULES))
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
    return rules


test_config.__test__ = False  # type: ignore[attr-defined]  # helpers, not tests
test_rules.__test__ = False  # type: ignore[attr-defined]


def am_all(port: int) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v2/alerts"
    return json.loads(urllib.request.urlopen(url, timeout=5).read())


class AlertmanagerWatch:
    """What Alertmanager holds, read every 0.2 s from a thread: each alert by name as last
    seen (`seen`), as first seen inhibited (`inhibited`), and each state it was seen in."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.seen: dict[str, dict[str, Any]] = {}
        self.inhibited: dict[str, dict[str, Any]] = {}
        self.states: dict[str, set[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                held = am_all(self.port)
            except OSError:
                continue
            for a in held:
                name = a["labels"]["alertname"]
                self.seen[name] = a
                self.states.setdefault(name, set()).add(a["status"]["state"])
                if a["status"]["inhibitedBy"]:
                    self.inhibited.setdefault(name, a)

    def notified_uninhibited(self, name: str) -> bool:
        """Seen active (processed, not muted): its group would notify it."""
        return "active" in self.states.get(name, set())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def stop(proc: Optional[subprocess.Popen], timeout: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def test_one_oom_one_page_a_reload_one_page_a_stopped_sidecar_notified(short_tmp):
    hook = Webhook()
    am_port, port, prom_port = free_port(), free_port(), free_port()
    sock = os.path.join(short_tmp, "ev.sock")
    with open(os.path.join(short_tmp, "w.yaml"), "w") as fh:
        fh.write(f"""poll_interval_s: 0.1
metrics_port: {port}
state_dir: {short_tmp}/state
agent: {{socket_path: {sock}, allowed_uids: [{os.getuid()}]}}
forecast: {{process_budget_bytes: 300000000, window_s: 3}}
policy: {{reload_lead_s: 6, alert_lead_s: 1800, hold_polls: 50, warmup_s: 1}}
reload: {{method: signal, grace_s: 5, hello_timeout_s: 10}}
alerts: {{urls: ["http://127.0.0.1:{am_port}"], resend_s: 1, timeout_s: 1,
          reload_min_firing_s: {MIN_FIRING_S}}}
""")
    with open(os.path.join(short_tmp, "rules.yml"), "w") as fh:
        yaml.safe_dump(test_rules(), fh)
    with open(os.path.join(short_tmp, "prom.yml"), "w") as fh:
        fh.write(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
                 f"rule_files: [{short_tmp}/rules.yml]\n"
                 f"alerting:\n  alertmanagers:\n"
                 f"    - static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]\n"
                 f"scrape_configs:\n  - job_name: torch-watchdog\n"
                 f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    env = dict(os.environ, PYTHONPATH=with_root())
    env.pop("NOTIFY_SOCKET", None)
    am = prom = sidecar = toy = again = watcher = None
    try:
        am = start_alertmanager(short_tmp, am_port, test_config(hook.port))
        sidecar = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                    "--config", os.path.join(short_tmp, "w.yaml")], cwd=ROOT,
                                   env=env, stderr=open(os.path.join(short_tmp, "log"), "w"))
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={short_tmp}/prom.yml",
                                 f"--storage.tsdb.path={short_tmp}/tsdb",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_for(lambda: os.path.exists(sock), 30)
        assert wait_for(lambda: bool(urllib.request.urlopen(
            f"http://127.0.0.1:{prom_port}/-/ready", timeout=1).read()), 30)

        watcher = AlertmanagerWatch(am_port)
        # the toy grows past its 300 MB budget; the sidecar reloads it (SIGTERM) and it is
        # started again, flat, as its supervisor would
        toy = subprocess.Popen([sys.executable, TOY, sock, os.path.join(short_tmp, "m1")],
                               cwd=ROOT, env=env)
        assert toy.wait(40) == 0 and open(os.path.join(short_tmp, "m1")).read() == "graceful"
        again = subprocess.Popen([sys.executable, TOY, sock, os.path.join(short_tmp, "m2"),
                                  "flat"], cwd=ROOT, env=env)
        assert wait_for(lambda: hook.firing("/pager", "TorchCompileReload"), 30), hook.got
        # the reload's alert lasts MIN_FIRING_S from its start, then resolves, as does the
        # forecast (the new process holds still): give every group its last flushes
        oom = ("TorchCompileReload", "TorchCompileOomForecast", "TorchCompileOomSoon")
        assert wait_for(lambda: not {a["labels"]["alertname"] for a in am_all(am_port)} & set(
            oom), MIN_FIRING_S + 20), am_all(am_port)
        time.sleep(3)  # group_interval 2 s: the resolved notifications
        oom_pages = [n for n in hook.got if n["path"] == "/pager" and any(
            name in ("TorchCompileOomForecast", "TorchCompileOomSoon")
            and status == "firing" for name, status in n["alerts"])]
        reload_pages = hook.firing("/pager", "TorchCompileReload")

        # the sidecar stops: Prometheus finds it down, TorchWatchdogDown is notified
        stop(sidecar)
        assert wait_for(lambda: hook.firing("/tickets", "TorchWatchdogDown"), 30), hook.got
        down = hook.firing("/tickets", "TorchWatchdogDown")
    finally:
        if watcher is not None:
            watcher.close()
        for proc in (toy, again, sidecar, prom, am):
            stop(proc)
        hook.close()
    print("\nnotifications (s since the receiver started, receiver, status, alerts):")
    for n in hook.got:
        print(f"  {n['t']:6.1f} {n['path']:9} {n['status']:8} {n['alerts']}")
    # one OOM, one page: the sidecar's; the rule's copy was there, paired and inhibited
    assert [n["alerts"] for n in oom_pages] == [[("TorchCompileOomForecast", "firing")]], oom_pages
    seen, held = watcher.seen, watcher.inhibited
    assert "TorchCompileOomSoon" in seen, sorted(seen)  # the rule fired …
    assert "TorchCompileOomSoon" in held, seen["TorchCompileOomSoon"]  # … and was inhibited
    assert not watcher.notified_uninhibited("TorchCompileOomSoon"), seen["TorchCompileOomSoon"]
    soon, forecast = held["TorchCompileOomSoon"], seen["TorchCompileOomForecast"]
    assert soon["labels"]["host"] == forecast["labels"]["host"]
    assert soon["labels"]["server"] == forecast["labels"]["server"]
    assert soon["labels"]["instance"] != forecast["labels"]["instance"]  # not what pairs them
    # one reload, one page, though it was over in well under a second
    assert len(reload_pages) == 1, reload_pages
    assert seen["TorchCompileReload"]["labels"]["server"] == forecast["labels"]["server"]
    assert len(down) == 1, down
