"""The /metrics view of a Snapshot: exact values, names, absence of unknowns, never a failing
scrape. Served over HTTP, and checked by promtool: tests/integration/test_metrics_http.py."""
from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from torch_watchdog.sidecar.present import metrics
from torch_watchdog.sidecar.core.correlate import CAUSES
from torch_watchdog.sidecar.present.metrics import SnapshotCollector, make_registry, render
from torch_watchdog.sidecar.core.observations import DeviceSample
from torch_watchdog.sidecar.present.snapshot import Processes, Snapshot

GIB = 1 << 30
ESTIMATES = {
    "mb_per_graph": 12.5, "mb_per_graph_confidence": 0.9, "recordings": 40, "warmups": 41,
    "distinct_shapes": 45, "requests": 1000, "compiles": 3, "recompiles": 2,
    "compile_seconds": 12.25, "fx_cache_hits": 6, "fx_cache_misses": 1,
    "recompile_limit_hits": 1, "graph_breaks": 4, "stalls": 5,
    "stall_seconds": 2.5, "ooms": 0, "memory_source": "process", "memory_bytes": 20 * GIB,
    "memory_growth_bytes": GIB, "explained_by_recordings_bytes": 500_000_000,
    "unexplained_bytes": 1_000_000, "device_used_bytes": 30 * GIB,
    "device_total_bytes": 80 * GIB, "steady_ms": 8.0, "steady_ms_after_fallback": None,
    "padding": {"llm": {"on": True, "buckets": [256, 512], "real_tokens": 900,
                        "padding_tokens": 100, "padding_fraction": 0.1, "recordings_saved": 40,
                        "checks": 3, "check_seconds": 0.25, "max_error": {"float16": 0.002}}},
}
FORECAST = {
    "seconds_to_oom": 1234.5, "seconds_to_oom_earliest": 1000.0, "seconds_to_oom_linear": 5000.0,
    "seconds_to_oom_discovery": 1234.5,
    "plateau_bytes": 90e9, "will_oom": True, "budget_bytes": 76 * GIB, "level_bytes": 30 * GIB,
    "shape_space_estimate": 120.0, "growth_bytes_per_s": 1e6,
    "seconds_to_oom_unexplained": None, "unexplained_bytes_per_s": 0.0, "driver": "recordings",
    "gpu_uuid": "GPU-aaa",
}


def snapshot(**overrides) -> Snapshot:
    fields = dict(
        t=1_700_000_000.5,
        devices=(DeviceSample("GPU-aaa", 30 * GIB, 80 * GIB, 50 * GIB),
                 DeviceSample("GPU-bbb", 1 * GIB, 80 * GIB, None)),
        server_gpu_bytes={"GPU-aaa": 20 * GIB, "GPU-bbb": None},
        server_rss_bytes=3 * GIB, server_alive=True,
        estimates=dict(ESTIMATES), forecast=dict(FORECAST),
        active_causes=("cudagraph_per_shape",),
        actions_total={"alert": 2, "reload": 1},
        processes={"default": Processes(True, 3 * GIB, {"GPU-aaa": 20 * GIB, "GPU-bbb": None})},
        server_actions_total={("default", "alert"): 2, ("default", "reload"): 1},
        sources_up={"nvml": True, "process": True, "agent": False},
        poll_seconds=0.04, nvml_query_seconds=0.012, events_received_total=777,
        events_skewed_total=3,
        source_errors_total={("nvml", "late"): 2, ("nvml", "NVMLError_GpuIsLost"): 1},
        events_dropped_total={"bad_json": 3, "foreign_pid": 1}, agent_events_lost_total=9,
        alerts_sent_total={"http://am:9093": 4}, alert_posts_failed_total={"http://am:9093": 1},
        alerts_dropped_total={"http://am:9093": 0}, poll_errors_total={"decide": 1})
    fields.update(overrides)
    return Snapshot(**fields)


def scrape(snap=None, collector=None) -> dict:
    """{(sample name, frozenset(labels)): value} plus the parsed families under key None."""
    collector = collector or SnapshotCollector()
    if snap is not None:
        collector.update(snap)
    return parse(render(make_registry(collector)).decode())


