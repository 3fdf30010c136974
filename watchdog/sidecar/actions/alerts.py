"""Alertmanager v2 alerts: build them (pure) and deliver them (I/O, on a thread of its own).

One alert per active cause. As Prometheus sends them to Alertmanager: a firing alert is re-sent
every `resend_s` with `endsAt` = now + 4 × resend_s, so two lost sends do not resolve it; a
resolved alert is sent with `endsAt` = now and re-sent for `resolved_retention_s` (Alertmanager
is stateless). Every URL gets every batch (HA pairs); a failed POST is retried with backoff; the
outbox is bounded (oldest dropped, counted). The daemon's loop only hands over the current set.

An alert of an event rather than a condition (`reload`: the step shows it from the reload's
start until one poll after its outcome, often under a second) would be resolved before an
Alertmanager route's `group_wait` flushes its group, and an alert resolved before its group's
first flush is never notified. The book keeps such an alert firing for `min_firing_s[cause]`
from its start (alerts.reload_min_firing_s), with the latest annotations (the outcome, once
known), then resolves it.
"""
from __future__ import annotations

import collections
import datetime
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

FIXES = {
    "cudagraph_per_shape": "Pad inputs to a few bucket sizes, or set "
                           "torch._inductor.config.triton.cudagraph_capture_sizes to them "
                           "(or run the agent with graph_budget).",
    "recompile_storm": "Mark the varying dimension dynamic (torch._dynamo.mark_dynamic) or "
                       "bucket the inputs; each recompile stalls the server.",
    "recompile_limit_eager_fallback": "New shapes now run eager, slower. Bucket the inputs or "
                                      "mark the dimension dynamic; raising "
                                      "torch._dynamo.config.recompile_limit only delays it.",
    "memory_growth_unexplained": "Memory grows without recordings or compiles: look for a leak "
                                 "or a cache (e.g. the allocator's, or a KV cache).",
    "oom_forecast": "The server will run out of GPU memory; the sidecar reloads it before then "
                    "if reloads are enabled.",
    "reload": "The sidecar restarted the server to avoid an OOM; fix the cause above or it "
              "will happen again.",
    "padding_refused": "Right padding changed the model's outputs at real positions (e.g. "
                       "pooling over the sequence without a mask), so the agent turned it off "
                       "and the model runs unpadded: pass the attention mask, or pad in a way "
                       "that is exact (torch_watchdog.agent.pad.Custom), then restart the server.",
    "graphs_frozen": "The sidecar froze CUDA-graph recording to stop the growth (policy.remedy): "
                     "recorded sizes replay, new sizes run without graphs, slower. Pad or "
                     "bucket the inputs to the lengths in `advice` (the bucket advisor), then "
                     "restart the server; `torch-watchdog unfreeze SERVER` ends it by hand.",
    "reload_failed": "The server did not come back after the reload (no agent hello in "
                     "reload.hello_timeout_s): check that it runs and serves, and that its "
                     "supervisor (systemd Restart=, the master) restarts it.",
    "reload_record_unreadable": "<state_dir>/reloads.json could not be read: no reload for an "
                                "hour. Look at it, remove it and restart the sidecar.",
}


# host-memory mode (no GPU: memory_source "rss"): the memory that runs out is the host's
HOST_FIXES = {
    "oom_forecast": "The server will run out of memory (its own, against its cgroup's limit or "
                    "what the host has); the sidecar reloads it before then if reloads are "
                    "enabled.",
}

CRITICAL = ("oom_forecast", "reload_failed")  # the server is about to stop, or did


def fix(cause: str, estimates: Mapping[str, Any]) -> str:
    """What to do, said of the memory that runs out: the GPU's, or in host-memory mode the
    host's."""
    if estimates.get("memory_source") == "rss" and cause in HOST_FIXES:
        return HOST_FIXES[cause]
    return FIXES.get(cause, "")


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def alertname(cause: str) -> str:
    return "TorchCompile" + "".join(part.capitalize() for part in cause.split("_"))


