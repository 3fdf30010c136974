"""The sidecar's side of the agent's padding: from `padding` and `mitigation` events through the
step to the alert, the metrics, the status page and the terminal, as a user sees them."""
from __future__ import annotations

from torch_watchdog import events
from torch_watchdog.sidecar.actions import alerts
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.step import Host, step
from torch_watchdog.sidecar.present import metrics
from torch_watchdog.sidecar.present.history import History
from torch_watchdog.sidecar.present.page import render_page
from torch_watchdog.sidecar.present.snapshot import Snapshot
from torch_watchdog.sidecar.present.status import build_status, format_terminal
from torch_watchdog.sidecar.core.observations import ProcessSample, Sample

from tests.unit.test_metrics import parse, value

T, PID = 1_700_000_000.0, 4242
CFG = Config()


def hello(t: float) -> events.Hello:
    return events.Hello(t=t, pid=PID, torch="2.11", agent="test", devices=[], config={},
                        capabilities={}, watched=["llm", "pooler"], argv="serve", server="srv")


def stats(t: float, name: str, on: bool = True) -> events.Padding:
    return events.Padding(t=t, pid=PID, name=name, on=on, buckets=[256, 512, 1024, 2048],
                          calls=1000, padded_calls=990, real_tokens=900_000,
                          padding_tokens=100_000, checks=5, check_seconds=0.06,
                          max_error={"float16": 0.0021}, recordings_saved=1200)


def refused(t: float) -> events.Mitigation:
    return events.Mitigation(t=t, pid=PID, name="padding", action="refused",
                             detail="padding off for pooler: length 20 padded to 32: output [] "
                                    "(float32) differs by 0.31 (relative), over the tolerance "
                                    "0.001", model="pooler", error=0.31, buckets=[32])


def run(*observations) -> Host:
    host = Host()
    for o in observations:
        step(host, o, CFG)
    return host


def poll(t: float) -> Sample:
    return Sample(t=t, devices=(), processes=(ProcessSample(PID, True, 1 << 30, {}),))


def view(host: Host):
    server = host.servers["srv"]
    est = server.state.estimates(CFG.correlate)
    snap = Snapshot(t=T + 3, estimates=est, forecast=server.forecast.as_dict(),
                    servers={"srv": {"estimates": est, "forecast": server.forecast.as_dict(),
                                     "active_causes": (), "pids": [PID], "gpus": []}},
                    focus="srv")
    return snap, History().view(snap, [], {"version": "test"})


def scrape(snap: Snapshot) -> dict:
    collector = metrics.SnapshotCollector()
    collector.update(snap)
    return parse(metrics.render(metrics.make_registry(collector)).decode())


def test_a_refusal_fires_an_alert_with_the_error_and_padding_is_exported_off():
    host = run(hello(T), stats(T + 1, "llm"), refused(T + 1.5), poll(T + 2))
    server = host.servers["srv"]
    assert set(server.firing) == {"padding_refused"}
    built = alerts.build(server.firing, {}, {}, {"server": "srv"})
    (alert,) = built.values()
    assert alert["labels"]["alertname"] == "TorchCompilePaddingRefused"
    assert "padding off for pooler: outputs differed by 0.31" in \
        alert["annotations"]["description"]
    assert "attention mask" in alert["annotations"]["fix"]

    snap, _ = view(host)
    s = scrape(snap)
    on = {dict(k[1])["model"]: v for k, v in s.items()
          if k is not None and k[0] == "torch_watchdog_padding_on"}
    assert on == {"llm": 1.0, "pooler": 0.0}
    key = ("torch_watchdog_padding_fraction_ratio", frozenset({"server": "srv",
                                                                "model": "llm"}.items()))
    assert s[key] == 0.1
    key = ("torch_watchdog_padding_recordings_saved", frozenset({"server": "srv",
                                                                  "model": "llm"}.items()))
    assert s[key] == 1200
    assert ("torch_watchdog_padding_plan", frozenset(
        {"server": "srv", "model": "llm", "bucket": "2048"}.items())) in s