def parse(text: str) -> dict:
    families = list(text_string_to_metric_families(text))
    out = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    out[None] = families
    return out


PER_SERVER = {spec.name for spec in metrics.SPECS if spec.labels[:1] == ("server",)}


def value(samples, name, **labels):
    """A sample's value; a per-server family of a Snapshot without servers is "default"."""
    if name in PER_SERVER:
        labels.setdefault("server", "default")
    return samples[(name, frozenset(labels.items()))]


def names(samples) -> set:
    return {key[0] for key in samples if key is not None}


def test_device_and_server_memory_per_gpu_uuid():
    s = scrape(snapshot())
    assert value(s, "torch_watchdog_gpu_memory_used_bytes", gpu_uuid="GPU-aaa") == 30 * GIB
    assert value(s, "torch_watchdog_gpu_memory_used_bytes", gpu_uuid="GPU-bbb") == 1 * GIB
    assert value(s, "torch_watchdog_gpu_memory_total_bytes", gpu_uuid="GPU-bbb") == 80 * GIB
    assert value(s, "torch_watchdog_gpu_memory_free_bytes", gpu_uuid="GPU-aaa") == 50 * GIB
    # None is "unknown": absent, never 0
    assert ("torch_watchdog_gpu_memory_free_bytes", frozenset({("gpu_uuid", "GPU-bbb")})) not in s
    assert value(s, "torch_watchdog_server_gpu_memory_bytes", gpu_uuid="GPU-aaa") == 20 * GIB
    assert ("torch_watchdog_server_gpu_memory_bytes",
            frozenset({("gpu_uuid", "GPU-bbb"), ("server", "default")})) not in s
    assert value(s, "torch_watchdog_server_rss_bytes") == 3 * GIB
    assert value(s, "torch_watchdog_server_up") == 1


@pytest.mark.parametrize("alive, expected", [(True, 1), (False, 0), (None, None)])
def test_server_up_is_absent_when_unknown(alive, expected):
    s = scrape(snapshot(processes={"default": Processes(alive, None, {})}))
    assert "torch_watchdog_server_rss_bytes" not in names(s)
    if expected is None:
        assert "torch_watchdog_server_up" not in names(s)
    else:
        assert value(s, "torch_watchdog_server_up") == expected


@pytest.mark.parametrize("name, expected", [
    ("torch_watchdog_cudagraph_recordings_total", 40),
    ("torch_watchdog_cudagraph_warmups_total", 41),
    ("torch_watchdog_compiles_total", 3),
    ("torch_watchdog_recompiles_total", 2),
    ("torch_watchdog_recompile_limit_hits_total", 1),
    ("torch_watchdog_stalls_total", 5),
    ("torch_watchdog_stall_seconds_total", 2.5),
    ("torch_watchdog_graph_breaks_total", 4),
    ("torch_watchdog_ooms_total", 0),
    ("torch_watchdog_compile_seconds_total", 12.25),
    ("torch_watchdog_fx_cache_hits_total", 6),
    ("torch_watchdog_fx_cache_misses_total", 1),
    ("torch_watchdog_requests_total", 1000),
    ("torch_watchdog_distinct_shapes", 45),
    ("torch_watchdog_cudagraph_memory_per_graph_bytes", 12.5e6),
    ("torch_watchdog_cudagraph_memory_per_graph_confidence_ratio", 0.9),
    ("torch_watchdog_memory_unexplained_bytes", 1_000_000),
    ("torch_watchdog_memory_explained_by_recordings_bytes", 500_000_000),
    ("torch_watchdog_oom_forecast_seconds", 1234.5),
    ("torch_watchdog_oom_forecast_earliest_seconds", 1000.0),
    ("torch_watchdog_oom_forecast_linear_seconds", 5000.0),
    ("torch_watchdog_memory_plateau_bytes", 90e9),
    ("torch_watchdog_memory_budget_bytes", 76 * GIB),
    ("torch_watchdog_shape_space_estimate", 120.0),
    ("torch_watchdog_poll_duration_seconds", 0.04),
    ("torch_watchdog_nvml_query_seconds", 0.012),
    ("torch_watchdog_events_received_total", 777),
    ("torch_watchdog_agent_events_lost_total", 9),
    ("torch_watchdog_events_skewed_total", 3),
    ("torch_watchdog_last_poll_timestamp_seconds", 1_700_000_000.5),
    ("torch_watchdog_scrape_errors_total", 0),
])
def test_scalar_values(name, expected):
    assert value(scrape(snapshot()), name) == pytest.approx(expected)


