"""The seed scenario end to end on a real GPU (issue 4): a reduce-overhead server with the agent
and a ballast tensor leaving 300 MiB free records one CUDA graph per new seq_len until it would
crash (FACTS #9); the real sidecar must restart it first, the restarted server must serve again,
and a real Alertmanager must hold the alerts. A supervisor thread plays systemd's
`Restart=always` (stop, then start). The bucketed control: no alert, no reload.

Each scenario writes its evidence (sidecar log, reload record, progress, event and sample logs,
the Alertmanager's alerts, a summary) under $WATCHDOG_GPU_RESULTS/<scenario>/.
"""
from __future__ import annotations

import gzip
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ALERTMANAGER, ROOT, am_alerts, free_port, start_alertmanager, \
    wait_for, with_root

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ballast_server.py")


class Supervisor:
    """Restart the server when it exits, like systemd's Restart=always (stop, then start)."""

    def __init__(self, tmp: str, sock: str, extra: list[str], env: dict, starts: int,
                 tag: str = ""):
        self.tmp, self.sock, self.extra, self.env, self.starts = tmp, sock, extra, env, starts
        self.tag = tag  # one supervisor per replica: its files are named by it
        self.procs: list[subprocess.Popen] = []
        self.exits: list[tuple[int, float]] = []
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def paths(self, n: int) -> tuple[str, str]:
        tag = f"{self.tag}-" if self.tag else ""
        return (os.path.join(self.tmp, f"progress-{tag}{n}.jsonl"),
                os.path.join(self.tmp, f"events-{tag}{n}.jsonl"))

    def _run(self) -> None:
        for n in range(self.starts):
            progress, log = self.paths(n)
            proc = subprocess.Popen([sys.executable, SERVER, "--socket", self.sock, "--progress",
                                     progress, "--event-log", log, *self.extra], env=self.env,
                                    cwd=ROOT)
            self.procs.append(proc)
            self.exits.append((proc.wait(), time.time()))
            if self.done:
                return

    def progress(self, n: int) -> list[dict]:
        path = self.paths(n)[0]
        if not os.path.exists(path):
            return []
        with open(path) as fh:
            return [json.loads(line) for line in fh if line.strip()]

    def first(self, n: int, kind: str) -> dict | None:
        return next((p for p in self.progress(n) if p["kind"] == kind), None)

    def stop(self) -> None:
        self.done = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.thread.join(60)