# over the complexity bound: one clause per number an alert may cite
def describe(cause: str, detail: dict[str, Any], estimates: Mapping[str, Any],  # noqa: C901
             forecast: Mapping[str, Any]) -> str:
    """What was seen and what is coming, in numbers."""
    parts = []
    mb = estimates.get("mb_per_graph")
    if estimates.get("recordings"):
        text = f"{estimates['recordings']:,} CUDA graphs recorded for " \
               f"{estimates.get('distinct_shapes', 0):,} distinct shapes"
        if mb:
            text += f", {mb:.2f} MB each, {mb * estimates['recordings']:,.0f} MB so far"
        parts.append(text)
    if estimates.get("recompiles"):
        parts.append(f"{estimates['recompiles']} recompiles "
                     f"({estimates.get('compile_seconds', 0):.0f} s compiling)")
    if cause == "recompile_limit_eager_fallback":
        parts.append(f"recompile limit {detail.get('limit')} reached"
                     + (f" in {detail['function']}" if detail.get("function") else ""))
    if cause == "reload":
        method = f" ({detail['method']})" if detail.get("method") else ""
        parts.append(f"reload{method}: {detail.get('outcome')}")
    if cause == "reload_failed":
        parts.append(f"reload failed: {detail.get('outcome')}")
    if cause == "reload_record_unreadable":
        parts.append(str(detail.get("detail")))
    if cause == "graphs_frozen":
        from torch_watchdog.sidecar.present.status import freeze_summary
        parts.append(freeze_summary(detail) or "recording frozen")
    if cause == "padding_refused":
        for model, why in sorted((detail.get("models") or {}).items()):
            error = why.get("error")
            parts.append(f"padding off for {model}"
                         + (f": outputs differed by {error:.3g} (relative)" if error is not None
                            else "") + (f" ({why['detail']})" if why.get("detail") else ""))
    if cause == "memory_growth_unexplained":
        parts.append(f"{detail.get('unexplained_mb', 0):,.0f} MB of growth unexplained")
    seconds, plateau = forecast.get("seconds_to_oom"), forecast.get("plateau_bytes")
    if seconds is not None:
        parts.append(f"~{seconds / 60:.0f} min to OOM")
    if plateau is not None:
        parts.append(f"plateau {plateau / 1e9:.1f} GB")
    return "; ".join(parts) or cause


def names() -> dict[str, str]:
    """Every alert the sidecar can send: alertname -> cause (one per cause FIXES explains)."""
    return {alertname(cause): cause for cause in FIXES}


def build(active: dict[str, dict[str, Any]], estimates: Mapping[str, Any],
          forecast: Mapping[str, Any], labels: dict[str, str],
          ) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The alerts that should be firing now, by fingerprint (their sorted labels)."""
    out = {}
    for cause, detail in active.items():
        alert_labels = {**labels, "alertname": alertname(cause), "cause": cause,
                        "severity": "critical" if cause in CRITICAL else "warning"}
        out[tuple(sorted(alert_labels.items()))] = {
            "labels": alert_labels,
            "annotations": {"summary": f"torch.compile watchdog: {cause.replace('_', ' ')}",
                            "description": describe(cause, detail, estimates, forecast),
                            "fix": fix(cause, estimates)}}
    return out


@dataclass
class Tracked:
    alert: dict[str, Any]
    starts_at: float
    ends_at: Optional[float] = None      # set when resolved
    last_sent: float = -1e18


@dataclass
class AlertBook:
    """Which alerts fire, which resolved, and what is due to be sent (pure, clock passed in).
    `min_firing_s`: by cause, the least time its alert fires from its start (an event's alert:
    module docstring)."""
    resend_s: float = 60.0
    resolved_retention_s: float = 900.0
    tracked: dict[tuple[Any, ...], Tracked] = field(default_factory=dict)
    min_firing_s: dict[str, float] = field(default_factory=dict)

    def update(self, firing: dict[tuple[Any, ...], dict[str, Any]], now: float) -> None:
        for key, alert in firing.items():
            t = self.tracked.get(key)
            if t is None or t.ends_at is not None:
                self.tracked[key] = Tracked(alert, now)
            else:
                t.alert = alert  # annotations are always the latest
        for key, t in self.tracked.items():
            if key not in firing and t.ends_at is None and not self._held(t, now):
                t.ends_at, t.last_sent = now, -1e18  # send the resolution at once
        for key in [k for k, t in self.tracked.items()
                    if t.ends_at is not None and now - t.ends_at > self.resolved_retention_s]:
            del self.tracked[key]

    def _held(self, t: Tracked, now: float) -> bool:
        """Still firing though the step no longer shows it: its cause's least time not over."""
        least = self.min_firing_s.get(t.alert["labels"].get("cause", ""))
        return least is not None and now < t.starts_at + least

    def due(self, now: float) -> list[dict[str, Any]]:
        batch = []
        for t in self.tracked.values():
            if now - t.last_sent < self.resend_s:
                continue
            t.last_sent = now
            ends = t.ends_at if t.ends_at is not None else now + 4 * self.resend_s
            batch.append({**t.alert, "startsAt": rfc3339(t.starts_at), "endsAt": rfc3339(ends)})
        return batch