def test_counters_are_typed_counter_and_end_in_total():
    families = {f.name: f for f in scrape(snapshot())[None]}
    for name, kind, _, _ in metrics.METRICS:
        assert name.startswith("torch_watchdog_")
        assert name.endswith("_total") == (kind == "counter"), name
        if kind == "counter":  # the parser names a counter family without its _total
            assert families[name[:-len("_total")]].type == "counter"


def test_nvml_series_are_left_out_where_nvml_is_not_used():
    s = scrape(snapshot(nvml_in_use=False, sources_up={"nvml": False, "process": True}))
    assert "torch_watchdog_nvml_query_seconds" not in names(s)
    assert ("torch_watchdog_source_up", frozenset({("source", "nvml")})) not in s
    assert "torch_watchdog_source_errors_total" not in names(s)
    assert value(s, "torch_watchdog_source_up", source="process") == 1


def test_labelled_families():
    s = scrape(snapshot())
    assert value(s, "torch_watchdog_actions_total", action="alert") == 2
    assert value(s, "torch_watchdog_actions_total", action="reload") == 1
    assert value(s, "torch_watchdog_events_dropped_total", reason="bad_json") == 3
    assert value(s, "torch_watchdog_events_dropped_total", reason="foreign_pid") == 1
    assert value(s, "torch_watchdog_source_up", source="nvml") == 1
    assert value(s, "torch_watchdog_source_up", source="agent") == 0
    assert value(s, "torch_watchdog_source_errors_total", source="nvml", reason="late") == 2


def test_every_cause_exported_active_one_others_zero():
    s = scrape(snapshot(active_causes=("recompile_storm",)))
    for cause in CAUSES:
        expected = 1 if cause == "recompile_storm" else 0
        assert value(s, "torch_watchdog_cause_active", cause=cause) == expected
    assert len([k for k in s if k and k[0] == "torch_watchdog_cause_active"]) == len(CAUSES) == 4


def test_no_forecast_is_plus_inf_and_unknown_estimates_are_absent():
    fc = dict(FORECAST, seconds_to_oom=None, seconds_to_oom_earliest=None,
              seconds_to_oom_linear=None, plateau_bytes=None, budget_bytes=None,
              shape_space_estimate=None)
    est = dict(ESTIMATES, mb_per_graph=None, mb_per_graph_confidence=None)
    s = scrape(snapshot(forecast=fc, estimates=est))
    assert value(s, "torch_watchdog_oom_forecast_seconds") == math.inf
    assert value(s, "torch_watchdog_oom_forecast_linear_seconds") == math.inf
    assert value(s, "torch_watchdog_oom_forecast_earliest_seconds") == math.inf
    for name in ("torch_watchdog_memory_plateau_bytes", "torch_watchdog_memory_budget_bytes",
                 "torch_watchdog_shape_space_estimate",
                 "torch_watchdog_cudagraph_memory_per_graph_bytes",
                 "torch_watchdog_cudagraph_memory_per_graph_confidence_ratio"):
        assert name not in names(s)
    assert "+Inf means no OOM forecast" in render_help("torch_watchdog_oom_forecast_seconds")


def render_help(name: str) -> str:
    return next(h for n, _, _, h in metrics.METRICS if n == name)


def test_no_pid_or_shape_labels_anywhere():
    s = scrape(snapshot())
    labels = {label for key in s if key is not None for label, _ in key[1]}
    # all bounded: device UUIDs, servers (configured or announced), the four causes, actions,
    # reasons, sources, configured URLs, padded models and their plans' buckets (at most
    # max_buckets each) and output dtypes
    assert labels == {"gpu_uuid", "server", "cause", "action", "reason", "source", "url",
                      "model", "bucket", "dtype", "stage", "host"}
    assert {label for _, _, ls, _ in metrics.METRICS for label in ls} == labels