class PostRecorder(http.server.BaseHTTPRequestHandler):
    """Where no Alertmanager binary can be had: record what the sidecar POSTs."""
    posts: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        PostRecorder.posts.extend(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        return


def compile_cost(log: str, until: float) -> dict:
    """Compile seconds and Inductor FX-cache hits/misses the agent reported before `until`."""
    seconds, hits, misses, n = 0.0, 0, 0, 0
    with open(log) as fh:
        for line in fh:
            e = json.loads(line)
            if e["kind"] in ("compile", "recompile") and e["t"] <= until:
                n += 1
                seconds += e["seconds"] or 0.0
                hits += e.get("fx_cache_hits") or 0
                misses += e.get("fx_cache_misses") or 0
    return {"compiles": n, "compile_seconds": round(seconds, 2), "fx_cache_hits": hits,
            "fx_cache_misses": misses}


def run_scenario(tmp: str, name: str, *, dry_run: bool, until, limit_s: float,
                 bucketed: bool = False, starts: int = 1,
                 replicas: list[dict] | None = None) -> dict:
    """Alertmanager, sidecar and supervised servers; returns the evidence (also saved).
    `replicas`: [{"tag", "extra" (server args), "env" (e.g. CUDA_VISIBLE_DEVICES and
    TORCH_WATCHDOG_SERVER), "starts"}]; `until` then gets {tag: Supervisor}, else the one."""
    am_port, port = free_port(), free_port()
    am = start_alertmanager(tmp, am_port) if ALERTMANAGER else None
    recorder = None
    if am is None:
        PostRecorder.posts.clear()  # an earlier scenario's posts are not this one's alerts
        recorder = http.server.ThreadingHTTPServer(("127.0.0.1", am_port), PostRecorder)
        threading.Thread(target=recorder.serve_forever, daemon=True).start()
    sock, state = os.path.join(tmp, "ev.sock"), os.path.join(tmp, "state")
    cfg = os.path.join(tmp, "watchdog.yaml")
    with open(cfg, "w") as fh:
        fh.write(f"""metrics_port: {port}
state_dir: {state}
sample_log: {tmp}/samples.jsonl
agent: {{socket_path: {sock}, allowed_uids: [{os.getuid()}]}}
policy: {{dry_run: {str(dry_run).lower()}}}
reload: {{method: signal, grace_s: 60}}
alerts: {{urls: ["http://127.0.0.1:{am_port}"], resend_s: 5, timeout_s: 2, service: seed-llm}}
""")
    env = dict(os.environ, PYTHONPATH=with_root(),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))  # as the drop-in sets
    sidecar_log = open(os.path.join(tmp, "sidecar.log"), "w")
    daemon = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                               "--config", cfg], cwd=ROOT, env=env, stderr=sidecar_log)
    assert wait_for(lambda: os.path.exists(sock), 30), "the sidecar did not start"
    specs = replicas or [{"tag": "", "extra": ["--bucketed"] if bucketed else [], "env": {},
                          "starts": starts}]
    sups = {r["tag"]: Supervisor(tmp, sock, r["extra"], {**env, **r["env"]}, r["starts"],
                                 r["tag"]) for r in specs}
    sup = sups if replicas else sups[""]
    alerts: dict = {}  # every alert the Alertmanager held at some point (resolved ones leave)
    try:
        started = time.monotonic()
        while not until(sup) and time.monotonic() - started < limit_s:
            held = am_alerts(am_port) if am is not None else {
                p["labels"]["alertname"]: p for p in PostRecorder.posts}
            for alertname, alert in held.items():
                alerts.setdefault(alertname, {**alert, "first_seen": time.time()})
            time.sleep(1)
    finally:
        for one in sups.values():
            one.stop()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        sidecar_log.close()
        if am is not None:
            am.terminate()
            am.wait(10)
        if recorder is not None:
            recorder.shutdown()
    with open(os.path.join(tmp, "sidecar.log")) as fh:
        logs = [json.loads(line) for line in fh if line.startswith("{")]
    record = os.path.join(state, "reloads.json")
    evidence = {
        "scenario": name, "alertmanager": "real" if am is not None else "post recorder",
        "alerts": {k: {"labels": v["labels"], "annotations": v["annotations"],
                       "first_seen": v["first_seen"]} for k, v in alerts.items()},
        "reload_decisions": [e for e in logs if e["event"] == "action"
                             and e.get("action") == "reload"],
        "reloads_started": [e for e in logs if e["event"] == "reloading the server"],
        "reloads_finished": [e for e in logs if e["event"] == "reload finished"],
        "findings": [e for e in logs if e["event"] == "finding"],
        "reload_record": json.load(open(record))["reloads"] if os.path.exists(record) else [],
        "exits": {t: one.exits for t, one in sups.items()} if replicas else sup.exits,
        "progress": {t: [one.progress(n) for n in range(len(one.procs))]
                     for t, one in sups.items()} if replicas else
        [sup.progress(n) for n in range(len(sup.procs))],
        "pids": {t: [p.pid for p in one.procs] for t, one in sups.items()},
    }
    save(tmp, name, evidence)
    return evidence


