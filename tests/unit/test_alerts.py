"""Alert building and the firing/resolved book (pure, fake clock), and the sender's retries."""
import urllib.error

from tests.fakes import Clock
from torch_watchdog.sidecar.actions import alerts
from torch_watchdog.sidecar.actions.alerts import AlertBook, AlertSender, build, rfc3339

LABELS = {"service": "llm", "instance": "gpu-7", "gpu_uuid": "GPU-1"}
EST = {"recordings": 1983, "distinct_shapes": 1990, "mb_per_graph": 0.47, "recompiles": 0}
FC = {"seconds_to_oom": 2400.0, "plateau_bytes": 3.2e9}


def test_one_alert_per_cause_with_identifying_labels_and_explaining_annotations():
    firing = build({"cudagraph_per_shape": {"recordings": 1983}}, EST, FC, LABELS)
    ((key, alert),) = firing.items()
    assert alert["labels"] == {**LABELS, "alertname": "TorchCompileCudagraphPerShape",
                               "cause": "cudagraph_per_shape", "severity": "warning"}
    text = alert["annotations"]["description"]
    assert "1,983 CUDA graphs recorded for 1,990 distinct shapes" in text
    assert "0.47 MB each, 932 MB so far" in text
    assert "~40 min to OOM" in text and "plateau 3.2 GB" in text
    assert "cudagraph_capture_sizes" in alert["annotations"]["fix"]
    assert key == tuple(sorted(alert["labels"].items()))


def test_the_oom_alert_s_fix_names_the_memory_that_runs_out():
    """In host-memory mode (no GPU) the fix said "GPU memory"."""
    def fix(source):
        (alert,) = build({"oom_forecast": {}}, {**EST, "memory_source": source}, FC,
                         LABELS).values()
        return alert["annotations"]["fix"]
    assert "GPU memory" in fix("process") and "GPU memory" in fix("device")
    assert "GPU" not in fix("rss") and "cgroup" in fix("rss")


def test_rfc3339():
    assert rfc3339(0.25) == "1970-01-01T00:00:00.250Z"


def test_firing_is_resent_with_a_lease_and_resolution_is_sent_then_retained():
    book = AlertBook(resend_s=60, resolved_retention_s=900)
    firing = build({"recompile_storm": {}}, EST, FC, LABELS)
    book.update(firing, 1000.0)
    (first,) = book.due(1000.0)
    assert first["startsAt"] == rfc3339(1000.0) and first["endsAt"] == rfc3339(1240.0)
    book.update(firing, 1030.0)
    assert book.due(1030.0) == []  # not due before resend_s
    book.update(firing, 1061.0)
    (again,) = book.due(1061.0)
    assert again["endsAt"] == rfc3339(1061.0 + 240) and again["startsAt"] == first["startsAt"]
    book.update({}, 1070.0)  # resolved: sent at once with endsAt = now
    (resolved,) = book.due(1070.0)
    assert resolved["endsAt"] == rfc3339(1070.0)
    book.update({}, 1131.0)
    assert [a["endsAt"] for a in book.due(1131.0)] == [rfc3339(1070.0)]  # re-sent
    book.update({}, 1971.0)
    assert book.due(1971.0) == [] and not book.tracked  # retention over


def test_a_cause_that_comes_back_is_a_new_alert():
    book = AlertBook(resend_s=60)
    firing = build({"recompile_storm": {}}, EST, FC, LABELS)
    book.update(firing, 0.0)
    book.due(0.0)
    book.update({}, 10.0)
    book.due(10.0)
    book.update(firing, 20.0)
    (alert,) = book.due(20.0)
    assert alert["startsAt"] == rfc3339(20.0)


class FakePost:
    def __init__(self, failures):
        self.failures, self.got = list(failures), []

    def __call__(self, url, batch, timeout):
        if self.failures:
            raise self.failures.pop(0)
        self.got.append((url, [a["labels"]["cause"] for a in batch]))


def batch(cause="recompile_storm"):
    return [{"labels": {"cause": cause}, "annotations": {}}]


def test_sender_retries_with_backoff_and_sends_to_every_url(monkeypatch):
    clock = Clock(0.0)
    monkeypatch.setattr(alerts.time, "monotonic", clock)
    post = FakePost([ConnectionRefusedError("down")])
    failures = []
    sender = AlertSender(["http://a", "http://b"], post=post,
                         on_failure=lambda url, e: failures.append(url))
    sender.submit(batch())
    sender.flush()  # a fails once, b delivers
    assert post.got == [("http://b", ["recompile_storm"])] and failures == ["http://a"]
    sender.flush()
    assert len(post.got) == 1  # a is backing off
    clock.t = 1.5
    sender.flush()
    assert post.got[-1] == ("http://a", ["recompile_storm"])
    assert sender.sent == {"http://a": 1, "http://b": 1} and sender.failed == {"http://a": 1}