def test_every_family_has_a_one_line_help():
    for family in scrape(snapshot())[None]:
        assert family.documentation and "\n" not in family.documentation, family.name
    assert len({n for n, *_ in metrics.METRICS}) == len(metrics.METRICS)


def test_garbage_values_skip_their_family_and_count_scrape_errors():
    collector = SnapshotCollector()
    bad = snapshot(estimates=dict(ESTIMATES, recordings="lots", mb_per_graph="12.5"),
                   forecast=dict(FORECAST, budget_bytes=[1]))
    first = scrape(bad, collector)
    assert value(first, "torch_watchdog_scrape_errors_total") == 3
    for name in ("torch_watchdog_cudagraph_recordings_total",
                 "torch_watchdog_cudagraph_memory_per_graph_bytes",
                 "torch_watchdog_memory_budget_bytes"):
        assert name not in names(first)
    assert value(first, "torch_watchdog_compiles_total") == 3  # the rest is still there
    # cumulative across scrapes; a good snapshot stops the growth
    assert value(scrape(None, collector), "torch_watchdog_scrape_errors_total") == 6
    collector.update(snapshot())
    good = scrape(None, collector)
    assert value(good, "torch_watchdog_scrape_errors_total") == 6
    assert value(good, "torch_watchdog_cudagraph_recordings_total") == 40


def test_broken_snapshot_object_never_raises():
    collector = SnapshotCollector()
    collector.update(object())  # not even a Snapshot: every family fails, the scrape does not
    s = scrape(None, collector)
    # all but the errors' own and the host's (which reads no Snapshot)
    assert value(s, "torch_watchdog_scrape_errors_total") == len(metrics.METRICS) - 2
    assert value(s, "torch_watchdog_host_info", host=metrics.host_name()) == 1


def test_empty_collector_renders_only_self_metrics_with_zeros():
    s = scrape()
    assert value(s, "torch_watchdog_scrape_errors_total") == 0
    assert value(s, "torch_watchdog_events_received_total") == 0
    assert value(s, "torch_watchdog_agent_events_lost_total") == 0
    assert value(s, "torch_watchdog_last_poll_timestamp_seconds") == 0
    assert value(s, "torch_watchdog_host_info", host=metrics.host_name()) == 1
    assert "torch_watchdog_gpu_memory_used_bytes" not in names(s)
    assert "torch_watchdog_cause_active" not in names(s)
    assert "torch_watchdog_oom_forecast_seconds" not in names(s)


def test_registry_is_not_the_global_one():
    from prometheus_client import REGISTRY
    registry = make_registry(SnapshotCollector())
    assert registry is not REGISTRY
    assert b"python_gc" not in render(registry)


def test_real_pipeline_output_renders_without_errors():
    """The keys the table reads are the keys correlate/forecast produce (a rename upstream would
    silently drop a metric otherwise): a fresh state's dicts render with no scrape error."""
    from torch_watchdog.sidecar.config import CorrelateConfig, ForecastConfig
    from torch_watchdog.sidecar.core.correlate import State
    from torch_watchdog.sidecar.core.forecast import forecast
    state = State()
    est, fc = state.estimates(CorrelateConfig()), forecast(state, ForecastConfig()).as_dict()
    assert set(ESTIMATES) == set(est) and set(FORECAST) == set(fc)
    s = scrape(snapshot(estimates=est, forecast=fc))
    assert value(s, "torch_watchdog_scrape_errors_total") == 0
    assert value(s, "torch_watchdog_cudagraph_recordings_total") == 0
    assert value(s, "torch_watchdog_oom_forecast_seconds") == math.inf


