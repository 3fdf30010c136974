"""The Prometheus view of the latest Snapshot: a custom Collector, its registry, its HTTP server.

The daemon polls on its own timer (prediction needs history), so a scrape does not read the GPU:
it renders whatever Snapshot the loop last handed to `SnapshotCollector.update()`, and
`torch_watchdog_last_poll_timestamp_seconds` says when that was. A scrape never raises: a family
that cannot be built is left out and counted in `torch_watchdog_scrape_errors_total`.

Conventions (Prometheus's naming practice): prefix `torch_watchdog_`, base units, counters end
in `_total`, GPUs labelled `gpu_uuid`, per-server families labelled `server` (its label,
core/labels.py: the same over its restarts and reloads, one per server); nothing per server is
summed over servers; no pid or shape labels (they are unbounded). A reading
that is unknown (`None`) is absent, never 0 — except the OOM forecasts, where "no forecast" is
exported as +Inf so that `torch_watchdog_oom_forecast_seconds < 600` alerts work unchanged.

A server whose processes are all gone (its view's `up` False, from the poll its last one
exits: a server the step still shows while it is down, as while its reload's alerts fire) is
neither plotted nor forecast: every series of its readings, forecast, causes, padding and
holds goes at once, so a rule on them (an OOM forecast kept at its last value) cannot fire for
a dead server. What stays: `torch_watchdog_server_up` 0 (it is down) and
`torch_watchdog_actions_total` (the sidecar's own counts, which a failed reload's rule reads
once the server is gone), for an hour after the server's last poll (publisher.ACTIONS_KEPT_S,
the shipped rules' longest window over it), then dropped: a name per start (`pgid:N`) would
otherwise add series for good.

`torch_watchdog_host_info{host}` (always 1) names the host as the sidecar's alerts do (`host`,
socket.gethostname()): the shipped rules join it onto their alerts so that Alertmanager's
inhibit rules pair them with the sidecar's own (config/prometheus/,
config/alertmanager-example.yml).
"""
from __future__ import annotations

import logging
import math
import numbers
import socket
import threading
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from torch_watchdog.sidecar.core.correlate import CAUSES
from torch_watchdog.sidecar.present.snapshot import Snapshot

log = logging.getLogger(__name__)

GAUGE, COUNTER = "gauge", "counter"
SCRAPE_ERRORS = "torch_watchdog_scrape_errors_total"
# A padding plan's buckets are labels (bounded: the agent's max_buckets, 8 by default; a plan
# only grows, so a series never goes away): at most this many per model.
MAX_BUCKET_LABELS = 64
# One sample: (label values, raw value); a raw value of None is skipped (the reading is unknown).
Samples = Iterable["tuple[tuple[str, ...], Any]"]


class Spec(NamedTuple):
    name: str                      # the exposed name (counters with their `_total`)
    kind: str                      # GAUGE | COUNTER
    labels: tuple[str, ...]
    help: str
    samples: Callable[[Snapshot], Samples]
    before_first_poll: bool = False  # exported (from an empty Snapshot) before the first update


# --- sample getters ---------------------------------------------------------------------------

def _num(value: Any) -> float:
    # Strict on purpose: a string here is a bug upstream, to be counted, not silently parsed.
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"not a number: {value!r}")


def _one(get: Callable[[Snapshot], Any]) -> Callable[[Snapshot], Samples]:
    return lambda s: [((), get(s))]


def _device(attr: str) -> Callable[[Snapshot], Samples]:
    return lambda s: [((str(d.uuid),), getattr(d, attr)) for d in s.devices]


def _by_label(attr: str) -> Callable[[Snapshot], Samples]:
    return lambda s: [((str(k),), v) for k, v in sorted(getattr(s, attr).items())]


def _gone(s: Snapshot, name: str) -> bool:
    """The server's processes are all gone (read dead this poll); None (none read) is not."""
    view = s.servers.get(name)
    return view is not None and view.get("up") is False


def _label(s: Snapshot, name: str) -> str:
    """A server's `server` label (core/labels.py): stable over its restarts, one per server."""
    view = s.servers.get(name)
    return str(view.get("label") or name) if view else name