def test_a_late_padding_total_does_not_turn_a_refused_model_back_on():
    host = run(hello(T), refused(T + 1), stats(T + 2, "pooler", on=True), poll(T + 3))
    assert host.servers["srv"].state.padding.models["pooler"]["on"] is False
    assert "padding_refused" in host.servers["srv"].firing


def test_padding_on_the_status_page_and_in_the_terminal():
    host = run(hello(T), stats(T + 1, "llm"), refused(T + 1.5), poll(T + 2))
    snap, status_view = view(host)
    status = build_status(status_view, T + 4)
    rows = {r["model"]: r for r in status["padding"]}
    assert rows["llm"]["on"] and rows["llm"]["check_ms"] == 12.0
    assert rows["llm"]["summary"].startswith("llm: on, 4 buckets (256 … 2048), 10.0 % of tokens")
    assert "1,200 CUDA graphs not recorded" in rows["llm"]["summary"]
    assert not rows["pooler"]["on"] and "differs by 0.31" in rows["pooler"]["summary"]
    text = format_terminal(status, "http://127.0.0.1:9464", T + 4)
    assert "padding  llm: on" in text and "         pooler: OFF" in text
    page = render_page(status, T + 4)
    assert 'id="padding"' in page and "256, 512, 1024, 2048" in page
    assert "differs by 0.31" in page


def test_no_padding_no_section_no_alert():
    host = run(hello(T), poll(T + 1))
    snap, status_view = view(host)
    status = build_status(status_view, T + 2)
    assert status["padding"] == [] and 'id="padding"' not in render_page(status, T + 2)
    assert "padding" not in format_terminal(status, "u", T + 2)
    assert "padding_refused" not in host.servers["srv"].firing
    assert not [k for k in scrape(snap) if k and k[0].startswith("torch_watchdog_padding")]


def test_the_report_shows_each_padded_model_and_the_refusal(tmp_path):
    from torch_watchdog.sidecar.offline import report

    log = tmp_path / "events.jsonl"
    log.write_bytes(b"\n".join(events.encode(e) for e in (
        hello(T), stats(T + 1, "llm"), stats(T + 1, "pooler"), refused(T + 2))) + b"\n")
    out = tmp_path / "report.html"
    rep = report.write_report([str(log)], str(out), Config())
    (server,) = rep["servers"]
    rows = {r["model"]: r for r in server["padding"]}
    assert rows["llm"]["on"] and rows["llm"]["padding_fraction"] == 0.1
    assert not rows["pooler"]["on"] and rows["pooler"]["error"] == 0.31
    page = out.read_text()
    assert "Padding by the agent" in page and "differs by 0.31" in page
    assert "256, 512, 1024, 2048" in page and "1,200" in page


def test_sampled_checks_skipped_and_stopped_are_exported():
    capped = events.Padding(t=T + 2, pid=PID, name="llm", on=True, buckets=[256, 512],
                            calls=2000, padded_calls=1990, real_tokens=900_000,
                            padding_tokens=100_000, checks=7, check_seconds=0.1,
                            max_error={"float16": 0.001}, recordings_saved=10,
                            check_pool="shared", checks_skipped=12,
                            checks_stopped="sampled checks left 300 MB reserved")
    snap, _ = view(run(hello(T), poll(T + 1), stats(T + 1, "llm"), capped, poll(T + 2)))
    got = scrape(snap)
    skipped = "torch_watchdog_padding_checks_skipped_total"
    assert value(got, skipped, server="srv", model="llm") == 12
    assert value(got, "torch_watchdog_padding_checks_stopped", server="srv", model="llm") == 1
    # a model whose checks run unbounded reports 0 skipped and not stopped
    snap, _ = view(run(hello(T), poll(T + 1), stats(T + 1, "llm"), poll(T + 2)))
    got = scrape(snap)
    assert value(got, "torch_watchdog_padding_checks_skipped_total", server="srv", model="llm") == 0
    assert value(got, "torch_watchdog_padding_checks_stopped", server="srv", model="llm") == 0