def save(tmp: str, name: str, evidence: dict) -> None:
    out = os.environ.get("WATCHDOG_GPU_RESULTS")
    if not out:
        return
    dest = os.path.join(out, name)
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "evidence.json"), "w") as fh:
        json.dump(_thinned(evidence), fh, indent=1)
    for f in os.listdir(tmp):  # the device tool returns 8 files: the sidecar's two logs
        if f in ("samples.jsonl", "sidecar.log"):
            with open(os.path.join(tmp, f), "rb") as src, \
                    gzip.open(os.path.join(dest, f + ".gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)


def _thinned(evidence: dict) -> dict:
    """Progress kept whole but for `served` lines (a bucketed server writes thousands)."""
    def thin(run: list) -> list:
        served = [p for p in run if p["kind"] == "served"]
        keep = {id(p) for p in served[::max(1, len(served) // 200)]} | \
            {id(served[-1])} if served else set()
        return [p for p in run if p["kind"] != "served" or id(p) in keep]

    progress = evidence.get("progress")
    if isinstance(progress, dict):
        progress = {t: [thin(r) for r in runs] for t, runs in progress.items()}
    elif isinstance(progress, list):
        progress = [thin(r) for r in progress]
    return {**evidence, "progress": progress}


def epoch(ts: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_the_sidecar_restarts_the_server_before_it_runs_out_of_memory(short_tmp):
    def restarted_and_serving(sup: Supervisor) -> bool:
        return len(sup.procs) == 2 and any(p["kind"] == "served" and p["requests"] >= 50
                                           for p in sup.progress(1))

    ev = run_scenario(short_tmp, "reload", dry_run=False, bucketed=False, starts=2,
                      until=restarted_and_serving, limit_s=400)
    first, second = ev["progress"][0], ev["progress"][1] if len(ev["progress"]) > 1 else []
    assert not [p for p in first if p["kind"] == "crash"], "the server crashed first"
    assert [p["kind"] for p in first][-1] == "stopped" and ev["exits"][0][0] == 0
    (entry,) = ev["reload_record"]
    assert entry["ok"] is True and entry["detail"].startswith("exited after SIGTERM; back: pid ")
    assert any(p["kind"] == "served" and p["requests"] >= 50 for p in second)
    assert "TorchCompileReload" in ev["alerts"] and "TorchCompileOomForecast" in ev["alerts"]
    # the reload names a growth cause, not oom_forecast. Decided at ~10 recordings (before 20
    # make cudagraph_per_shape a finding of its own), the share of growth the recordings
    # explain is not settled yet: of three runs on 2026-12-03, two named cudagraph_per_shape,
    # one memory_growth_unexplained (the allocator's segments land polls after the
    # recordings that fill them). An open item of the forecast's cause naming.
    assert entry["reason"] in ("cudagraph_per_shape", "memory_growth_unexplained")
    # what the reload cost: from SIGTERM to the restarted server's first answer
    sigterm = epoch(ev["reloads_started"][0]["timestamp"])
    ready = next(p["t"] for p in second if p["kind"] == "ready")
    ballast = [next(p["t"] for p in run if p["kind"] == "ballast") for run in (first, second)]
    cost = {"decided_after_ballast_s": round(
                epoch(ev["reload_decisions"][0]["timestamp"]) - ballast[0], 1),
            "sigterm_after_ballast_s": round(sigterm - ballast[0], 1),
            "seconds_to_oom_at_decision": ev["reload_decisions"][0]["seconds_to_oom"],
            "serving_again_after_sigterm_s": round(ready - sigterm, 1),
            "old_server_exit_after_sigterm_s": round(ev["exits"][0][1] - sigterm, 1),
            "compile_first_start": compile_cost(os.path.join(short_tmp, "events-0.jsonl"),
                                                next(p["t"] for p in first
                                                     if p["kind"] == "ready")),
            "compile_after_restart": compile_cost(os.path.join(short_tmp, "events-1.jsonl"),
                                                  ready)}
    save(short_tmp, "reload", {**ev, "cost": cost})
    after = cost["compile_after_restart"]
    assert after["fx_cache_hits"] > 0 and after["fx_cache_misses"] == 0, cost  # the drop-in's
    # persistent TORCHINDUCTOR_CACHE_DIR: the restart compiles from the cache


def test_without_a_reload_the_server_crashes_after_the_decision_time(short_tmp):
    """Dry run: the sidecar decides but does not act; the server runs on into the crash. The
    lead time is measured here, in one run: crash time minus decision time."""
    def crashed(sup: Supervisor) -> bool:
        return bool(sup.exits)

    ev = run_scenario(short_tmp, "dry-run", dry_run=True, bucketed=False, starts=1,
                      until=crashed, limit_s=300)
    crash = next(p for p in ev["progress"][0] if p["kind"] == "crash")
    decided = epoch(ev["reload_decisions"][0]["timestamp"])
    ballast = next(p["t"] for p in ev["progress"][0] if p["kind"] == "ballast")
    lead = {"crash_after_ballast_s": round(crash["t"] - ballast, 1),
            "decided_after_ballast_s": round(decided - ballast, 1),
            "lead_s": round(crash["t"] - decided, 1), "crash": crash["error"]}
    save(short_tmp, "dry-run", {**ev, "lead": lead})
    assert lead["lead_s"] >= 10, lead
    # the server runs on here, so the recordings become a finding (the reload comes before):
    # 0.468 MB a graph measured on this model; the finding's estimate, after 20-40
    # recordings, read 0.28-0.73 in four runs on one day, 0.61 on 2026-12-03
    per_shape = next(f for f in ev["findings"] if f["cause"] == "cudagraph_per_shape")
    assert 0.2 < per_shape["mb_per_graph"] < 1.0
    (entry,) = ev["reload_record"]
    assert entry["ok"] is False and "dry run" in entry["detail"]


def test_bucketed_traffic_gets_no_alert_and_no_reload(short_tmp):
    ev = run_scenario(short_tmp, "bucketed", dry_run=False, bucketed=True, starts=1,
                      until=lambda sup: False, limit_s=90)
    assert ev["reload_decisions"] == [] and ev["reload_record"] == []
    assert ev["alerts"] == {} and ev["findings"] == []
    assert not [p for p in ev["progress"][0] if p["kind"] == "crash"]
    assert any(p["kind"] == "served" for p in ev["progress"][0])