def _servers(s: Snapshot) -> list[Any]:
    """(server label, estimates, forecast, active causes) of each server whose processes are
    not all gone, in label order; a Snapshot built without servers (an old caller) is one
    server, "default"."""
    if s.servers:
        return sorted((_label(s, name), v.get("estimates", {}), v.get("forecast", {}),
                       v.get("active_causes", ())) for name, v in s.servers.items()
                      if v.get("up") is not False)
    if s.estimates or s.forecast:
        return [("default", s.estimates, s.forecast, s.active_causes)]
    return []


def _est(key: str, scale: float = 1.0) -> Callable[[Snapshot], Samples]:
    def get(s: Snapshot) -> Samples:
        return [((name,), None if est.get(key) is None else _num(est[key]) * scale)
                for name, est, _, _ in _servers(s)]
    return get


def _fc(key: str) -> Callable[[Snapshot], Samples]:
    return lambda s: [((name,), fc.get(key)) for name, _, fc, _ in _servers(s)]


def _fc_seconds(key: str) -> Callable[[Snapshot], Samples]:
    # None (or no forecast at all) means "no OOM in sight": +Inf, so thresholds never fire.
    return lambda s: [((name,), math.inf if fc.get(key) is None else fc[key])
                      for name, _, fc, _ in _servers(s)]


def _causes(s: Snapshot) -> Samples:
    return [((name, cause), 1 if cause in active else 0) for name, _, _, active in _servers(s)
            for cause in CAUSES]


def _padded(s: Snapshot) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(server, model, padding view) of every model padded by the agent (`watch(pad=...)`)."""
    for name, est, _, _ in _servers(s):
        for model, v in sorted((est.get("padding") or {}).items()):
            yield name, str(model), v


def _pad(key: str, get: Optional[Callable[[dict[str, Any]], Any]] = None,
         ) -> Callable[[Snapshot], Samples]:
    return lambda s: [((name, model), get(v) if get else v.get(key))
                      for name, model, v in _padded(s)]


def _pad_buckets(s: Snapshot) -> Samples:
    return [((name, model, str(b)), 1) for name, model, v in _padded(s)
            for b in list(v.get("buckets") or ())[:MAX_BUCKET_LABELS]]


def _pad_errors(s: Snapshot) -> Samples:
    return [((name, model, str(dtype)), err) for name, model, v in _padded(s)
            for dtype, err in sorted((v.get("max_error") or {}).items())]


def _in_use(s: Snapshot, source: str) -> bool:
    """NVML is left out where it is no source of the sidecar's (no GPU stack on the host)."""
    return source != "nvml" or s.nvml_in_use


def _sources(s: Snapshot) -> Samples:
    return [((str(k),), None if v is None else int(bool(v)))
            for k, v in sorted(s.sources_up.items()) if _in_use(s, str(k))]


def _source_errors(s: Snapshot) -> Samples:
    return [((src, reason), n) for (src, reason), n in sorted(s.source_errors_total.items())
            if _in_use(s, src)]


def _procs(get: Callable[[Any], Any], gone_too: bool = False) -> Callable[[Snapshot], Samples]:
    """One sample per server from its processes' reading (snapshot.Processes); a server whose
    processes are all gone only where `gone_too` (its `up`)."""
    return lambda s: sorted(((_label(s, name),), get(p)) for name, p in s.processes.items()
                            if gone_too or not _gone(s, name))


def _procs_gpu(s: Snapshot) -> Samples:
    return sorted(((_label(s, name), str(uuid)), used) for name, p in s.processes.items()
                  if not _gone(s, name) for uuid, used in p.gpu_bytes.items())


def _actions(s: Snapshot) -> Samples:
    return [((label, action), n) for (label, action), n in sorted(s.server_actions_total.items())]


def _held(s: Snapshot) -> Samples:
    """A reload held back: until when (+Inf: no end known), per server and reason."""
    return sorted(((_label(s, name), str(v["held"]["reason"])),
                   math.inf if v["held"].get("until_t") is None else v["held"]["until_t"])
                  for name, v in s.servers.items() if v.get("held") and not _gone(s, name))


def _frozen(s: Snapshot) -> Samples:
    """1 while the server's recording is frozen, 0 once asked and not (or no longer) frozen."""
    return sorted(((_label(s, name),), 1.0 if v["freeze"]["frozen"] else 0.0)
                  for name, v in s.servers.items()
                  if (v.get("freeze") or {}).get("asked_t") is not None and not _gone(s, name))


def host_name() -> str:
    """This host's name, as the sidecar's alerts carry it in `host` (actions/alerting.py)."""
    return socket.gethostname()


# --- the table --------------------------------------------------------------------------------

