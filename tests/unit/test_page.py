"""page.py: the status page is one self-contained, escaped HTML document."""
from __future__ import annotations

import re
from html.parser import HTMLParser

from tests.unit.test_status import FORECAST, GIB, T, a_view
from torch_watchdog.sidecar.present import page
from torch_watchdog.sidecar.present.history import History
from torch_watchdog.sidecar.present.page import render_page
from torch_watchdog.sidecar.present.snapshot import Snapshot
from torch_watchdog.sidecar.present.status import build_status

EVIL = '<script>alert("x")</script>'


class Tags(HTMLParser):
    """Every start tag with its attributes, and the text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(doc: str) -> Tags:
    p = Tags()
    p.feed(doc)
    return p


def rendered(view=None) -> str:
    return render_page(build_status(view if view is not None else a_view(), T + 1), T + 1)


def test_key_elements_are_there():
    doc = rendered()
    tags = parse(doc)
    ids = {a.get("id") for _, a in tags.tags}
    assert {"causes", "forecast", "chart", "memory", "graphs", "actions", "sources"} <= ids
    assert ("meta", {"http-equiv": "refresh", "content": "5"}) in tags.tags
    assert any(t == "polyline" and a.get("class") == "memory-line" for t, a in tags.tags)
    assert any(t == "line" and a.get("class") == "mark mark-reload" for t, a in tags.tags)
    assert any(a.get("data-cause") == "cudagraph_per_shape" for _, a in tags.tags)
    text = " ".join(tags.text)
    assert "OOM in ~40 min (discovery model)" in text
    assert "1,983 CUDA graphs for 1,990 distinct shapes" in text
    assert "reload not done: not carried out: dry run" in text
    assert "GPU-a" in text and "13 GiB used of 80 GiB" in text


def test_self_contained_no_script_nothing_fetched():
    doc = rendered()
    tags = parse(doc)
    names = {t for t, _ in tags.tags}
    assert not names & {"script", "link", "img", "iframe", "object", "embed"}
    for tag, attrs in tags.tags:
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name)           # no inline handlers
            if name in ("src", "href"):
                assert not re.match(r"^(https?:)?//", value or ""), (tag, value)
    # the only absolute URL is the SVG namespace, which is a name, not a fetch
    assert set(re.findall(r"https?://[^\s\"'<>)]+", doc)) == {"http://www.w3.org/2000/svg"}
    assert "@import" not in doc and "url(" not in doc


def test_outside_text_is_escaped():
    view = a_view(devices=(), server_gpu_bytes={EVIL: 1})
    h = History()
    h.act(T, "reload_not_done", "oom_forecast", {"outcome": EVIL})
    evil = h.view(view.snapshot, [{"cause": EVIL, "t": T, "note": EVIL}],
                  {"reload_method": EVIL, "version": EVIL})
    doc = rendered(evil)
    tags = parse(doc)
    assert "script" not in {t for t, _ in tags.tags}
    assert EVIL not in doc
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in doc
    assert EVIL in " ".join(tags.text)  # shown, as text


def test_before_the_first_poll_the_page_still_renders():
    tags = parse(render_page(build_status(None, T), T))
    assert "waiting for the first poll" in " ".join(tags.text)
    assert {"causes", "forecast", "chart"} <= {a.get("id") for _, a in tags.tags}


def test_a_chart_failure_leaves_the_rest_of_the_page(monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")
    monkeypatch.setattr(page.plot, "memory_chart", broken)
    doc = rendered()
    assert "chart unavailable" in doc and 'id="forecast"' in doc


def test_thinned_marks_are_said_so():
    h = History(max_marks=10)
    from torch_watchdog import events
    for i in range(100):
        h.observe([events.CudagraphRecord(t=T + i, pid=1, phase="record", compile_id="0/1",
                                          key=[i], shape=None, seconds=0.01)])
    h.update(Snapshot(t=T + 100, server_rss_bytes=1 << 30), [], [])
    doc = rendered(h.view(Snapshot(t=T + 100, server_rss_bytes=1 << 30)))
    assert re.search(r"record: \d+ of 100 marks shown", doc)


def has_budget_line(doc: str) -> bool:
    return any(t in ("line", "path") and a.get("class") == "budget" for t, a in parse(doc).tags)


def test_budget_line_on_the_plotted_scale_or_left_off():
    # the server uses 40 of the device's 48 GiB used; the device may use 79: the server 71
    big = a_view(server_gpu_bytes={"GPU-a": 40 * GIB},
                 forecast={**FORECAST, "level_bytes": 48 * GIB})
    doc = rendered(big)
    assert has_budget_line(doc) and "budget 71 GiB" in doc
    assert "less what other processes use of it (8 GiB)" in doc
    # 5 GiB plotted against 71: the line would squash the series flat, so it is left off
    doc = rendered(a_view())
    assert not has_budget_line(doc)
    assert "budget (79 GiB) left off the chart: the memory plotted is under 10% of it" in doc


def text_of(doc: str) -> str:
    return re.sub(r"\s+", " ", "".join(parse(doc).text))


def test_a_cpu_only_host_shows_host_memory_mode_not_a_red_nvml():
    cpu = a_view(devices=(), server_gpu_bytes={}, server_rss_bytes=700 << 20,
                 sources_up={"nvml": False, "process": True, "agent": True})
    doc = rendered(cpu)
    assert "nvmlnot used: no GPU here (host-memory mode" in text_of(doc)
    assert '<span class="bad">down</span>' not in doc
    # on a GPU host, NVML down is still said in red
    gpu = rendered(a_view(sources_up={"nvml": False, "process": True, "agent": True}))
    assert '<th>nvml</th><td><span class="bad">down</span>' in gpu


def test_the_earliest_time_the_policy_acts_on_is_shown_where_it_is_sooner():
    stairs = a_view(forecast={**FORECAST, "seconds_to_oom": 1080.0,
                              "seconds_to_oom_earliest": 960.0})
    assert "~18 min (at the earliest 16 min: the policy acts on this)" in text_of(
        rendered(stairs))
    same = a_view(forecast={**FORECAST, "seconds_to_oom_earliest": 2400.0})
    assert "at the earliest" not in text_of(rendered(same))


def test_over_budget_says_so_not_a_zero_countdown():
    over = a_view(forecast={**FORECAST, "seconds_to_oom": 0.0, "level_bytes": 80 * GIB})
    text = text_of(rendered(over))
    assert "over budget now" in text and "~0.0 s" not in text and "~0 s" not in text
    assert "over budget: 80 GiB of the 79 GiB budget" in text


def test_after_a_reload_the_counts_say_which_process_they_belong_to():
    from torch_watchdog.sidecar.core.results import ReloadOk
    servers = {"a": {"estimates": None, "forecast": FORECAST, "pids": [4242], "gpus": ["GPU-a"]}}
    view = a_view(servers=servers)
    servers["a"]["estimates"] = view.snapshot.estimates   # the focus: the same dict
    h = History()
    h.update(view.snapshot, [], [ReloadOk(T - 5, "oom_forecast", {"outcome": "ok"}, "a", (17,),
                                          ())])
    doc = rendered(h.view(view.snapshot))
    assert re.search(r"counts of server a \(pid 4242\): its new process, since the reload at "
                     r"\d\d:\d\d:\d\d; the chart and the actions cover the whole run",
                     text_of(doc))
    assert "when the sidecar started watching" in text_of(rendered(a_view()))
