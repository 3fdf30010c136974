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


def _row(k: int, distinct: int = 40) -> dict:
    return {"boundaries": list(range(1, k + 1)), "padding_ratio": 0.1, "graphs_before": distinct,
            "graphs_after": k, "memory_saved_bytes": None}


def test_the_advisor_counts_what_the_server_compiled_not_one_per_size():
    """A server with automatic dynamic shapes compiled twice for 40 sizes: the advisor said
    "40 → 8 compiles". It says what the server built, and that buckets save no compile."""
    row = _row(8)
    html = _advisor_html({"advisor": [row], "mb_per_graph": None, "distinct": 40,
                          "now": {"what": "compiles", "count": 2}}, row, 3)
    assert "<th>compiles</th>" in html and "2 → 2" in html and "40 →" not in html
    assert "compiled 2 times for 40 sizes" in html and "buckets save no compile" in html
    graphs = _advisor_html({"advisor": [row], "mb_per_graph": None, "distinct": 40,
                            "now": {"what": "CUDA graphs", "count": 37}}, row, 3)
    assert "<th>CUDA graphs</th>" in graphs and "37 → 8" in graphs
    assert "buckets save no compile" not in graphs
