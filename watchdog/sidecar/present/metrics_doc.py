"""docs/metrics.md, rendered from the spec table in metrics.py (`METRICS`: name, type, labels,
help), so that the page lists exactly what `/metrics` exports.

    python -m torch_watchdog.sidecar.present.metrics_doc > docs/metrics.md

tests/unit/test_metrics_doc.py fails while docs/metrics.md differs from `render()`: a metric
added, renamed or re-labelled in metrics.py without regenerating the page.
"""
from __future__ import annotations

import sys
from typing import Iterable, Mapping, Optional

COMMAND = "python -m torch_watchdog.sidecar.present.metrics_doc > docs/metrics.md"

# What a metric's help does not say: the values a label takes. Every key must be a metric of
# the spec table (the test checks it), so a removed metric cannot leave its note behind.
NOTES: dict[str, str] = {
    "torch_watchdog_actions_total": (
        "Per server. `action`: `alert`, `reload` (decisions), `execute`, `cancel`; `reload_ok`, "
        "`reload_not_done`, `reload_failed` (outcomes); `restart` (a new server process); "
        "`freeze`, `unfreeze` (asked of its agents: policy.remedy, `torch-watchdog unfreeze`)."),
    "torch_watchdog_source_up": "`source`: `nvml`, `process`, `agent`.",
    "torch_watchdog_source_errors_total": (
        "NVML's `reason`: the error's class, `late` (no answer within 2 polls, at most 1 s), "
        "`init`."),
    "torch_watchdog_events_dropped_total": (
        "`reason`: `malformed`, `oversized`, `version`, `foreign`, `spoofed` (the datagram's "
        "`pid` is not its sender's), `backlog` (past the per-poll intake cap)."),
    "torch_watchdog_alerts_sent_total": "`url`: each of `alerts.urls`.",
    "torch_watchdog_alert_posts_failed_total": "`url`: each of `alerts.urls`.",
    "torch_watchdog_alerts_dropped_total": "`url`: each of `alerts.urls`.",
    "torch_watchdog_poll_errors_total": (
        "`stage`: `observe` (the sources), `decide` (the step, per observation), `act` (the "
        "reloads, the alerts), `show` (metrics, status page), `poll` (the rest)."),
    "torch_watchdog_padding_plan": "One series per bucket of the plan, value 1.",
}

INTRO = """\
Every metric the sidecar exports on `/metrics` (default `http://127.0.0.1:9464/metrics`:
`metrics_address`, `metrics_port`).

Conventions: prefix `torch_watchdog_`, base units (bytes, seconds), counters end in `_total`,
GPUs are labelled `gpu_uuid`, the families of one server are labelled `server` (a group of
processes reloaded together); no pid or shape labels (they are unbounded). Nothing of a server
is summed over servers. NVML's series are left out on a host without a GPU stack.

A server's `server` label stays the same over its restarts and reloads, so that dashboards and
alerts follow it: its configured name (`servers:`, `server.unit`), else the name its agent
announces where that name stays (`install(server=...)` / `TORCH_WATCHDOG_SERVER`, a Ray Serve
replica's `serve:<app>/<deployment>/<rank>`, a systemd service); the automatic names that
change with each start (`pgid:N`, `dist:<addr>:<port>`, `torchrun:<id>`) give way to the
server's program, from the agent's command line, with the rest of the name: `app.py` for
`python app.py`, `uvicorn main:app`, `app.py/cuda:0` for `pgid:7212/cuda:0`. Two servers of a
host never share a label: a second copy of one program is `app.py#2` (in a fixed order: servers
with a live process first, then those named by config or by their agent, then by name), and
keeps it while it lives. A reading that is
unknown is absent, never 0, except the OOM forecasts: no OOM forecast is exported as `+Inf`, so
that `torch_watchdog_oom_forecast_seconds < 600` alerts work unchanged. Per-server counters
count from zero for a new server process. A scrape never fails: a family that cannot be built
is left out and counted in `torch_watchdog_scrape_errors_total`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(metrics: Optional[Iterable[tuple[str, str, tuple[str, ...], str]]] = None,
           notes: Optional[Mapping[str, str]] = None,
           causes: Optional[Iterable[str]] = None) -> str:
    """The markdown page for `metrics` ((name, type, labels, help) rows; default: metrics.py's
    table), with `notes` appended to the help of the metrics they name, and the values of the
    `cause` label. Pure: the same rows give the same text."""
    if metrics is None:
        from torch_watchdog.sidecar.present.metrics import METRICS
        metrics = METRICS
    if causes is None:
        from torch_watchdog.sidecar.core.correlate import CAUSES
        causes = CAUSES
    notes = NOTES if notes is None else notes
    lines = [
        "# Metrics",
        "",
        f"<!-- Generated from watchdog/sidecar/present/metrics.py; do not edit. "
        f"Regenerate with: {COMMAND} -->",
        "",
        "Generated from the spec table in `watchdog/sidecar/present/metrics.py`: do not edit",
        "by hand. After changing that table, regenerate this page from the repository root",
        "(with `.venv/bin/python` in a `make install` checkout):",
        "",
        "```sh",
        COMMAND,
        "```",
        "",
        INTRO.rstrip("\n"),
        "",
        "| metric | type | labels | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, kind, labels, help_text in metrics:
        text = help_text
        if "cause" in labels:
            text += " `cause`: " + ", ".join(f"`{c}`" for c in causes) + "."
        if name in notes:
            text += " " + notes[name]
        shown = ", ".join(f"`{label}`" for label in labels) or "—"
        lines.append(f"| `{name}` | {kind} | {shown} | {_cell(text)} |")
    lines += ["", "The alerting rules over these metrics: "
              "[config/prometheus/torch-watchdog-rules.yml](../config/prometheus/"
              "torch-watchdog-rules.yml) ([deploy.md](deploy.md)).", ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(f"usage: {COMMAND}", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