def test_padding_per_model_on_off_plan_fraction_and_recordings_saved():
    s = scrape(snapshot())
    labels = {"server": "default", "model": "llm"}
    assert value(s, "torch_watchdog_padding_on", **labels) == 1
    assert value(s, "torch_watchdog_padding_buckets", **labels) == 2
    assert value(s, "torch_watchdog_padding_plan", bucket="512", **labels) == 1
    assert value(s, "torch_watchdog_padding_fraction_ratio", **labels) == pytest.approx(0.1)
    assert value(s, "torch_watchdog_padding_tokens_total", **labels) == 100
    assert value(s, "torch_watchdog_padding_recordings_saved", **labels) == 40
    assert value(s, "torch_watchdog_padding_check_seconds_total", **labels) == 0.25
    assert value(s, "torch_watchdog_padding_max_error_ratio", dtype="float16",
                 **labels) == pytest.approx(0.002)
    off = dict(ESTIMATES, padding={"llm": {**ESTIMATES["padding"]["llm"], "on": False}})
    assert value(scrape(snapshot(estimates=off)), "torch_watchdog_padding_on", **labels) == 0
    without = dict(ESTIMATES, padding={})
    assert "torch_watchdog_padding_on" not in names(scrape(snapshot(estimates=without)))


@pytest.mark.parametrize("gpu_seen, error, in_use", [
    (True, "NVML read late: no answer for 1.20 s", True),      # a GPU host, NVML slow
    (False, "NVML unavailable: ModuleNotFoundError: No module named 'pynvml'", False),
    (False, "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found",
     False),
    (False, "NVML unavailable: NVMLError_DriverNotLoaded: Driver Not Loaded", False),
    (False, "NVML unavailable: NVMLError_NoPermission: Insufficient Permissions", True),
    (False, "NVML not read yet", False),
    (False, None, False),
])
def test_nvml_is_a_source_where_it_listed_a_gpu_or_fails_on_a_gpu_host(gpu_seen, error, in_use):
    from torch_watchdog.sidecar.present.publisher import nvml_in_use
    assert nvml_in_use(gpu_seen, error) is in_use


def test_a_server_whose_processes_are_all_gone_drops_its_series_at_once():
    """Its last forecast (191.8 s) kept in /metrics would page through a rule on it
    (TorchCompileOomSoon) for a server that is gone, wherever the step still shows it (while
    it is down and its reload's alerts fire)."""
    held = {"reason": "cooldown", "until_t": 2e9}
    views = {name: {"estimates": dict(ESTIMATES), "active_causes": ("cudagraph_per_shape",),
                    "forecast": dict(FORECAST, seconds_to_oom=191.8), "label": name,
                    "held": held, "pids": [1], "gpus": ["GPU-aaa"], "up": up}
             for name, up in (("live", True), ("dead", False), ("unread", None))}
    procs = {"live": Processes(True, GIB, {"GPU-aaa": GIB}),
             "dead": Processes(False, None, {}),
             "unread": Processes(None, None, {})}
    snap = snapshot(servers=views, processes=procs,
                    server_actions_total={("dead", "reload_failed"): 1, ("live", "alert"): 2})
    s = scrape(snap)
    by_family: dict = {}  # server -> the families it has a series in
    for key in s:
        if key is not None and "server" in dict(key[1]):
            by_family.setdefault(dict(key[1])["server"], set()).add(key[0])
    # what stays of the dead one: that it is down, and the sidecar's own counts
    assert by_family["dead"] == {"torch_watchdog_server_up", "torch_watchdog_actions_total"}
    assert value(s, "torch_watchdog_server_up", server="dead") == 0
    assert value(s, "torch_watchdog_actions_total", server="dead",
                 action="reload_failed") == 1
    # the live one and one whose processes were not read (up None) keep every series
    for name in ("live", "unread"):
        assert value(s, "torch_watchdog_oom_forecast_seconds", server=name) == 191.8
        assert value(s, "torch_watchdog_cause_active", server=name,
                     cause="cudagraph_per_shape") == 1
        assert value(s, "torch_watchdog_reload_held_until_timestamp_seconds", server=name,
                     reason="cooldown") == 2e9
        assert value(s, "torch_watchdog_padding_on", server=name, model="llm") == 1
    assert by_family["live"] > {"torch_watchdog_server_rss_bytes",
                                "torch_watchdog_server_gpu_memory_bytes"}