def test_a_refused_batch_is_dropped_not_retried_forever():
    post = FakePost([urllib.error.HTTPError("http://a", 400, "bad", {}, None)])
    sender = AlertSender(["http://a"], post=post)
    sender.submit(batch())
    sender.flush()
    sender.flush()
    assert post.got == [] and sender.dropped == {"http://a": 1}
    assert not sender.outbox["http://a"]


def test_outbox_is_bounded():
    sender = AlertSender(["http://a"], max_outbox=3, post=FakePost([]))
    for cause in "abcde":
        sender.submit(batch(cause))
    assert list(a["labels"]["cause"] for a in sender.outbox["http://a"]) == ["c", "d", "e"]
    assert sender.dropped == {"http://a": 2}


def test_a_reload_alert_fires_for_its_least_time_then_resolves_carrying_its_outcome():
    # the step shows `reload` from the reload's start until one poll after its outcome (0.6 s
    # here): resolved that soon, Alertmanager's group_wait (30 s) would never notify it
    book = AlertBook(resend_s=60, min_firing_s={"reload": 180.0})
    under_way = build({"reload": {"outcome": "in progress", "method": "agent"}}, {}, {}, LABELS)
    ended = build({"reload": {"outcome": "exited after SIGTERM; back: pid 7 said hello",
                              "done": True}}, {}, {}, LABELS)
    assert under_way.keys() == ended.keys()  # one alert, its annotations updated
    book.update(under_way, 1000.0)
    (first,) = book.due(1000.0)
    assert first["annotations"]["description"] == "reload (agent): in progress"
    book.update(ended, 1000.5)
    book.update({}, 1000.6)  # the step no longer shows it: still firing
    book.update({}, 1061.0)
    (again,) = book.due(1061.0)
    assert again["endsAt"] == rfc3339(1061.0 + 240)  # firing, with the outcome
    assert again["annotations"]["description"] == \
        "reload: exited after SIGTERM; back: pid 7 said hello"
    book.update({}, 1179.9)
    (still,) = book.due(1179.9)  # re-sent (resend_s), still firing
    assert still["endsAt"] == rfc3339(1179.9 + 240)
    book.update({}, 1180.0)  # its least time over: resolved at once
    (resolved,) = book.due(1180.0)
    assert resolved["endsAt"] == rfc3339(1180.0) and resolved["startsAt"] == rfc3339(1000.0)
    # other causes resolve as they did
    storm = build({"recompile_storm": {}}, EST, FC, LABELS)
    book.update(storm, 2000.0)
    book.update({}, 2001.0)
    assert [a["endsAt"] for a in book.due(2001.0)
            if a["labels"]["cause"] == "recompile_storm"] == [rfc3339(2001.0)]


def test_a_reload_alert_that_outlasts_its_least_time_resolves_with_the_step():
    book = AlertBook(resend_s=60, min_firing_s={"reload": 5.0})
    firing = build({"reload": {"outcome": "in progress"}}, {}, {}, LABELS)
    book.update(firing, 0.0)
    book.update(firing, 30.0)  # a long drain: still under way
    book.due(30.0)
    book.update({}, 30.1)
    (resolved,) = book.due(30.1)
    assert resolved["endsAt"] == rfc3339(30.1)


def test_every_alert_carries_the_host_the_metrics_name(monkeypatch):
    """`host` (the inhibit rules' pairing label) is the metrics' torch_watchdog_host_info's."""
    import socket

    from torch_watchdog.sidecar.actions.alerting import Alerting
    from torch_watchdog.sidecar.config import AlertsConfig
    from torch_watchdog.sidecar.core.results import PollResult
    from torch_watchdog.sidecar.present import metrics

    monkeypatch.setattr(socket, "gethostname", lambda: "box-7")
    a = Alerting(AlertsConfig(urls=["http://127.0.0.1:1"], instance="llm-7.example"),
                 lambda url, e: None)
    sent: list = []
    a.sender.submit = sent.extend  # type: ignore[union-attr]
    view = {"estimates": {}, "forecast": {"gpu_uuid": None}, "active_causes": (), "pids": [1],
            "gpus": [], "held": None, "label": "llm"}
    poll = PollResult(firing={"llm": {"oom_forecast": {}}},
                      host_firing={"reload_record_unreadable": {"detail": "x"}},
                      views={"llm": view}, focus="llm", focus_view=view, focus_causes=[],
                      agents_alive=True, skewed_events=0, agent_events_lost=0)
    a.dispatch(0.0, poll)
    assert {al["labels"]["alertname"]: (al["labels"]["host"], al["labels"]["instance"],
                                        al["labels"].get("server")) for al in sent} == {
        "TorchCompileOomForecast": ("box-7", "llm-7.example", "llm"),
        "TorchCompileReloadRecordUnreadable": ("box-7", "llm-7.example", None)}
    assert metrics.host_name() == "box-7"
