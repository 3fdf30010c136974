"""The shipped operations files are valid for the real tools: systemd-analyze, promtool,
amtool; and a real Prometheus scrapes the real sidecar."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.conftest import ROOT, free_port, with_root
from torch_watchdog.sidecar.actions import alerts
from torch_watchdog.sidecar.core.correlate import CAUSES

EXAMPLE = os.path.join(ROOT, "config", "alertmanager-example.yml")
RULES = os.path.join(ROOT, "config", "prometheus", "torch-watchdog-rules.yml")
PAGER = "oncall-pager"  # the example's receiver that pages


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"needs {tool} (.ci/run installs it)")
    return path


def test_units_pass_systemd_analyze_verify(tmp_path):
    analyze = need("systemd-analyze")
    unit = open(os.path.join(ROOT, "systemd", "torch-watchdog.service")).read()
    assert "Type=notify" in unit and "WatchdogSec=" in unit
    assert "\nPrivateDevices=" not in unit  # NVML needs the NVIDIA device nodes
    # verify needs the ExecStart binary to exist: point it at this Python
    (tmp_path / "torch-watchdog.service").write_text(
        unit.replace("/opt/torch-watchdog/bin/torch-watchdog", sys.executable))
    dropin = open(os.path.join(ROOT, "systemd", "inference-server.service.d",
                               "torch-watchdog.conf")).read()
    (tmp_path / "llm.service").write_text(
        f"[Unit]\nDescription=test server\n[Service]\nExecStart={sys.executable} -c pass\n"
        + dropin.replace("[Service]\n", ""))
    for name in ("torch-watchdog.service", "llm.service"):
        r = subprocess.run([analyze, "verify", str(tmp_path / name)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr


def test_prometheus_rules_check_and_unit_tests():
    promtool = need("promtool")
    rules = os.path.join(ROOT, "config", "prometheus")
    for args in (["check", "rules", "torch-watchdog-rules.yml"],
                 ["test", "rules", "torch-watchdog-rules.test.yml"]):
        r = subprocess.run([promtool, *args], cwd=rules, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_alertmanager_example_route():
    amtool = need("amtool")
    r = subprocess.run([amtool, "check-config",
                        os.path.join(ROOT, "config", "alertmanager-example.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def sent_alerts() -> dict[str, dict[str, str]]:
    """Every alert the sidecar sends (actions/alerts.py's table) and every alert rule of
    config/prometheus/, by alertname: the labels Alertmanager routes on."""
    # the table names every cause the step can fire (the correlator's, and the step's own)
    assert set(CAUSES) <= set(alerts.FIXES)
    out = {}
    for name, cause in alerts.names().items():
        (alert,) = alerts.build({cause: {}}, {}, {}, {"service": "inference", "instance": "box",
                                                       "host": "box", "server": "llm"}).values()
        out[name] = alert["labels"]
    for group in yaml.safe_load(open(RULES))["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["alert"] not in out, rule["alert"]
                out[rule["alert"]] = {**rule.get("labels", {}), "alertname": rule["alert"],
                                      "instance": "10.0.0.7:9464", "server": "llm"}
    return out


def notifies(receiver: dict) -> bool:
    """A receiver with an integration: anything but its name (webhook_configs, email_configs,
    pagerduty_configs, ...) configured."""
    return any(key.endswith("_configs") and value for key, value in receiver.items())


def test_every_alert_sent_reaches_a_receiver_that_notifies_and_every_critical_one_pages():
    amtool = need("amtool")
    receivers = {r["name"]: r for r in yaml.safe_load(open(EXAMPLE))["receivers"]}
    table, wrong = [], []
    for name, labels in sorted(sent_alerts().items()):
        r = subprocess.run([amtool, "config", "routes", "test", f"--config.file={EXAMPLE}",
                            *(f"{k}={v}" for k, v in sorted(labels.items()))],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        got = r.stdout.strip().split(",")
        table.append(f"{name} ({labels.get('severity')}) -> {', '.join(got)}")
        if not all(notifies(receivers[g]) for g in got):
            wrong.append(f"{name}: {got} has no integration")
        if labels.get("severity") == "critical" and PAGER not in got:
            wrong.append(f"{name} is critical and goes to {got}, not {PAGER}")
    print("\n".join(["alert -> receiver (config/alertmanager-example.yml):", *table]))
    assert not wrong, wrong
    assert len(table) >= len(alerts.FIXES) + 7


def test_a_real_prometheus_scrapes_the_sidecar(short_tmp):
    prometheus = need("prometheus")
    port, prom_port = free_port(), free_port()
    cfg = os.path.join(short_tmp, "w.yaml")
    with open(cfg, "w") as fh:
        fh.write(f"metrics_port: {port}\nstate_dir: {short_tmp}\n"
                 f"agent:\n  socket_path: {short_tmp}/ev.sock\n")
    with open(os.path.join(short_tmp, "prom.yml"), "w") as fh:
        fh.write(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
                 f"rule_files: [{ROOT}/config/prometheus/torch-watchdog-rules.yml]\n"
                 f"scrape_configs:\n  - job_name: torch-watchdog\n"
                 f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    sidecar = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                "--config", cfg], cwd=ROOT, stderr=subprocess.DEVNULL,
                               env=dict(os.environ, PYTHONPATH=with_root()))
    prom = subprocess.Popen([prometheus, f"--config.file={short_tmp}/prom.yml",
                             f"--storage.tsdb.path={short_tmp}/tsdb",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def query(q: str) -> list:
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        return json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]

    try:
        deadline, result = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            try:
                result = query('torch_watchdog_cause_active{job="torch-watchdog"}')
            except OSError:  # Prometheus still starting
                result = []
            if len(result) == 4:
                break
            time.sleep(0.5)
        assert sorted(r["metric"]["cause"] for r in result) == [
            "cudagraph_per_shape", "memory_growth_unexplained", "recompile_limit_eager_fallback",
            "recompile_storm"]
        assert query('up{job="torch-watchdog"}')[0]["value"][1] == "1"
        # the rules run against the real series: nothing fires for an idle sidecar; without a
        # GPU (CI) the NVML rule may already be pending, which is what it is for
        assert query('ALERTS{alertstate="firing"}') == []
        pending = {r["metric"]["alertname"] for r in query("ALERTS")}
        assert pending <= {"TorchWatchdogNvmlDown"}
    finally:
        prom.send_signal(signal.SIGTERM)
        sidecar.send_signal(signal.SIGTERM)
        prom.wait(20)
        sidecar.wait(20)
