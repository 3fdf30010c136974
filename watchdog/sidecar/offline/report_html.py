"""The post-mortem report's HTML (pure): one self-contained page from `report.build_report`'s
numbers — inline CSS and SVG (plot.py), no script, no external resource, every text escaped.

Every number is shown in human units (MiB/GiB, durations, "+12.3 s" from the start); the
forecast shown is the one in force when the sidecar decided; a host with several servers gets
one section per server (its memory, its counts over all its processes, its shapes)."""
from __future__ import annotations

import html
from typing import Any, Iterable

from torch_watchdog.sidecar.present import plot
from torch_watchdog.sidecar.present.plot import human_bytes, human_duration


# -- page -----------------------------------------------------------------------------------
CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:960px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin-top:20px}
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top}th{background:#f5f5f5}.num{text-align:right;white-space:nowrap}
dl.summary{display:grid;grid-template-columns:repeat(4,1fr);gap:6px 18px}
dl.summary div{background:#f7f7f7;padding:6px 10px;border-radius:4px}dt{color:#666;font-size:12px}
dl.summary div.wide{grid-column:span 2}
dd{margin:0;font-weight:600}pre{background:#f5f5f5;padding:10px;overflow:auto}.note{color:#666}
.bad{color:#b00}"""


def render_html(report: dict[str, Any]) -> str:
    """One self-contained page: inline CSS and SVG, no script, no external resource."""
    servers = report.get("servers") or []
    inp = report["input"]
    body = [f"<h1>torch-watchdog report</h1><p class=note>{_e(', '.join(inp['files']))}"
            f" — {inp['observations']:,} observations"
            + (f" over {human_duration(inp['span_s'])}" if inp.get("span_s") else "") + ", "
            f"{inp.get('bad_lines', 0)} unreadable line(s)"
            f"{_e(f', {len(servers)} servers') if len(servers) > 1 else ''}</p>"]
    if len(servers) > 1:
        body.append(_servers_html(servers))
        for s in servers:
            body.append(f"<h2 id=\"server-{_e(s['name'])}\">Server {_e(s['name'])}</h2>"
                        f"<p class=note>{_e(_who(s))}</p>")
            body.append(_server_body(s, report, level=3))
    else:
        one = servers[0] if servers else {"summary": report["summary"],
                                          "chart": report["chart"], "shapes": report["shapes"]}
        body.append(_server_body(one, report, level=2, shapes=False))
    several = len(servers) > 1
    body += [_causes_html(report["causes"], several), _actions_html(report["actions"], several)]
    if not several:
        body.append(_shapes_html(report["shapes"], 2))
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            f"<title>torch-watchdog report</title><style>{CSS}</style></head><body>"
            + "".join(body) + "</body></html>\n")


def _who(s: dict[str, Any]) -> str:
    procs = s.get("processes") or []
    text = (f"pids {', '.join(map(str, s.get('pids') or [])) or '—'}; GPUs "
            f"{', '.join(s.get('gpus') or []) or 'none (host memory)'}")
    if len(procs) > 1:
        text += "; processes from " + ", ".join(
            f"+{human_duration(p['from_t'])}" + (f" (pid {', '.join(map(str, p['pids']))})"
                                                  if p["pids"] else "") for p in procs)
    return text


def _servers_html(servers: list[Any]) -> str:
    rows = "".join(
        f"<tr><td><a href=\"#server-{_e(s['name'])}\">{_e(s['name'])}</a></td>"
        f"<td>{_e(', '.join(map(str, s['pids'])) or '—')}</td>"
        f"<td>{_e(', '.join(g[:12] for g in s['gpus']) or '—')}</td>"
        f"<td class=num>{_e(human_bytes(s['summary']['memory_peak_bytes']))}</td>"
        f"<td class=num>{s['summary']['recordings']:,}</td>"
        f"<td>{_e(_forecast_text(s['summary']))}</td></tr>" for s in servers)
    return ("<h2>Servers</h2><p>Each server is watched, forecast and reloaded on its own.</p>"
            "<table><tr><th>server</th><th>pids</th><th>GPUs</th><th>peak memory</th>"
            f"<th>CUDA graphs</th><th>forecast</th></tr>{rows}</table>")


def _server_body(s: dict[str, Any], report: dict[str, Any], level: int, shapes: bool = True) -> str:
    summary, chart = s["summary"], s["chart"]
    memory = plot.memory_chart([tuple(p) for p in chart["points"]],
                               [tuple(m) for m in chart["marks"]], budget=_budget(chart),
                               budget_label=chart.get("budget_label", "budget"),
                               breaks=chart.get("breaks", ()),
                               time_origin=0.0,  # the tables' times: from the trace's start
                               title=f"server memory ({_meter(summary['memory_source'])})")
    parts = [_summary_html(summary), f"<h{level}>Memory</h{level}>", memory, _zoom(chart),
             _chart_note(chart, report)]
    parts.append(_padding_html(s.get("padding") or [], level))
    if shapes:
        parts.append(_shapes_html(s["shapes"], level))
    return "".join(parts)


def _padding_html(rows: list[Any], level: int) -> str:
    """The agent's padding (watch(..., pad=...)): per model, on or refused, the plan, the
    share of tokens that were padding, graphs not recorded, the checks and their error."""
    if not rows:
        return ""
    body = []
    for r in rows:
        share = r.get("padding_fraction")
        state = "on" if r["on"] else "<span class=bad>off</span>"
        checks = f"{r['checks']:,}" + (f" ({r['check_ms']:.1f} ms each)"
                                       if r.get("check_ms") is not None else "")
        errors = ", ".join(f"{k} {v:.2g}" for k, v in sorted((r.get("max_error") or {}).items()))
        body.append(
            f"<tr><td>{_e(r['model'])}</td><td>{state}</td>"
            f"<td>{_e(', '.join(map(str, r['buckets'])) or '—')}</td>"
            f"<td class=num>{'—' if share is None else f'{100 * share:.1f} %'}</td>"
            f"<td class=num>{int(r.get('recordings_saved') or 0):,}</td>"
            f"<td class=num>{_e(checks)}</td><td>{_e(errors or '—')}</td></tr>")
        if r.get("refused"):
            body.append(f"<tr><td></td><td colspan=6 class=bad>{_e(r['refused'])}</td></tr>")
    return (f"<h{level}>Padding by the agent</h{level}><table><tr><th>model</th><th>padding</th>"
            "<th>buckets</th><th>padding share</th><th>graphs not recorded</th><th>checks</th>"
            f"<th>max error</th></tr>{''.join(body)}</table>")


METERS = {"process": "its own GPU memory, NVML", "device": "the GPU's used memory, NVML",
          "rss": "its PSS (else RSS): host-memory mode"}


def _meter(source: Any) -> str:
    return METERS.get(source, "unknown")


def _budget(chart: dict[str, Any]) -> list[Any]:
    return [tuple(p) for p in chart.get("budget") or []]


def _zoom(chart: dict[str, Any]) -> str:
    """The growth on top of a large footprint, where the full chart shows a flat line."""
    zoom = chart.get("zoom")
    if zoom is None:
        return ""
    since, until, base = zoom["from_t"], zoom.get("to_t", float("inf")), zoom["baseline_bytes"]
    budget = [p for p in _budget(chart) if since <= p[0] <= until]
    before = [p for p in _budget(chart) if p[0] < since][-1:]
    return plot.memory_chart([tuple(p) for p in chart["points"] if since <= p[0] <= until],
                             [tuple(m) for m in chart["marks"] if since <= m[0] <= until],
                             budget=[(since, before[0][1])] + budget if before else budget,
                             baseline=base, time_origin=0.0, breaks=chart.get("breaks", ()),
                             budget_label=chart.get("budget_label", "budget"),
                             title=f"growth above {human_bytes(base)} (zoomed: "
                                   f"+{human_duration(since)} to +{human_duration(until)})")


def _e(value: Any) -> str:
    return html.escape(str(value))


def _summary_html(s: dict[str, Any]) -> str:
    procs = s.get("processes", 1)
    cells = [
        ("server seen for", human_duration(s["span_s"])
         + (f" (from +{human_duration(s['seen_from_s'])})" if s.get("seen_from_s") else "")),
        ("memory start → peak → end", f"{human_bytes(s['memory_start_bytes'])} → "
                                      f"{human_bytes(s['memory_peak_bytes'])} → "
                                      f"{human_bytes(s['memory_end_bytes'])}"),
        ("CUDA graphs recorded", f"{s['recordings']:,}"), ("compiles", s["compiles"]),
        ("recompiles", s["recompiles"]), ("recompile limit", _limit_text(s)),
        ("requests", f"{s['requests']:,}"), ("distinct shapes", f"{s['distinct_shapes']:,}"),
        ("stalls", f"{s['stalls']:,} ({human_duration(s['stall_seconds'])})"),
        ("out-of-memory events", s["ooms"]),
        ("memory per graph", "— (not measured: too few recordings)" if s["mb_per_graph"] is None
         else f"{human_bytes(s['mb_per_graph'] * 1e6)} (confidence "
              f"{s['mb_per_graph_confidence']:.2f})"),
    ]
    if procs > 1:
        cells.append(("server processes", f"{procs} (counts cover all of them)"))
    items = [f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in cells]
    items.append(f"<div class=wide><dt>{_e(_forecast_title(s))}</dt>"
                 f"<dd>{_e(_forecast_text(s))}</dd></div>")
    return "<dl class=summary>" + "".join(items) + "</dl>"


def _limit_text(s: dict[str, Any]) -> str:
    limit, hit = s.get("recompile_limit"), s.get("recompile_limit_hit")
    if hit == "agent":
        return f"{limit}, hit (reported by the agent)"
    if hit == "inferred":
        return f"{limit}, hit (inferred)"
    return f"not hit (limit {limit})" if limit is not None else "not hit"


def _forecast_title(s: dict[str, Any]) -> str:
    fc = s.get("forecast") or {}
    basis = fc.get("basis")
    if basis in ("reload decision", "oom_forecast alert"):
        return f"forecast at the {basis} (+{human_duration(fc['t'])})"
    return "forecast at the end"


def _forecast_text(s: dict[str, Any]) -> str:
    fc = s.get("forecast") or {}
    text = _one_forecast(fc)
    if s["ooms"]:
        at = f" at +{human_duration(s['first_oom_t'])}" if s.get("first_oom_t") is not None \
            else ""
        ran = f"ran out of memory{at} ({s['ooms']} OOM event{'s' if s['ooms'] > 1 else ''})"
        text = f"{text}; then it {ran}" if fc.get("basis") != "end" else ran
    elif fc.get("basis") == "end":
        near = fc.get("nearest")
        if near and near.get("seconds_to_oom") is not None and text.startswith(("no", "lev")):
            text += (f" (nearest during the run: OOM in "
                     f"{human_duration(near['seconds_to_oom'])} at +{human_duration(near['t'])})")
    return text


def _one_forecast(fc: dict[str, Any]) -> str:
    seconds, budget, level = fc.get("seconds_to_oom"), fc.get("budget_bytes"), \
        fc.get("level_bytes")
    if budget is None:
        return "no forecast (memory not known)"
    plateau = fc.get("plateau_bytes")
    tail = (f"{human_bytes(budget - level)} left of the {human_bytes(budget)} budget (at "
            f"{human_bytes(level)})" if level is not None and level < budget
            else f"budget {human_bytes(budget)}")
    if plateau is not None:
        tail += f", plateau {human_bytes(plateau)}"
    if level is not None and level >= budget:
        return f"over budget: {human_bytes(level)} of the {human_bytes(budget)} budget"
    if seconds is not None:
        driver = {"recordings": "CUDA graphs for new sizes", "unexplained":
                  "growth no recording explains", "trend": "linear trend"}.get(
            fc.get("driver") or "", "linear trend" if fc.get("seconds_to_oom_discovery") is None
            else "CUDA graphs for new sizes")
        return f"OOM in {human_duration(seconds)} ({driver}): {tail}"
    if fc.get("will_oom") is False:
        return f"levels off: {tail}"
    return f"no OOM forecast: {tail}"


def _chart_note(chart: dict[str, Any], report: dict[str, Any]) -> str:
    notes = []
    if chart["marks_outside"]:
        notes.append(f"{chart['marks_outside']} event(s) fall outside the samples' time range "
                     "and are not drawn")
    off, line = chart.get("budget_off_scale") or [], chart.get("budget") or []
    if off:
        until = f" until +{human_duration(line[0][0])}" if line else ""
        notes.append(f"budget {human_bytes(off[-1][1])}{until}: off this chart's scale (over "
                     "3x the server's peak), not drawn" + ("; the dashed line is the budget "
                                                          "from then on" if line else ""))
    if len(line) > 1 or (line and chart["points"] and line[0][0] > chart["points"][0][0] + 1):
        notes.append("the dashed budget line starts when that budget applied (the sample log "
                     "records each config and each poll's forecast) and steps where it changed")
    if report["input"]["mixed_time_bases"]:
        notes.append("the inputs mix time bases (agent logs: epoch seconds; recorded traces: "
                     "seconds since their process started): each is shown from its own first "
                     "record, so events of the two line up only roughly")
    return "".join(f"<p class=note>{_e(n)}</p>" for n in notes)


def _causes_html(causes: list[Any], several: bool) -> str:
    rows = [f"<td class=num>+{_e(human_duration(c['t']))}</td>"
            + (f"<td>{_e(c.get('server'))}</td>" if several else "")
            + f"<td><b>{_e(c['cause'])}</b><br>{_e(c['explanation'])}</td>"
            f"<td>{_e(_numbers(c, ('t', 'cause', 'explanation', 'server')))}</td>"
            for c in causes]
    head = ("at",) + (("server",) if several else ()) + ("cause", "numbers when found")
    return _table("Causes", "No causes found: memory and compiles behaved.", head, rows)


def _actions_html(actions: list[Any], several: bool) -> str:
    rows = [f"<td class=num>+{_e(human_duration(a['t']))}</td>"
            + (f"<td>{_e(a.get('server'))}</td>" if several else "")
            + f"<td{' class=bad' if a['action'] in ('reload', 'execute') else ''}>"
            f"{_e(a['action'])}</td><td>{_e(a['reason'])}</td>"
            f"<td>{_e(_target(a))}</td>"
            f"<td>{_e(_numbers(a, ('t', 'action', 'reason', 'server', 'pids', 'gpus')))}</td>"
            for a in actions]
    head = ("at",) + (("server",) if several else ()) + ("action", "reason", "target", "numbers")
    return _table("Actions", "The policy decided nothing: no alert, no reload.", head, rows)


def _target(a: dict[str, Any]) -> str:
    pids = ", ".join(map(str, a.get("pids") or []))
    return f"pid {pids}" if pids else "—"


def _table(title: str, empty: str, headers: tuple[Any, ...], rows: list[Any]) -> str:
    """A titled table of rows (each its cells' HTML), or the `empty` sentence."""
    if not rows:
        return f"<h2>{title}</h2><p>{empty}</p>"
    head = "".join(f"<th>{h}</th>" for h in headers)
    return f"<h2>{title}</h2><table><tr>{head}</tr>" + "".join(
        f"<tr>{r}</tr>" for r in rows) + "</table>"


def human_value(key: str, value: Any) -> str:
    """One number of a cause or an action as a person reads it: bytes in MiB/GiB, seconds as
    a duration, times from the start as "+12.3 s"."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_bytes_per_s"):
        return f"{human_bytes(value)}/s"
    if key.endswith("_bytes"):
        return human_bytes(value)
    if key in ("decided_t", "reached_at"):
        return f"+{human_duration(value)}"
    if key.startswith("seconds_") or key.endswith(("_seconds", "_s")):
        return human_duration(value)
    if key.endswith("_mb") or key in ("mb_so_far", "mb_per_graph"):
        return human_bytes(value * 1e6)
    if isinstance(value, float):
        return f"{value:.3g}"
    return f"{value:,}"


LABELS = {"seconds_to_oom": "OOM in", "seconds_to_oom_earliest": "at the earliest: OOM in",
          "seconds_to_oom_linear": "linear trend: OOM in",
          "seconds_to_oom_discovery": "discovery model: OOM in",
          "seconds_to_oom_unexplained": "unexplained growth: OOM in", "decided_t": "decided at",
          "reached_at": "reached at", "mb_per_graph": "memory per graph", "dry_run": "dry run",
          "mb_so_far": "grown so far", "window_s": "window"}


def _label(key: str) -> str:
    if key in LABELS:
        return LABELS[key]
    for suffix in ("_bytes_per_s", "_bytes", "_mb"):  # the value says its unit ("257 MiB")
        if key.endswith(suffix):
            key = key[: -len(suffix)] + (" per s" if suffix == "_bytes_per_s" else "")
    return key.replace("_", " ")


def _numbers(d: dict[str, Any], skip: tuple[Any, ...]) -> str:
    """The mapping's numbers in words; the linear trend's OOM only where it is not the OOM
    already said ("OOM in 57.9 s, linear trend: OOM in 57.9 s")."""
    if d.get("seconds_to_oom_linear") is not None and \
            d.get("seconds_to_oom_linear") == d.get("seconds_to_oom"):
        skip = skip + ("seconds_to_oom_linear",)
    return ", ".join(f"{_label(k)} {human_value(k, v)}" for k, v in d.items()
                     if k not in skip and v is not None and v != [] and v is not False)


def _shapes_html(sh: dict[str, Any], level: int) -> str:
    h = f"h{level}"
    if not sh["counts"]:
        return (f"<{h}>Input shapes</{h}><p>No varying input size seen: nothing to bucket. "
                "(The agent reports shapes for models wrapped in "
                "<code>torch_watchdog.agent.watch()</code>; recorded traces carry each "
                "request's shape.)</p>" + plot.histogram({}))
    best = sh["recommended"]
    counted = f"{sh['total']:,} {_e(sh['basis'])}" + (
        f", {sh['distinct']:,} distinct" if sh["total"] != sh["distinct"] else "")
    head = (f"<{h}>Input shapes</{h}><p>{counted}; sizes along dimension {sh['dimension']} "
            f"(of {sh['rank']}).</p>")
    hist = plot.histogram(dict(sh["counts"]), boundaries=best["boundaries"], unit=sh["basis"],
                          title=f"{sh['basis']} per size, {len(best['boundaries'])} suggested "
                                "buckets")
    return head + hist + _advisor_html(sh, best, level)


def _advisor_html(sh: dict[str, Any], best: dict[str, Any], level: int) -> str:
    rows, limit = sh["advisor"], sh.get("recompile_limit")
    known = any(r["memory_saved_bytes"] is not None for r in rows)
    # what the server built in this log, and at most one per bucket after
    now = sh.get("now") or {"what": "graphs / compiles", "count": None}
    before = now["count"]
    cells = "".join(
        f"<tr><td class=num>{len(r['boundaries'])}</td><td>{_e(_list(r['boundaries']))}</td>"
        f"<td class=num>{100 * r['padding_ratio']:.1f} %</td><td class=num>"
        + (f"{r['graphs_before']:,} → {r['graphs_after']:,}" if before is None else
           f"{before:,} → {min(before, r['graphs_after']):,}") + "</td>"
        + (f"<td class=num>{human_bytes(r['memory_saved_bytes'])}</td>" if known else "")
        + "</tr>" for r in rows)
    saved_head = "<th>memory saved</th>" if known else ""
    notes = []
    if known:
        notes.append(f"Memory saved: graphs saved × {human_bytes(sh['mb_per_graph'] * 1e6)} "
                     "per graph, as measured in this run.")
    else:
        notes.append("Memory saved: not known (no memory per CUDA graph was measured in this "
                     "run).")
    if now["what"] == "compiles" and before is not None and before < sh["distinct"] and \
            limit is None:  # past its limit a server runs eager: no graph serves those sizes
        notes.append(f"The server compiled {before} time{'s' if before != 1 else ''} for "
                     f"{sh['distinct']:,} sizes (automatic dynamic shapes: one graph serves "
                     "every size) and recorded no CUDA graph: buckets save no compile here; "
                     "under mode=\"reduce-overhead\" on a GPU they bound the CUDA graphs, one "
                     "per size otherwise.")
    if limit is not None:
        notes.append(f"The server compiles per size (dynamic=False) and hit its recompile limit "
                     f"of {limit}" + (f" after {before} compiles for {sh['distinct']:,} sizes"
                                      if before is not None else "")
                     + f": no more than {limit} buckets, or the sizes past the limit run eager "
                     "again.")
    return (f"<h{level}>Bucket advisor</h{level}><p>Pad each request up to the next boundary: "
            "one CUDA graph (or compile) per bucket instead of per size.</p><table><tr>"
            "<th>buckets</th><th>boundaries</th><th>padding overhead</th>"
            f"<th>{_e(now['what'])}</th>{saved_head}</tr>{cells}</table>"
            + "".join(f"<p class=note>{_e(n)}</p>" for n in notes)
            + f"<p>Suggested: {len(best['boundaries'])} buckets.</p>"
            f"<pre>{_e(apply_code(best['boundaries'], limit))}</pre>")


def apply_code(boundaries: Iterable[int], limit: Any = None) -> str:
    b = tuple(boundaries)
    limit_text = (f"this server's limit is {limit}" if limit is not None
                  else "8 by default")
    return (f"BUCKETS = {b}\n\n"
            "def bucket(n: int) -> int:\n"
            "    # pad the input up to this size (sizes above the last bucket: split or reject)\n"
            "    return next(b for b in BUCKETS if b >= n)\n\n"
            "# torch >= 2.9: record CUDA graphs for these sizes only\n"
            "torch._inductor.config.triton.cudagraph_capture_sizes = BUCKETS\n"
            "# dynamic=False: keep len(BUCKETS) <= the recompile limit "
            f"(torch._dynamo.config.recompile_limit; {limit_text})\n")


def _list(values: list[Any], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f", … ({len(values)} in all)" if len(values) > limit else "")