_G = ("gpu_uuid",)
_S = ("server",)  # per server: a group of processes reloaded together
SPECS: tuple[Spec, ...] = (
    # device (NVML)
    Spec("torch_watchdog_gpu_memory_used_bytes", GAUGE, _G,
         "GPU memory used by all processes, from NVML, at the last poll.", _device("used_bytes")),
    Spec("torch_watchdog_gpu_memory_total_bytes", GAUGE, _G,
         "GPU memory size, from NVML.", _device("total_bytes")),
    Spec("torch_watchdog_gpu_memory_free_bytes", GAUGE, _G,
         "GPU memory free, from NVML, at the last poll.", _device("free_bytes")),
    # each server's processes, as the last poll read them
    Spec("torch_watchdog_server_gpu_memory_bytes", GAUGE, ("server", "gpu_uuid"),
         "GPU memory used on this GPU by the server's live processes, summed, from NVML's "
         "per-process list (absent where NVML does not say: MIG, containers).",
         _procs_gpu),
    Spec("torch_watchdog_server_rss_bytes", GAUGE, _S,
         "Resident set size (RSS) of the server's live processes, summed.",
         _procs(lambda p: p.rss_bytes)),
    Spec("torch_watchdog_server_up", GAUGE, _S,
         "1 while one of the server's processes is alive, 0 once none is (absent before "
         "one was read); its other series (but its actions) are absent while it is 0.",
         _procs(lambda p: None if p.up is None else int(p.up), gone_too=True)),
    # pipeline (cumulative counts from the agent's events, correlated)
    Spec("torch_watchdog_cudagraph_recordings_total", COUNTER, _S,
         "CUDA graphs recorded by the server's processes.", _est("recordings")),
    Spec("torch_watchdog_cudagraph_warmups_total", COUNTER, _S,
         "CUDA-graph warm-up runs (a size's first run, before it is recorded).", _est("warmups")),
    Spec("torch_watchdog_compiles_total", COUNTER, _S,
         "First torch.compile compilations of a frame, one per frame and process "
         "(recompilations are torch_watchdog_recompiles_total).", _est("compiles")),
    Spec("torch_watchdog_recompiles_total", COUNTER, _S,
         "torch.compile recompilations of a frame already compiled (a guard failed).",
         _est("recompiles")),
    Spec("torch_watchdog_recompile_limit_hits_total", COUNTER, _S,
         "Times a frame hit the recompile limit and fell back to eager, as the agent reported.",
         _est("recompile_limit_hits")),
    Spec("torch_watchdog_stalls_total", COUNTER, _S,
         "Calls of a watched callable stalled by compilation or graph recording, as the agent "
         "reported.", _est("stalls")),
    Spec("torch_watchdog_stall_seconds_total", COUNTER, _S,
         "Time those stalled calls took.", _est("stall_seconds")),
    Spec("torch_watchdog_graph_breaks_total", COUNTER, _S,
         "torch.compile graph breaks.", _est("graph_breaks")),
    Spec("torch_watchdog_ooms_total", COUNTER, _S,
         "CUDA out-of-memory errors the agent saw.", _est("ooms")),
    Spec("torch_watchdog_compile_seconds_total", COUNTER, _S,
         "Time spent compiling: compilations and recompilations.", _est("compile_seconds")),
    Spec("torch_watchdog_fx_cache_hits_total", COUNTER, _S,
         "Inductor FX-graph cache hits of compilations and recompilations (torch 2.6+).",
         _est("fx_cache_hits")),
    Spec("torch_watchdog_fx_cache_misses_total", COUNTER, _S,
         "Inductor FX-graph cache misses (compiled from scratch) of compilations and "
         "recompilations (torch 2.6+).", _est("fx_cache_misses")),
    Spec("torch_watchdog_requests_total", COUNTER, _S,
         "Calls of the server's watched callables, as the agents counted them.",
         _est("requests")),
    Spec("torch_watchdog_distinct_shapes", GAUGE, _S,
         "Distinct input shapes of the server's watched callables so far.",
         _est("distinct_shapes")),
    Spec("torch_watchdog_cudagraph_memory_per_graph_bytes", GAUGE, _S,
         "Estimated GPU memory per recorded CUDA graph (absent until enough recordings).",
         _est("mb_per_graph", 1e6)),
    Spec("torch_watchdog_cudagraph_memory_per_graph_confidence_ratio", GAUGE, _S,
         "Confidence (0-1) of the memory-per-graph estimate.", _est("mb_per_graph_confidence")),
    Spec("torch_watchdog_memory_explained_by_recordings_bytes", GAUGE, _S,
         "Server memory growth explained by CUDA-graph recordings (recordings times the "
         "memory per graph).",
         _est("explained_by_recordings_bytes")),
    Spec("torch_watchdog_memory_unexplained_bytes", GAUGE, _S,
         "Server memory growth since its warm-up that neither recordings nor compiles "
         "explain.",
         _est("unexplained_bytes")),
    # forecast
    Spec("torch_watchdog_oom_forecast_seconds", GAUGE, _S,
         "Forecast time until the server's memory level reaches its budget (on a GPU its "
         "GPU's, in host-memory mode its memory limit), from the shape-discovery model, "
         "else the trend; +Inf means no OOM forecast.", _fc_seconds("seconds_to_oom")),
    Spec("torch_watchdog_oom_forecast_earliest_seconds", GAUGE, _S,
         "The forecast the policy acts on: torch_watchdog_oom_forecast_seconds with the "
         "trend's next step as soon as its steps have come before (the lower quartile of "
         "their gaps, not the median); +Inf means no OOM forecast.",
         _fc_seconds("seconds_to_oom_earliest")),
    Spec("torch_watchdog_oom_forecast_linear_seconds", GAUGE, _S,
         "Forecast time until the server's memory level reaches its budget from the linear "
         "trend alone; +Inf means no OOM forecast.", _fc_seconds("seconds_to_oom_linear")),
    Spec("torch_watchdog_memory_plateau_bytes", GAUGE, _S,
         "Forecast memory level once every input shape is recorded (absent when unknown).",
         _fc("plateau_bytes")),
    Spec("torch_watchdog_memory_budget_bytes", GAUGE, _S,
         "Where the forecast's OOM is, the level at which allocation fails: on a GPU its "
         "usable memory less the 19 MiB the driver keeps; in host-memory mode the server's "
         "memory limit (its cgroup's, else what it holds plus what the host has available); "
         "or forecast.process_budget_bytes (servers[].budget_bytes for a server given its "
         "own).", _fc("budget_bytes")),
    Spec("torch_watchdog_memory_level_bytes", GAUGE, _S,
         "The memory the forecast measures against the budget now: on a GPU the GPU's used "
         "memory (every process's); in host-memory mode, or with forecast."
         "process_budget_bytes, the server's own processes' (absent when unknown).",
         _fc("level_bytes")),
    Spec("torch_watchdog_shape_space_estimate", GAUGE, _S,
         "Estimated number of distinct input shapes the traffic draws from.",
         _fc("shape_space_estimate")),
    # the agent's padding (watch(..., pad=...)), per padded model
    Spec("torch_watchdog_padding_on", GAUGE, ("server", "model"),
         "1 while the agent pads this model's inputs to buckets, 0 once a check refused it.",
         _pad("on", lambda v: int(bool(v.get("on"))))),
    Spec("torch_watchdog_padding_buckets", GAUGE, ("server", "model"),
         "Buckets in the model's padding plan (one CUDA graph each).",
         _pad("buckets", lambda v: len(v.get("buckets") or ()))),
    Spec("torch_watchdog_padding_plan", GAUGE, ("server", "model", "bucket"),
         "1 for each bucket of the model's padding plan (a plan only grows).", _pad_buckets),
    Spec("torch_watchdog_padding_real_tokens_total", COUNTER, ("server", "model"),
         "Real tokens (lengths) of the calls served through a bucket.", _pad("real_tokens")),
    Spec("torch_watchdog_padding_tokens_total", COUNTER, ("server", "model"),
         "Padding tokens added to those calls.", _pad("padding_tokens")),
    Spec("torch_watchdog_padding_fraction_ratio", GAUGE, ("server", "model"),
         "Share of the padded calls' tokens that are padding (compute spent on padding).",
         _pad("padding_fraction")),
    Spec("torch_watchdog_padding_recordings_saved", GAUGE, ("server", "model"),
         "Lengths served through a bucket less the buckets used: CUDA graphs not recorded.",
         _pad("recordings_saved")),
    Spec("torch_watchdog_padding_checks_total", COUNTER, ("server", "model"),
         "Padded calls also run unpadded and compared.", _pad("checks")),
    Spec("torch_watchdog_padding_check_seconds_total", COUNTER, ("server", "model"),
         "Time those unpadded runs and comparisons took.", _pad("check_seconds")),
    Spec("torch_watchdog_padding_checks_skipped_total", COUNTER, ("server", "model"),
         "Sampled checks not run: longer than any length checked, or past the memory cap.",
         _pad("checks_skipped", lambda v: v.get("checks_skipped") or 0)),
    Spec("torch_watchdog_padding_checks_stopped", GAUGE, ("server", "model"),
         "1 once sampled checks stopped (the reserved memory they left passed "
         "check_memory_bytes), else 0.", _pad("checks_stopped", lambda v: int(bool(
             v.get("checks_stopped"))))),
    Spec("torch_watchdog_padding_max_error_ratio", GAUGE, ("server", "model", "dtype"),
         "Largest relative error seen by the checks, per output dtype.", _pad_errors),
    # causes and actions
    Spec("torch_watchdog_cause_active", GAUGE, ("server", "cause"),
         "1 while the watchdog attributes memory growth or slowdown to this cause, else 0.",
         _causes),
    Spec("torch_watchdog_actions_total", COUNTER, ("server", "action"),
         "The sidecar's decisions and reload outcomes for the server, by action.", _actions),
    Spec("torch_watchdog_reload_held_until_timestamp_seconds", GAUGE, ("server", "reason"),
         "Present while the server's forecast calls for a reload that is held back, by reason "
         "(cooldown, hourly_maximum, concurrency_cap, dry_run, method_none, precondition, "
         "frozen, remedy_freeze): "
         "Unix time the hold ends by itself, +Inf when no end is known.", _held),
    Spec("torch_watchdog_graphs_frozen", GAUGE, ("server",),
         "1 while the server's CUDA-graph recording is frozen (policy.remedy: recorded sizes "
         "replay, new sizes run without graphs), 0 once a freeze was asked and did not take or "
         "was undone; absent if none was asked.", _frozen),
    # the watchdog itself
    Spec("torch_watchdog_host_info", GAUGE, ("host",),
         "Always 1; `host`: this host's name, as the sidecar's alerts carry it (the shipped "
         "rules join it, so that Alertmanager pairs their alerts with the sidecar's).",
         lambda s: [((host_name(),), 1)], True),
    Spec("torch_watchdog_source_up", GAUGE, ("source",),
         "1 if the source was up at the last poll, else 0: nvml, NVML read a GPU (absent on a "
         "host without a GPU stack); process, a watched process is alive; agent, a process "
         "that sent events is alive.", _sources, True),
    Spec("torch_watchdog_poll_duration_seconds", GAUGE, (),
         "Duration of the last poll.", _one(lambda s: s.poll_seconds), True),
    Spec("torch_watchdog_nvml_query_seconds", GAUGE, (),
         "Duration of the last poll's NVML queries (absent where NVML is not used).",
         _one(lambda s: s.nvml_query_seconds if s.nvml_in_use else None), True),
    Spec("torch_watchdog_reload_record_unreadable", GAUGE, (),
         "1 when <state_dir>/reloads.json could not be read at start: no reload for an hour.",
         _one(lambda s: int(s.reload_record_unreadable)), True),
    Spec("torch_watchdog_source_errors_total", COUNTER, ("source", "reason"),
         "Failed or late reads of a source, by reason (NVML: the error's class, late, init).",
         _source_errors, True),
    Spec("torch_watchdog_events_received_total", COUNTER, (),
         "Agent events taken in by the polls (those dropped are "
         "torch_watchdog_events_dropped_total).", _one(lambda s: s.events_received_total),
         True),
    Spec("torch_watchdog_events_skewed_total", COUNTER, (),
         "Agent events whose time was further than correlate.max_clock_skew_s from the "
         "sidecar's clock (their time replaced by the sidecar's).",
         _one(lambda s: s.events_skewed_total), True),
    Spec("torch_watchdog_events_dropped_total", COUNTER, ("reason",),
         "Datagrams dropped by the receiver, by reason.", _by_label("events_dropped_total"), True),
    Spec("torch_watchdog_agent_events_lost_total", COUNTER, (),
         "Events the agents reported losing (their queue full, the socket's, the log's): "
         "each agent's whole count is in every heartbeat, so the counter is exact once a "
         "heartbeat passes after the losses, whatever became of the drop reports.",
         _one(lambda s: s.agent_events_lost_total), True),
    Spec("torch_watchdog_alerts_sent_total", COUNTER, ("url",),
         "Alerts each configured Alertmanager accepted (an alert sent again while it fires "
         "counts again).", _by_label("alerts_sent_total"), True),
    Spec("torch_watchdog_alert_posts_failed_total", COUNTER, ("url",),
         "POSTs to an Alertmanager that failed (refused, timed out, or an error status).",
         _by_label("alert_posts_failed_total"), True),
    Spec("torch_watchdog_alerts_dropped_total", COUNTER, ("url",),
         "Alerts lost because an Alertmanager's outbox was full.",
         _by_label("alerts_dropped_total"), True),
    Spec("torch_watchdog_poll_errors_total", COUNTER, ("stage",),
         "Polls whose stage raised (a bug): logged with its traceback, the next poll goes on.",
         _by_label("poll_errors_total"), True),
    Spec("torch_watchdog_last_poll_timestamp_seconds", GAUGE, (),
         "Unix time of the last poll; all other values are from that poll (0 before the first).",
         _one(lambda s: s.t), True),
)
_SCRAPE_ERRORS_HELP = "Metric families left out of a scrape because they could not be built."