def post_alerts(url: str, batch: list[dict[str, Any]], timeout_s: float) -> None:
    """POST to <url>/api/v2/alerts; raises OSError (incl. HTTP errors) on failure."""
    req = urllib.request.Request(url.rstrip("/") + "/api/v2/alerts",
                                 data=json.dumps(batch).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        resp.read()


class AlertSender:
    """Delivers batches to every URL from a thread; the loop never waits for the network."""

    def __init__(self, urls: list[str], timeout_s: float = 5.0, max_outbox: int = 1000,
                 post: Callable[[str, list[Any], float], None] = post_alerts,
                 on_failure: Callable[[str, str], None] = lambda url, error: None):
        self.urls, self.timeout_s, self.post, self.on_failure = urls, timeout_s, post, on_failure
        self.outbox: dict[str, collections.deque[Any]] = {
            url: collections.deque(maxlen=max_outbox) for url in urls}
        self.sent: collections.Counter[str] = collections.Counter()     # by url: delivered
        self.failed: collections.Counter[str] = collections.Counter()   # by url: failed POSTs
        self.dropped: collections.Counter[str] = collections.Counter()  # by url: outbox full
        self.backoff: dict[str, float] = dict.fromkeys(urls, 0.0)
        self.retry_at: dict[str, float] = dict.fromkeys(urls, 0.0)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def submit(self, batch: list[dict[str, Any]]) -> None:
        if not batch:
            return
        for url, box in self.outbox.items():
            overflow = len(box) + len(batch) - (box.maxlen or 0)
            if overflow > 0:
                self.dropped[url] += overflow
            box.extend(batch)
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="torch-watchdog-alerts",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.flush()
            self._wake.wait(1.0)
            self._wake.clear()
        self.flush()  # last chance for what is queued (resolutions on shutdown)

    def flush(self) -> None:
        for url, box in self.outbox.items():
            if not box or time.monotonic() < self.retry_at[url]:
                continue
            batch = list(box)[:256]  # Prometheus' batch size
            try:
                self.post(url, batch, self.timeout_s)
            except urllib.error.HTTPError as e:
                self.failed[url] += 1
                self.on_failure(url, f"HTTP {e.code}")
                if 400 <= e.code < 500:  # the batch itself is refused: resending cannot help
                    for _ in batch:
                        box.popleft()
                    self.dropped[url] += len(batch)
                    continue
                self._back_off(url)
                continue
            except (OSError, ValueError) as e:  # refused, timed out, reset
                self.failed[url] += 1
                self._back_off(url)
                self.on_failure(url, f"{type(e).__name__}: {e}")
                continue
            for _ in batch:
                box.popleft()
            self.sent[url] += len(batch)
            self.backoff[url] = 0.0

    def _back_off(self, url: str) -> None:
        self.backoff[url] = min(60.0, max(1.0, 2 * self.backoff[url]))
        self.retry_at[url] = time.monotonic() + self.backoff[url]
