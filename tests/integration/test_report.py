"""`torch-watchdog report` on the recorded GPU traces (tests/fixtures): the numbers and the page."""
import gzip
import html.parser
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from torch_watchdog.sidecar.present import plot

from torch_watchdog.sidecar.offline import report
from torch_watchdog.sidecar.offline.buckets import advise
from torch_watchdog.sidecar.config import Config

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
ROOT = os.path.dirname(os.path.dirname(FIX))
CRASH_T = 123.0231 - 0.2274  # the crash line, from the trace's first line (fixtures/README.md)


def fixture(name: str) -> str:
    return os.path.join(FIX, name)


def make(tmp_path_factory, *names: str) -> tuple[dict, str]:
    out = str(tmp_path_factory.mktemp("report") / "report.html")
    rep = report.write_report([fixture(n) for n in names], out, Config())
    with open(out, encoding="utf-8") as fh:
        return rep, fh.read()


@pytest.fixture(scope="module")
def seq_default(tmp_path_factory):
    return make(tmp_path_factory, "h200-torch2.11-seq-default.jsonl.gz")


@pytest.fixture(scope="module")
def oom(tmp_path_factory):
    return make(tmp_path_factory, "h200-oom300.jsonl.gz")


def svgs(page: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg.*?</svg>", page, re.S)]


def with_class(root: ET.Element, cls: str) -> list:
    return [e for e in root.iter() if cls in (e.get("class") or "").split()]


class Resources(html.parser.HTMLParser):
    """Every tag and every attribute that could load something."""

    def __init__(self):
        super().__init__()
        self.tags, self.refs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href", "srcset", "data", "action")]


def test_seq_default_counts_the_recordings_and_their_cost(seq_default):
    rep, page = seq_default
    s = rep["summary"]
    assert s["recordings"] == 939 and s["distinct_shapes"] == 1604
    assert s["mb_per_graph"] == pytest.approx(0.468, rel=0.10)  # FACTS #2
    assert s["memory_source"] == "process"
    assert s["memory_peak_bytes"] > s["memory_start_bytes"] + 939 * 0.4e6
    assert s["will_oom"] is False and "levels off" in page
    assert [c["cause"] for c in rep["causes"]] == ["cudagraph_per_shape"]
    assert not [a for a in rep["actions"] if a["action"] == "reload"]
    memory = svgs(page)[0]
    assert len(with_class(memory, "mark-record")) == 939
    assert len(with_class(memory, "memory-line")) == 1
    assert "CUDA graph recorded ×939" in ET.tostring(memory, encoding="unicode")


def test_shapes_count_requests_and_the_advisor_matches_advise(seq_default):
    rep, page = seq_default
    sh = rep["shapes"]
    counts = dict(sh["counts"])
    assert sh["basis"] == "requests" and sum(counts.values()) == 3183  # every `req` line
    assert sh["distinct"] == 1604 and len(counts) == 1604  # seq varies, batch is 1
    row = {r["max_buckets"]: r for r in sh["advisor"]}
    assert sorted(row) == [4, 8, 16, 32]
    eight = advise(counts, 8, rep["summary"]["mb_per_graph"] * 1e6)
    assert row[8]["boundaries"] == list(eight.boundaries) and len(eight.boundaries) == 8
    assert row[8]["boundaries"][-1] == max(counts)  # every request fits a bucket
    assert row[8]["padding_tokens"] == eight.padding_tokens
    # the 939 graphs recorded (a size seen once records none) less 8, at ~0.468 MB each
    assert row[8]["memory_saved_bytes"] == pytest.approx((939 - 8) * 0.468e6, rel=0.10)
    assert row[4]["padding_ratio"] > row[8]["padding_ratio"] > row[32]["padding_ratio"]
    best = rep["shapes"]["recommended"]
    assert best["padding_ratio"] <= report.GOOD_PADDING
    assert f"BUCKETS = {tuple(best['boundaries'])}" in page
    assert "cudagraph_capture_sizes" in page and f"{100 * row[8]['padding_ratio']:.1f} %" in page
    hist = svgs(page)[1]
    assert len(with_class(hist, "boundary")) == len(best["boundaries"])
    assert 50 <= len(with_class(hist, "bar")) <= 100


def test_page_is_self_contained_and_parses(seq_default, oom):
    for _, page in (seq_default, oom):
        parser = Resources()
        parser.feed(page)
        assert parser.refs == []
        assert not {"script", "link", "img", "iframe", "object"} & set(parser.tags)
        assert not re.search(r"url\(|@import", page)
        assert not re.search(r"(src|href)\s*=\s*[\"']?https?://", page)
        # the memory chart (and its zoom, when growth sits on a large footprint) and the
        # shape histogram parse as XML
        assert len(svgs(page)) in (2, 3)


def test_oom_trace_shows_the_reload_before_the_crash(oom):
    rep, page = oom
    reloads = [a for a in rep["actions"] if a["action"] == "reload"]
    assert reloads and reloads[0]["t"] < CRASH_T - 10
    chart = rep["chart"]
    (oom_t,) = [t for t, kind in chart["marks"] if kind == "oom"]
    assert oom_t == pytest.approx(CRASH_T, abs=0.01)
    assert rep["summary"]["ooms"] == 1 and "ran out of memory" in page
    assert rep["summary"]["recordings"] == 353
    memory = svgs(page)[0]
    assert len(with_class(memory, "mark-reload")) == 1 and len(with_class(memory, "budget")) == 1
    assert page.index("reload") < page.rindex("oom_forecast")  # listed in the actions table
    assert f"+{plot.human_duration(reloads[0]['t'])}" in page


def test_the_sidecars_own_log_of_a_gpu_oom_is_charted_and_zoomed(tmp_path_factory):
    """The sidecar's sample log of the seed scenario: the chart follows the server process
    while it lived (not the device after the crash), and a zoom shows the growth above the
    140 GB ballast — the reload decision long before the out-of-memory mark."""
    rep, page = make(tmp_path_factory, "h200-seed-oom-samples.jsonl.gz")
    chart = rep["chart"]
    assert rep["summary"]["memory_source"] == "process"
    assert chart["zoom"]["baseline_bytes"] > 140e9
    (reload_t,) = [t for t, kind in chart["marks"] if kind == "reload"]
    (oom_t,) = [t for t, kind in chart["marks"] if kind == "oom"]
    assert oom_t - reload_t > 50
    full, zoom, _histogram = svgs(page)
    assert "zoomed" in "".join(zoom.itertext())
    assert len(with_class(zoom, "mark-record")) == 353 == rep["summary"]["recordings"]


def test_bucketed_control_has_no_causes_and_nine_sizes(tmp_path_factory):
    rep, page = make(tmp_path_factory, "h200-bucketed.jsonl.gz")
    assert rep["causes"] == [] and rep["actions"] == []
    assert "No causes found" in page and "decided nothing" in page
    rows = {r["max_buckets"]: r for r in rep["shapes"]["advisor"]}
    assert rows[16]["boundaries"] == [32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    assert rows[16]["padding_tokens"] == 0 and rows[16]["graphs_after"] == 9


def test_static_trace_marks_the_recompiles_and_the_limit(tmp_path_factory):
    rep, page = make(tmp_path_factory, "h200-torch2.11-seq-static.jsonl.gz")
    counts = rep["chart"]["mark_counts"]
    assert counts["compile"] + counts["recompile"] == 8 and counts["recompile_limit"] == 1
    causes = [c["cause"] for c in rep["causes"]]
    assert "recompile_limit_eager_fallback" in causes and "recompile_storm" in causes
    (limit_t,) = [t for t, k in rep["chart"]["marks"] if k == "recompile_limit"]
    with gzip.open(fixture("h200-torch2.11-seq-static.jsonl.gz"), "rt") as fh:
        first_t = json.loads(fh.readline())["t"]  # report times count from the first line
    assert limit_t == pytest.approx(80.25 - first_t, abs=0.5)  # the 8th compile ended at 80.25 s
    assert "new input sizes now run eager" in page
    assert rep["summary"]["recompile_limit_hit"] == "inferred"
    assert rep["summary"]["recompile_limit"] == 8 and "8, hit (inferred)" in page


def test_agent_log_merged_with_its_trace_lines_up(tmp_path_factory):
    rep, page = make(tmp_path_factory, "h200-oom300.jsonl.gz", "h200-oom300-events.jsonl.gz")
    assert rep["input"]["mixed_time_bases"] is True and "mix time bases" in page
    assert rep["summary"]["span_s"] < 200  # not epoch seconds minus trace seconds
    assert rep["chart"]["marks_outside"] == 0
    assert all(0 <= t <= 130 for t, _ in rep["chart"]["marks"])


def test_agent_log_alone_has_no_memory_chart_but_its_graph_sizes(tmp_path_factory):
    rep, page = make(tmp_path_factory, "h200-oom300-events.jsonl.gz")
    assert "no memory samples yet" in page and rep["summary"]["recordings"] == 353
    assert rep["shapes"]["basis"] == "CUDA-graph sizes" and rep["shapes"]["distinct"] == 1055


def test_progress_is_reported_on_long_inputs():
    class FakeReader(list):
        bad_lines = 3

    from torch_watchdog.sidecar.core.observations import Sample
    from torch_watchdog.sidecar.offline.traces import read_all
    ticks = iter(range(0, 100_000, 10))  # ten "seconds" per clock read
    lines = []
    obs = list(read_all([FakeReader(Sample(t=i) for i in range(20_000))], lines.append,
                        "report", clock=lambda: next(ticks)))
    assert len(obs) == 20_000 and lines
    assert lines[0] == "report: 4,096 records read, 3 bad lines so far"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_watchdog.cli", "report", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_writes_the_page_and_prints_the_numbers(tmp_path):
    out = tmp_path / "r.html"
    done = run_cli(fixture("h200-torch2.11-seq-default.jsonl.gz"), "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr
    numbers = json.loads(done.stdout)
    assert numbers["summary"]["recordings"] == 939 and "points" not in numbers["chart"]
    assert f"wrote {out}" in done.stderr
    assert out.read_text().startswith("<!DOCTYPE html>")


def test_cli_bad_inputs_exit_2_saying_what_to_pass(tmp_path):
    missing = run_cli(str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "r.html"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert "event log" in missing.stderr and "recorded trace" in missing.stderr
    junk = tmp_path / "junk.jsonl.gz"
    with gzip.open(junk, "wt") as fh:
        fh.write("not json\n[1, 2]\n")
    bad = run_cli(str(junk), "-o", str(tmp_path / "r.html"))
    assert bad.returncode == 2 and "2 unreadable line(s)" in bad.stderr
    assert not (tmp_path / "r.html").exists()
    unwritable = run_cli(fixture("h200-bucketed.jsonl.gz"), "-o", str(tmp_path / "no" / "r.html"))
    assert unwritable.returncode == 2 and "cannot write" in unwritable.stderr


def test_agent_event_log_with_watched_shapes(tmp_path):
    from torch_watchdog import events as ev
    t, log = 1.8e9, []
    log.append(ev.Compile(t=t, pid=9, compile_id="0/0", function="forward", seconds=2.0))
    for i in range(1, 8):
        log.append(ev.Recompile(t=t + 10 * i, pid=9, compile_id=f"0/{i}", function="forward",
                                seconds=6.0, reason="size mismatch at index 1"))
    log.append(ev.RecompileLimit(t=t + 81, pid=9, function="forward", limit=8, reason="x",
                                 compile_id="0/7"))
    for i, n in enumerate(range(16, 400, 4)):
        log.append(ev.NewShape(t=t + 90 + i, pid=9, name="llm", shape=[[1, n], [1, n]],
                               seconds=0.2, distinct=i + 1))
    log.append(ev.Oom(t=t + 200, pid=9, source="exception", device=0, requested_bytes=None,
                      limit_bytes=None, free_bytes=None, message="CUDA error: out of memory"))
    path = tmp_path / "events.jsonl"
    path.write_text("".join(ev.encode(e).decode() + "\n" for e in log))
    rep = report.write_report([str(path)], str(tmp_path / "r.html"), Config())
    sh = rep["shapes"]
    assert sh["basis"] == "distinct shapes" and sh["total"] == 96 and sh["rank"] == 4
    assert dict(sh["counts"]) == {n: 1 for n in range(16, 400, 4)}
    assert rep["summary"]["recompile_limit_hit"] == "agent" and rep["summary"]["span_s"] == 200
    assert rep["summary"]["recompile_limit"] == 8
    assert [r["max_buckets"] for r in sh["advisor"]] == [4, 8]  # never more than the limit
    assert [c["cause"] for c in rep["causes"]][-1] == "recompile_limit_eager_fallback"
    page = (tmp_path / "r.html").read_text()
    assert "no memory samples yet" in page
    # it compiled per size and hit its limit: not "one graph serves every size" beside that
    assert "one graph serves" not in page and "hit its recompile limit of 8 after" in page


# -- what a user reading the report sees (issue 9) -------------------------------------------
def page_text(page: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


def test_the_forecast_shown_is_the_one_the_sidecar_reloaded_on(tmp_path_factory):
    """Not "no forecast" next to an oom_forecast alert and a reload: the forecast in force at
    the decision, with the OOM that followed."""
    rep, page = make(tmp_path_factory, "h200-seed-oom-samples.jsonl.gz")
    (decision,) = [a for a in rep["actions"] if a["action"] == "reload"]
    fc = rep["summary"]["forecast"]
    assert fc["basis"] == "reload decision" and fc["t"] == decision["t"]
    assert fc["seconds_to_oom"] == decision["seconds_to_oom"] is not None
    text = page_text(page)
    assert f"forecast at the reload decision (+{plot.human_duration(decision['t'])})" in text
    assert f"OOM in {plot.human_duration(decision['seconds_to_oom'])}" in text
    assert "then it ran out of memory at +" in text and "no forecast" not in text


def test_numbers_are_in_human_units_and_the_advisor_says_what_it_saves(tmp_path_factory):
    rep, page = make(tmp_path_factory, "h200-seed-oom-samples.jsonl.gz")
    text = page_text(page)
    assert not re.search(r"\de[+-]\d", text)              # no "1.01e+03 MiB"
    assert not re.search(r"\d{7,}", text)                 # no raw bytes, no epoch seconds
    assert "budget 140 GiB" in text
    rows = rep["shapes"]["advisor"]
    per_graph = rep["summary"]["mb_per_graph"] * 1e6
    # the graphs the server recorded, less one per bucket
    recorded = rep["summary"]["recordings"]
    assert rep["shapes"]["now"] == {"what": "CUDA graphs", "count": recorded}
    assert all(r["memory_saved_bytes"] == pytest.approx((recorded - r["graphs_after"])
                                                        * per_graph, rel=1e-6) for r in rows)
    assert "memory saved" in text and plot.human_bytes(rows[0]["memory_saved_bytes"]) in text


def test_one_source_for_each_count_and_the_histogram_says_what_it_counts(tmp_path_factory):
    rep, page = make(tmp_path_factory, "h200-seed-oom-samples.jsonl.gz")
    s, sh = rep["summary"], rep["shapes"]
    assert sh["basis"] == "distinct shapes" and s["distinct_shapes"] == sh["distinct"] == 1056
    hist = svgs(page)[-1]
    labels = "".join(hist.itertext())
    # 1,056 sizes over 2,000: each bar a range, and the title says how wide
    assert re.search(r"distinct shapes per \d+ sizes", labels) and "requests" not in labels


def test_two_replicas_are_two_servers_each_with_its_own_story(tmp_path_factory):
    """The two-replica run: replica-a was reloaded (its outcome in the log), replica-b kept
    its pid. Each server has its own section, pids, GPU, counts and forecast; the replay
    raises no cause the live sidecar did not (no unexplained growth after the reload)."""
    rep, page = make(tmp_path_factory, "h200x2-two-replicas-samples.jsonl.gz")
    servers = {s["name"]: s for s in rep["servers"]}
    assert set(servers) == {"replica-a", "replica-b"} and rep["focus"] == "replica-a"
    a, b = servers["replica-a"], servers["replica-b"]
    assert len(a["gpus"]) == len(b["gpus"]) == 1 and a["gpus"] != b["gpus"]
    assert len(a["processes"]) == 2 and len(b["processes"]) == 1  # a's reload: a new process
    assert [c["cause"] for c in rep["causes"]] == ["cudagraph_per_shape"]
    assert {c["server"] for c in rep["causes"]} == {"replica-a"}
    assert [x["action"] for x in rep["actions"] if x["server"] == "replica-a"
            and x["action"] != "alert"][-3:] == ["reload", "execute", "reload_ok"]
    assert not [x for x in rep["actions"] if x["server"] == "replica-b"]
    assert a["summary"]["forecast"]["basis"] == "reload decision"
    assert b["summary"]["forecast"]["basis"] == "end"
    # the bucketed replica's 9 sizes are its own, not mixed with replica-a's
    assert b["shapes"]["distinct"] == 9 and a["shapes"]["distinct"] > 300
    assert a["summary"]["recordings"] + b["summary"]["recordings"] == \
        rep["chart"]["mark_counts"]["record"] + b["chart"]["mark_counts"].get("record", 0)
    text = page_text(page)
    assert "Server replica-a" in text and "Server replica-b" in text
    assert len(svgs(page)) >= 4   # a memory chart and a histogram per server
    # the chart's line is where the server's own memory meets the budget: the GPU's budget
    # less the other processes on it, a number of its own, not a second reading of the budget
    assert a["chart"]["budget_label"] == "budget less other processes"
    assert a["chart"]["budget_bytes"] < a["summary"]["forecast"]["budget_bytes"]
    assert "budget less other processes" in text


def test_budget_is_drawn_from_when_it_applied(tmp_path):
    """The demo's budget comes with a SIGHUP at 55 s: the line starts there, in MiB."""
    from torch_watchdog import events as ev
    from torch_watchdog.sidecar.config import ForecastConfig
    from torch_watchdog.sidecar.core.observations import ConfigChange, ProcessSample, Sample
    import dataclasses
    t0, mib = 1.8e9, 2 ** 20
    later = dataclasses.replace(Config(), forecast=dataclasses.replace(
        ForecastConfig(), process_budget_bytes=1010 * mib))
    obs = [ev.Hello(t=t0, pid=7, torch="2.13", agent="x", devices=[], config={},
                    capabilities={}, watched=["m"], argv="")]
    for i in range(1, 90):
        if i == 55:
            obs.append(ConfigChange(t0 + i, later))
        obs.append(Sample(t=t0 + i, processes=(ProcessSample(7, True, rss_bytes=(400 + i) * mib),),
                          host_total_bytes=64 * 2 ** 30, host_available_bytes=32 * 2 ** 30))
    rep = report.build_report(obs, Config())
    line = rep["chart"]["budget"]
    assert line and line[0][0] == pytest.approx(55, abs=1) and line[-1][1] == 1010 * mib
    page = report.render_html({**rep, "input": {**rep["input"], "bad_lines": 0}})
    (budget,) = with_class(svgs(page)[0], "budget")
    assert budget.tag.endswith("path")
    assert "budget 0.986 GiB" in page_text(page) and "e+03" not in page


def test_the_advisor_never_proposes_more_buckets_than_the_recompile_limit(tmp_path):
    """dynamic=False compiles per size: with a limit of 4, a fifth bucket runs eager."""
    from torch_watchdog import events as ev
    t, log = 1.8e9, [ev.Hello(t=1.8e9, pid=9, torch="2.13", agent="x", devices=[],
                              config={"recompile_limit": 4}, capabilities={}, watched=["m"],
                              argv="")]
    log.append(ev.Compile(t=t, pid=9, compile_id="0/0", function="forward", seconds=2.0))
    for i in range(1, 4):
        log.append(ev.Recompile(t=t + i, pid=9, compile_id=f"0/{i}", function="forward",
                                seconds=1.0, reason="size mismatch at index 1"))
    log.append(ev.RecompileLimit(t=t + 5, pid=9, function="forward", limit=4, reason="x",
                                 compile_id="0/3"))
    for i, n in enumerate(range(16, 400, 4)):
        log.append(ev.NewShape(t=t + 10 + i, pid=9, name="m", shape=[[1, n]], seconds=0.2,
                               distinct=i + 1))
    rep = report.build_report(log, Config())
    rows = rep["shapes"]["advisor"]
    assert [r["max_buckets"] for r in rows] == [4]
    assert rep["shapes"]["recommended"]["graphs_after"] <= 4
    page = page_text(report.render_html({**rep, "input": {**rep["input"], "bad_lines": 0}}))
    assert "4, hit (reported by the agent)" in page and "recompile limit of 4" in page
    assert "this server's limit is 4" in page


def test_the_memory_line_breaks_between_a_reload_and_the_new_process():
    """Nothing is measured between the reload and the new process's first sample: the line
    stops at the old process's last point and starts again at the new one's, not a slope
    across the gap that no process had."""
    from torch_watchdog import events as ev
    from torch_watchdog.sidecar.core.observations import (DeviceSample, ProcessSample,
                                                          ReloadOutcome, Sample)
    t0, gib = 1.8e9, 2 ** 30

    def sample(t: float, pid: int, alive: bool, used: int) -> Sample:
        return Sample(t=t, devices=(DeviceSample("GPU-a", used, 80 * gib, 80 * gib - used),),
                      processes=(ProcessSample(pid, alive, gib, {"GPU-a": used} if alive
                                               else {}),))

    def hello(t: float, pid: int) -> ev.Hello:
        return ev.Hello(t=t, pid=pid, torch="2.13", agent="x", devices=["GPU-a"], config={},
                        capabilities={}, watched=["m"], argv="", server="srv")

    obs = [hello(t0, 10)]
    obs += [sample(t0 + i, 10, True, (20 + i) * gib) for i in range(1, 30)]  # 21 -> 49 GiB
    obs.append(ReloadOutcome(True, "reloaded", 1.0).at(t0 + 30, "srv"))
    obs += [sample(t0 + i, 10, False, 0) for i in range(30, 40)]             # nobody's
    obs.append(hello(t0 + 40, 20))
    obs += [sample(t0 + i, 20, True, 10 * gib) for i in range(40, 60)]       # 10 GiB
    rep = report.build_report(obs, Config())
    assert rep["chart"]["breaks"] == [pytest.approx(40, abs=0.01)]
    page = report.render_html({**rep, "input": {**rep["input"], "bad_lines": 0}})
    old, new = with_class(svgs(page)[0], "memory-line")
    xs = lambda line: [float(p.split(",")[0]) for p in line.get("points").split()]  # noqa
    assert len(xs(old)) == 29 and len(xs(new)) == 20
    assert xs(old)[-1] < xs(new)[0]  # two stretches, one after the other, with the gap between
    assert "breaks" not in report.numbers(rep)["chart"]  # --json: the page's numbers only


def test_a_chart_without_breaks_is_one_line_and_breaks_cut_it():
    points = [(float(t), float(t)) for t in range(10)]
    assert len(with_class(ET.fromstring(plot.memory_chart(points)), "memory-line")) == 1
    cut = with_class(ET.fromstring(plot.memory_chart(points, breaks=[3.5, 7.0, 100.0])),
                     "memory-line")
    assert [len(line.get("points").split()) for line in cut] == [4, 3, 3]


def test_a_server_has_its_own_span():
    """The sidecar watched 100 s; the server lived from +20 s to +80 s, growing 2 GiB in its
    first 20 s then flat. The report gave the server the whole log's span ("trace span") and
    drew its last reading on, flat, after it died."""
    from torch_watchdog import events as ev
    from torch_watchdog.sidecar.core.observations import ProcessSample, Sample
    t0, gib = 1.8e9, 2 ** 30
    obs: list = [Sample(t=t0 + i, host_total_bytes=8 * gib, host_available_bytes=4 * gib)
                 for i in range(20)]
    obs.append(ev.Hello(t=t0 + 20, pid=7, torch="2.13", agent="x", devices=[], config={},
                        capabilities={}, watched=["m"], argv=""))
    obs.append(ev.Compile(t=t0 + 21, pid=7, compile_id="0/0", function="forward", seconds=1.0))
    for i in range(20, 100):
        alive = i < 80
        rss = int(min(i - 20, 20) / 20 * 2 * gib + gib)
        obs.append(Sample(t=t0 + i, processes=(ProcessSample(7, alive, rss if alive else None),),
                          host_total_bytes=8 * gib, host_available_bytes=6 * gib - rss))
    rep = report.build_report(obs, Config())
    s = rep["summary"]
    assert s["span_s"] == pytest.approx(59, abs=1.5) and s["seen_from_s"] == pytest.approx(20)
    assert rep["input"]["span_s"] == pytest.approx(99)
    assert rep["chart"]["points"][-1][0] == 79  # the line stops where it died, not flat to 99
    page = page_text(report.render_html({**rep, "input": {**rep["input"], "bad_lines": 0}}))
    assert "server seen for 59 s (from +20 s)" in page and "over 1 min 39 s" in page


def test_a_cause_s_numbers_read_as_words_and_units_once():
    """The cause table read "unexplained mb 257 MiB": the unit in the name and the value."""
    from torch_watchdog.sidecar.offline.report_html import _numbers
    text = _numbers({"unexplained_mb": 257.0, "growth_mb": 332.0, "cause": "x"}, ("cause",))
    assert text == "unexplained 245 MiB, growth 317 MiB"