# (name, type, labels, help), for the README.
METRICS: list[tuple[str, str, tuple[str, ...], str]] = (
    [(s.name, s.kind, s.labels, s.help) for s in SPECS]
    + [(SCRAPE_ERRORS, COUNTER, (), _SCRAPE_ERRORS_HELP)])

_EMPTY = Snapshot(t=0.0)


def _family(spec: Spec, snap: Snapshot) -> Optional[Metric]:
    """The family for `spec`, None when it has no sample; raises on bad data (caller counts)."""
    cls = CounterMetricFamily if spec.kind == COUNTER else GaugeMetricFamily
    family = cls(spec.name, spec.help, labels=spec.labels)
    for labels, value in spec.samples(snap):
        if value is not None:
            family.add_metric([str(v) for v in labels], _num(value))
    return family if family.samples else None


class SnapshotCollector:
    """Renders the latest Snapshot; `update()` is a single reference swap, so no lock."""

    def __init__(self) -> None:
        self._snapshot: Optional[Snapshot] = None
        self._errors = 0
        self._errors_lock = threading.Lock()  # scrapes may run in parallel server threads
        self._warned: set[str] = set()

    def update(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot  # read once: the whole scrape sees one tick
        for spec in SPECS:
            if snap is None and not spec.before_first_poll:
                continue
            try:
                family = _family(spec, snap if snap is not None else _EMPTY)
            except Exception as exc:  # never fail a scrape; count it and move on
                self._count_error(spec.name, exc)
                continue
            if family is not None:
                yield family
        errors = CounterMetricFamily(SCRAPE_ERRORS, _SCRAPE_ERRORS_HELP)
        errors.add_metric([], float(self._errors))
        yield errors

    def _count_error(self, name: str, exc: BaseException) -> None:
        with self._errors_lock:
            self._errors += 1
            first = name not in self._warned
            self._warned.add(name)
        if first:  # once per family: a bad value repeats every scrape
            log.warning("metric %s left out of the scrape: %r", name, exc)


def make_registry(collector: SnapshotCollector) -> CollectorRegistry:
    """A fresh registry holding only `collector` (not the global one: no process_/python_ noise
    from the default collectors, and tests can build as many as they like)."""
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition a scrape of /metrics would return."""
    return generate_latest(registry)


def serve(address: str, port: int, registry: CollectorRegistry,
          status: Optional[Callable[[], Any]] = None) -> tuple[Any, Any]:
    """Serve /metrics — and the status page, / and /status.json (web.py) — on address:port in
    a daemon thread; returns (server, thread). Port 0 means any free port: read
    `server.server_port`. Raises OSError when the port cannot be bound. `status` returns the
    latest `history.StatusView` (None before the first poll)."""
    from torch_watchdog.sidecar.present import web  # the page's modules: only where it is served

    return web.serve(address, port, registry, status)


def stop(server: Any, thread: Any, timeout_s: float = 5.0) -> None:
    """Stop a server returned by `serve()` and release its port (no-op for (None, None))."""
    if server is not None:
        server.shutdown()
        server.server_close()  # shutdown() alone keeps the port bound (client_python #1068)
    if thread is not None:
        thread.join(timeout_s)
