"""The status page: one self-contained HTML document (inline CSS, the chart as inline SVG, no
script, nothing fetched from elsewhere) drawn from the status dict of status.py.

Every text that comes from outside (cause details, reload outcomes, GPU UUIDs, the config) is
escaped; the chart comes from plot.py, which escapes its own text.
"""
from __future__ import annotations

import html
import urllib.parse
from typing import Any, Iterable, Optional

from torch_watchdog import __version__
from torch_watchdog.sidecar.present import plot
from torch_watchdog.sidecar.present.status import (SOURCE_NAMES, budget_text, chart_budget,
                                                   fmt_bytes, fmt_clock, fmt_duration, fmt_mb,
                                                   host_memory_mode, memory_text, oom_text,
                                                   over_budget, scope_text, stale_s, waiting,
                                                   waiting_lines)

REFRESH_S = 5
OFF_SCALE = 0.1   # a series under this share of the budget line: the line is left out

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em 2em;color:#222;background:#fff}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.05em;margin:1.2em 0 .4em;color:#444}
.sub{color:#666;margin:0 0 1em}section{max-width:1000px}
table{border-collapse:collapse}td,th{padding:.15em .9em .15em 0;text-align:left;
vertical-align:top}th{font-weight:600;color:#555}td.n{text-align:right;
font-variant-numeric:tabular-nums}.bad{color:#b00020;font-weight:600}.ok{color:#1b7f3b}
.cause{border-left:4px solid #d55e00;padding:.2em .6em;margin:.3em 0;background:#fff6f0}
.none{color:#666}
table.host td{white-space:nowrap}table.host td.wrap{white-space:normal}
.bar{background:#eee;height:8px;width:200px;display:inline-block}
.bar>span{background:#0072b2;height:8px;display:block}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _table(rows: Iterable[tuple[str, str]], cls: str = "") -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="{cls}">{body}</table>'


def _usage(used: Any, total: Any) -> str:
    if not used or not total:
        return ""
    pct = max(0.0, min(100.0, 100.0 * used / total))
    return f' <span class="bar" title="{pct:.0f} %"><span style="width:{pct:.0f}%"></span></span>'


def _memory(status: dict[str, Any]) -> str:
    m = status.get("memory") or {}
    server = m.get("server") or {}
    alive = {True: '<span class="ok">up</span>', False: '<span class="bad">down</span>',
             None: '<span class="none">not found yet</span>'}[server.get("alive")]
    rows = [("server process", alive),
            ("plotted", f"{_e(fmt_bytes(m.get('level_bytes')))} — "
                        f"{_e(SOURCE_NAMES.get(str(m.get('source')), 'nothing yet'))}")]
    if m.get("attribution"):
        rows.append(("attribution", _e(m["attribution"])))
    for uuid, b in sorted((server.get("gpu_bytes") or {}).items()):
        rows.append((f"server GPU {uuid}", _e(fmt_bytes(b))))
    if server.get("rss_bytes") is not None:
        rows.append(("server RSS", _e(fmt_bytes(server["rss_bytes"]))))
    for d in m.get("devices") or []:
        rows.append((f"device {d['uuid']}", f"{_e(fmt_bytes(d['used_bytes']))} used of "
                     f"{_e(fmt_bytes(d['total_bytes']))}"
                     f"{_usage(d['used_bytes'], d['total_bytes'])}"))
    return f'<section id="memory"><h2>Memory</h2>{_table(rows)}</section>'


def _chart(status: dict[str, Any]) -> str:
    hist = status.get("history") or {}
    points = [(float(t), float(b)) for t, b in hist.get("points") or []]
    marks = [(float(t), str(k)) for t, k in hist.get("marks") or []]
    source = SOURCE_NAMES.get(str((status.get("memory") or {}).get("source")), "memory")
    budget, notes = _chart_budget(status, points)
    try:
        name = (status.get("detail") or {}).get("server")
        many = len(status.get("servers") or []) > 1
        svg = plot.memory_chart(points, marks, budget=budget,
                                title=f"{name + ': ' if many and name else ''}{source} over time",
                                breaks=[float(t) for t in hist.get("breaks") or []])
    except Exception as exc:  # a chart bug must not take the rest of the page with it
        svg = f'<p class="bad">chart unavailable: {_e(repr(exc))}</p>'
    notes = _thinned_notes(status, marks) + notes
    return (f'<section id="chart"><h2>Memory over time</h2>{svg}'
            + "".join(f'<p class="sub">{_e(n)}</p>' for n in notes) + "</section>")


def _chart_budget(status: dict[str, Any], points: list[Any]) -> tuple[Optional[float], list[str]]:
    """The budget line on the plotted series' scale, and what to say about it. Left out when
    the series would be squashed flat under it (host-memory mode: an RSS of 1 GiB against the
    machine's RAM)."""
    fc, line = status.get("forecast") or {}, chart_budget(status)
    budget = fc.get("budget_bytes")
    if line is None or budget is None:
        return None, []
    top = max((b for _, b in points), default=0.0)
    if top < OFF_SCALE * line:
        return None, [f"budget ({fmt_bytes(budget)}) left off the chart: the memory plotted "
                      f"is under {OFF_SCALE:.0%} of it"]
    if line == budget:
        return line, []
    return line, [f"budget line: the memory budget ({fmt_bytes(budget)}) less what other "
                  f"processes use of it ({fmt_bytes(budget - line)})"]


def _thinned_notes(status: dict[str, Any], marks: list[Any]) -> list[str]:
    shown: dict[str, int] = {}
    for _, kind in marks:
        shown[kind] = shown.get(kind, 0) + 1
    totals = (status.get("history") or {}).get("marks_total") or {}
    return [f"{kind}: {shown.get(kind, 0):,} of {total:,} marks shown (thinned evenly to fit)"
            for kind, total in sorted(totals.items()) if total > shown.get(kind, 0)]


def _graphs(status: dict[str, Any]) -> str:
    g = status.get("graphs") or {}
    mb = g.get("mb_per_graph")
    rows = [("CUDA graphs recorded", g.get("recordings", 0)),
            ("distinct shapes", g.get("distinct_shapes", 0)),
            ("requests", g.get("requests", 0)),
            ("compiles", g.get("compiles", 0)), ("recompiles", g.get("recompiles", 0)),
            ("recompile-limit hits", g.get("recompile_limit_hits", 0)),
            ("compile time", fmt_duration(g.get("compile_seconds") or 0.0)),
            ("stalls", f"{g.get('stalls', 0)} ({fmt_duration(g.get('stall_seconds') or 0.0)})"),
            ("memory per graph", "not enough recordings yet" if mb is None else
             f"{fmt_mb(mb)} (confidence {g.get('mb_per_graph_confidence') or 0:.2f})")]
    if g.get("fx_cache_hits") or g.get("fx_cache_misses"):
        rows.append(("FX cache hits / misses", f"{g['fx_cache_hits']} / {g['fx_cache_misses']}"))
    body = _table((k, _e(v)) for k, v in rows)
    scope = f'<p class="sub" id="scope">{_e(scope_text(status.get("scope") or {}))}</p>'
    return f'<section id="graphs"><h2>Compiles and CUDA graphs</h2>{scope}{body}</section>'


def _causes(status: dict[str, Any]) -> str:
    causes = status.get("causes") or []
    elsewhere = [r for r in status.get("servers") or [] if r["active_causes"]
                 and r["server"] != (status.get("detail") or {}).get("server")]
    if not causes and elsewhere:  # "no active cause" only when no server has one
        body = ('<p class="none">none on this server; on other servers: '
                + "; ".join(f"{_link(r['server'])}: {_e(', '.join(r['active_causes']))}"
                            for r in elsewhere) + "</p>")
    elif not causes:
        body = '<p class="none">no active cause</p>'
    else:
        body = "".join(f'<div class="cause" data-cause="{_e(c["cause"])}"><b>{_e(c["cause"])}'
                       f"</b> since {_e(fmt_clock(c.get('since_t')))}: {_e(c['summary'])}</div>"
                       for c in causes)
    return f'<section id="causes"><h2>Active causes</h2>{body}</section>'


def _forecast(status: dict[str, Any]) -> str:
    fc = status.get("forecast") or {}
    seconds, earliest = fc.get("seconds_to_oom"), fc.get("seconds_to_oom_earliest")
    eta = ('<span class="bad">over budget now</span>' if over_budget(fc) else
           '<span class="ok">no OOM forecast</span>' if seconds is None else
           f'<span class="bad">~{_e(fmt_duration(seconds))}</span>')
    if seconds is not None and earliest is not None and earliest < seconds:
        # the policy acts on the trend's next step at its soonest
        eta += f" (at the earliest {_e(fmt_duration(earliest))}: the policy acts on this)"
    plateau = fc.get("plateau_bytes")
    rows = [("time to OOM", eta),
            ("linear trend", _e("none" if fc.get("seconds_to_oom_linear") is None
                                else "over budget now" if over_budget(fc)
                                and not fc["seconds_to_oom_linear"]
                                else fmt_duration(fc["seconds_to_oom_linear"]))),
            ("shape-discovery model", _e("not applicable yet"
                                         if fc.get("seconds_to_oom_discovery") is None
                                         else fmt_duration(fc["seconds_to_oom_discovery"]))),
            ("growth recordings do not explain", _e(
                "none" if fc.get("seconds_to_oom_unexplained") is None
                or fc.get("unexplained_bytes_per_s") is None else
                f"{fmt_bytes(fc.get('unexplained_bytes_per_s'))}/s: OOM in "
                f"{fmt_duration(fc['seconds_to_oom_unexplained'])}")),
            ("plateau", _e("unknown" if plateau is None else
                           f"{fmt_bytes(plateau)} ({'above' if fc.get('will_oom') else 'under'}"
                           " the budget)")),
            ("forecast level / budget", f"{_e(fmt_bytes(fc.get('level_bytes')))} / "
                                    f"{_e(fmt_bytes(fc.get('budget_bytes')))}"),
            ("shape space estimate", _e("unknown" if fc.get("shape_space_estimate") is None
                                        else f"{fc['shape_space_estimate']:,.0f} sizes"))]
    return (f'<section id="forecast"><h2>Forecast</h2><p>{_e(status.get("forecast_summary"))}'
            f"</p>{_table(rows)}</section>")


def _padding(status: dict[str, Any]) -> str:
    """The agent's padding per model: on/off, the plan, padding share, graphs not recorded,
    the checks and the largest error they saw."""
    rows = status.get("padding") or []
    if not rows:
        return ""
    head = ("<tr><th>model</th><th>padding</th><th>buckets</th><th>padding share</th>"
            "<th>graphs not recorded</th><th>checks</th><th>max error</th></tr>")
    body = []
    for r in rows:
        state = '<span class="ok">on</span>' if r["on"] else '<span class="bad">off</span>'
        share, saved = r.get("padding_fraction"), int(r.get("recordings_saved") or 0)
        checks = f"{r['checks']:,}" + (f" ({r['check_ms']:.1f} ms each)" if r.get("check_ms")
                                       is not None else "")
        errors = ", ".join(f"{k} {v:.2g}" for k, v in sorted((r.get("max_error") or {}).items()))
        body.append(
            f"<tr><td>{_e(r['model'])}</td><td>{state}</td>"
            f"<td>{_e(', '.join(map(str, r['buckets'])) or 'none yet')}</td>"
            f'<td class="n">{_e("?" if share is None else f"{100 * share:.1f} %")}</td>'
            f'<td class="n">{saved:,}</td>'
            f'<td class="n">{_e(checks)}</td><td>{_e(errors or "-")}</td></tr>')
        if r.get("refused"):
            body.append(f'<tr><td></td><td colspan="6" class="bad">{_e(r["refused"])}</td></tr>')
    return (f'<section id="padding"><h2>Padding (agent)</h2><table>{head}{"".join(body)}'
            "</table></section>")


def _link(name: str) -> str:
    return f'<a href="?{_e(urllib.parse.urlencode({"server": name}))}">{_e(name)}</a>'


def _label(row: dict[str, Any]) -> str:
    """The metrics' `server` label under a name it differs from (a `pgid:` name changes with
    each start; the label stays)."""
    label = row.get("label") or row["server"]
    return "" if label == row["server"] else f'<br><span class="none">metrics: {_e(label)}</span>'


def _servers(status: dict[str, Any]) -> str:
    """Every server on the host, one row each (nvitop's process table): a host with replicas
    is not one server. Its name opens its drill-down."""
    rows = status.get("servers") or []
    if not rows:
        return ""
    head = ("<tr><th>server</th><th>state</th><th>pids</th><th>memory</th>"
            "<th>against its budget</th><th>time to OOM</th><th>active causes</th>"
            "<th>last action</th></tr>")
    body = []
    for r in rows:
        state = {"up": '<span class="ok">up</span>', "down": '<span class="bad">down</span>'}.get(
            r["state"], f'<span class="none">{_e(r["state"])}</span>')
        oom = oom_text(r)
        up = r["state"] == "up"
        near = up and (r.get("over_budget") or r.get("seconds_to_oom") is not None)
        last = r.get("last_action")
        body.append(
            f'<tr class="server server-{_e(r["state"])}" data-server="{_e(r["server"])}">'
            f"<td>{_link(r['server'])}{_label(r)}</td><td>{state}</td>"
            f"<td>{_e(', '.join(map(str, r['pids'])) or '—')}</td>"
            f'<td class="n">{_e(memory_text(r))}</td>'
            f"<td>{_e(budget_text(r))}"
            f"{_usage(r.get('level_bytes'), r.get('budget_bytes')) if up else ''}</td>"
            f'<td class="{"bad" if near else ""}">{_e(oom)}</td>'
            f"<td class=\"wrap\">{_e(', '.join(r['active_causes']) or 'none')}</td>"
            f"<td class=\"wrap\">"
            f"{_e('none' if not last else fmt_clock(last['t']) + ' ' + last['summary'])}"
            "</td></tr>")
        if r.get("held"):
            body.append(f'<tr class="held" data-server="{_e(r["server"])}"><td></td>'
                        f'<td colspan="7" class="wrap"><span class="bad">reload held back</span>: '
                        f"{_e(r['held']['summary'])}</td></tr>")
        if r.get("freeze"):
            body.append(f'<tr class="frozen" data-server="{_e(r["server"])}"><td></td>'
                        f'<td colspan="7" class="wrap"><span class="bad">frozen</span>: '
                        f"{_e(r['freeze'])}</td></tr>")
    return (f'<section id="servers"><h2>Servers on this host</h2><table class="host">{head}'
            f'{"".join(body)}</table></section>')


def _detail_head(status: dict[str, Any]) -> str:
    """Whose the sections below are: the server asked for, or the one nearest to OOM."""
    detail = status.get("detail") or {}
    name = detail.get("server")
    if name is None:
        return ""
    rows = status.get("servers") or []
    others = [r["server"] for r in rows if r["server"] != name]
    if detail.get("chosen"):
        why = ('its own memory, counts, forecast and actions · <a href="?">all servers</a>'
               + (" · other servers: " + ", ".join(map(_link, others)) if others else ""))
    elif others:
        why = ("the server nearest to OOM; the others: " + ", ".join(map(_link, others)))
    else:
        return ""
    asked = detail.get("asked")
    missing = (f'<p class="bad">no server {_e(asked)} here: below, the one nearest to OOM</p>'
               if asked else "")
    return (f'<section id="detail">{missing}<h2 class="server-name">Server {_e(name)}</h2>'
            f'<p class="sub">{why}</p></section>')


def _held(status: dict[str, Any]) -> str:
    """The reload this server's forecast calls for, held back: why, and until when."""
    name = (status.get("detail") or {}).get("server")
    row = next((r for r in status.get("servers") or [] if r["server"] == name), None)
    if not row or not row.get("held"):
        return ""
    return (f'<section id="held"><div class="cause held-back" data-reason='
            f'"{_e(row["held"].get("reason"))}"><b>reload held back</b>: '
            f"{_e(row['held']['summary'])}</div></section>")


def _actions(status: dict[str, Any]) -> str:
    actions = status.get("actions") or []
    if not actions:
        body = '<p class="none">no action taken</p>'
    else:
        many = len(status.get("servers") or []) > 1 and \
            not (status.get("detail") or {}).get("chosen")
        body = "<table>" + "".join(
            f'<tr class="action action-{_e(a["action"])}"><td>{_e(fmt_clock(a["t"]))}</td>'
            + (f"<td>{_e(a.get('server') or '')}</td>" if many else "")
            + f"<td>{_e(a['summary'])}</td></tr>" for a in actions) + "</table>"
    totals = ", ".join(f"{_e(k)} {_e(v)}" for k, v in sorted(
        (status.get("actions_total") or {}).items()))
    chosen = (status.get("detail") or {}).get("chosen")
    return (f'<section id="actions"><h2>Last actions'
            f'{" of server " + _e(status["detail"]["server"]) if chosen else ""}</h2>{body}'
            f'<p class="sub">totals of every server on this host: {totals or "none"}</p>'
            "</section>")


def _sources(status: dict[str, Any]) -> str:
    sources = status.get("sources") or {}
    ev = status.get("events") or {}
    host_mode = host_memory_mode(status)
    rows = [(name, '<span class="ok">up</span>' if up else
             '<span class="none">not used: no GPU here (host-memory mode: the server\'s own '
             "memory, PSS, against its cgroup's limit or what the machine has)</span>"
             if name == "nvml" and host_mode else
             f'<span class="none">no server {"now" if status.get("stopped") else "yet"}</span>'
             if name in ("agent", "process")
             and waiting(status) else
             '<span class="bad">down</span>')
            for name, up in sorted(sources.items())]
    dropped = sum((ev.get("dropped_total") or {}).values())
    rows.append(("agent events", _e(f"{ev.get('received_total', 0):,} received, {dropped:,} "
                                    f"dropped, {ev.get('agent_lost_total', 0):,} lost by agents")))
    return f'<section id="sources"><h2>Sources</h2>{_table(rows)}</section>'


def _waiting(status: dict[str, Any]) -> str:
    """Before any server: one state, and how to connect one (no forecast, no chart)."""
    head, how = waiting_lines(status)
    return (f'<section id="waiting"><h2>Waiting for a server</h2><p>{_e(head)}</p>'
            f"<p>{_e(how)}</p></section>")


def _stale(status: dict[str, Any], now: float) -> str:
    """A red line while the last poll is overdue: what the page shows is old."""
    late = stale_s(status, now)
    return "" if late is None else (
        f'<p class="bad" id="stale">stale: no poll for {_e(fmt_duration(late))}; the numbers '
        "below are from the last one (the sidecar's log says why)</p>")


def render_page(status: dict[str, Any], now: float) -> str:
    side = status.get("sidecar") or {}
    if status.get("t") is None:
        sub = "started; waiting for the first poll"
    else:
        since = side.get("watching_since_t")
        sub = (f"last poll {fmt_clock(status['t'])} ({fmt_duration(max(0.0, now - status['t']))}"
               f" ago)" + (f", watching for {fmt_duration(now - since)}" if since else "")
               + f", {side.get('polls', 0):,} polls, reload method "
               f"{side.get('reload_method', '?')}{' (dry run)' if side.get('dry_run') else ''}")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>torch-watchdog status</title><style>{CSS}</style></head><body>"
        f"<h1>torch-watchdog</h1>{_stale(status, now)}<p class=\"sub\">{_e(sub)} · version "
        f"{_e(side.get('version', __version__))} · <a href=\"status.json\">status.json</a> · "
        '<a href="metrics">metrics</a></p>'
        + (_waiting(status) if waiting(status) else
           ("" if (status.get("detail") or {}).get("chosen") else _servers(status))
           + _detail_head(status) + _held(status) + _causes(status) + _forecast(status)
           + _chart(status) + _memory(status) + _graphs(status) + _padding(status))
        + _actions(status) + _sources(status)
        + "</body></html>\n")
