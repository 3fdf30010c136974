"""The report's words (offline/report_html.py): the suggested buckets are the boundaries
shown, and an OOM time is said once."""
from torch_watchdog.sidecar.offline.report_html import _advisor_html, _numbers


def test_the_suggested_bucket_count_is_the_boundaries_shown():
    """Issue 26: "Suggested: 4 buckets" stood above 3 boundaries (fewer sizes than the
    advisor's limit)."""
    row = {"max_buckets": 4, "boundaries": [16, 32, 64], "padding_ratio": 0.05,
           "graphs_before": 3, "graphs_after": 3, "memory_saved_bytes": None}
    html = _advisor_html({"advisor": [row], "mb_per_graph": None}, row, 3)
    assert "Suggested: 3 buckets." in html and "<td class=num>3</td>" in html


def test_an_oom_time_the_linear_trend_gave_is_said_once():
    same = _numbers({"seconds_to_oom": 57.9, "seconds_to_oom_linear": 57.9}, ())
    assert same.count("57.9 s") == 1 and "linear trend" not in same
    other = _numbers({"seconds_to_oom": 20.0, "seconds_to_oom_linear": 57.9}, ())
    assert "linear trend: OOM in 57.9 s" in other
