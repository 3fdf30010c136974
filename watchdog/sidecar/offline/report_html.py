"""The post-mortem report's HTML (pure): one self-contained page from `report.build_report`'s
numbers — inline CSS and SVG (plot.py), no script, no external resource, every text escaped."""
from __future__ import annotations

import html
from typing import Any, Iterable

from torch_watchdog.sidecar.present import plot
from torch_watchdog.sidecar.present.plot import human_bytes, human_duration


# -- page -----------------------------------------------------------------------------------
CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:960px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top}th{background:#f5f5f5}.num{text-align:right;white-space:nowrap}
dl.summary{display:grid;grid-template-columns:repeat(4,1fr);gap:6px 18px}
dl.summary div{background:#f7f7f7;padding:6px 10px;border-radius:4px}dt{color:#666;font-size:12px}
dd{margin:0;font-weight:600}pre{background:#f5f5f5;padding:10px;overflow:auto}.note{color:#666}
.bad{color:#b00}"""


def render_html(report: dict) -> str:
    """One self-contained page: inline CSS and SVG, no script, no external resource."""
    s, chart = report["summary"], report["chart"]
    memory = plot.memory_chart([tuple(p) for p in chart["points"]],
                               [tuple(m) for m in chart["marks"]], budget=chart["budget_bytes"],
                               time_origin=0.0,  # the tables' times: from the trace's start
                               title=f"server memory ({s['memory_source'] or 'unknown'})")
    body = [f"<h1>torch-watchdog report</h1><p class=note>{_e(', '.join(report['input']['files']))}"
            f" — {report['input']['observations']:,} observations, "
            f"{report['input'].get('bad_lines', 0)} unreadable line(s)</p>",
            _summary_html(s), "<h2>Memory</h2>", memory, _zoom(chart), _chart_note(report),
            _causes_html(report["causes"]), _actions_html(report["actions"]),
            _shapes_html(report)]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            f"<title>torch-watchdog report</title><style>{CSS}</style></head><body>"
            + "".join(body) + "</body></html>\n")


def _zoom(chart: dict) -> str:
    """The growth on top of a large footprint, where the full chart shows a flat line."""
    zoom = chart.get("zoom")
    if zoom is None:
        return ""
    since, base = zoom["from_t"], zoom["baseline_bytes"]
    return plot.memory_chart([tuple(p) for p in chart["points"] if p[0] >= since],
                             [tuple(m) for m in chart["marks"] if m[0] >= since],
                             budget=chart["budget_bytes"], baseline=base, time_origin=0.0,
                             title=f"growth above {human_bytes(base)} (zoomed)")


def _e(value: Any) -> str:
    return html.escape(str(value))


def _summary_html(s: dict) -> str:
    cells = [
        ("trace span", human_duration(s["span_s"])),
        ("memory start → peak", f"{human_bytes(s['memory_start_bytes'])} → "
                                f"{human_bytes(s['memory_peak_bytes'])}"),
        ("CUDA graphs recorded", s["recordings"]), ("compiles", s["compiles"]),
        ("recompiles", s["recompiles"]), ("recompile limit hit", s["recompile_limit"] or "no"),
        ("requests", s["requests"]), ("distinct shapes", s["distinct_shapes"]),
        ("stalls", f"{s['stalls']} ({human_duration(s['stall_seconds'])})"),
        ("out-of-memory events", s["ooms"]),
        ("MB per graph", "—" if s["mb_per_graph"] is None else
         f"{s['mb_per_graph']:.3f} (confidence {s['mb_per_graph_confidence']:.2f})"),
        ("forecast", _forecast_text(s)),
    ]
    return "<dl class=summary>" + "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>"
                                          for k, v in cells) + "</dl>"


def _forecast_text(s: dict) -> str:
    if s["ooms"]:
        return f"ran out of memory ({s['ooms']} OOM event(s))"
    if s["will_oom"] is None:
        return "no forecast (too few recordings or no budget)"
    plateau = (f"plateau {human_bytes(s['plateau_bytes'])} vs budget "
               f"{human_bytes(s['budget_bytes'])}")
    if s["will_oom"]:
        return f"will run out in {human_duration(s['seconds_to_oom'])}: {plateau}"
    return f"levels off: {plateau}"


def _chart_note(report: dict) -> str:
    c, notes = report["chart"], []
    if c["marks_outside"]:
        notes.append(f"{c['marks_outside']} event(s) fall outside the samples' time range and "
                     "are not drawn")
    if report["input"]["mixed_time_bases"]:
        notes.append("the inputs mix time bases (agent logs: epoch seconds; recorded traces: "
                     "seconds since their process started): each is shown from its own first "
                     "record, so events of the two line up only roughly")
    return "".join(f"<p class=note>{_e(n)}</p>" for n in notes)


def _causes_html(causes: list) -> str:
    rows = [f"<td class=num>+{_e(human_duration(c['t']))}</td><td><b>{_e(c['cause'])}</b><br>"
            f"{_e(c['explanation'])}</td><td>{_e(_numbers(c, ('t', 'cause', 'explanation')))}"
            "</td>" for c in causes]
    return _table("Causes", "No causes found: memory and compiles behaved.",
                  ("at", "cause", "numbers when found"), rows)


def _actions_html(actions: list) -> str:
    rows = [f"<td class=num>+{_e(human_duration(a['t']))}</td><td"
            f"{' class=bad' if a['action'] == 'reload' else ''}>{_e(a['action'])}</td>"
            f"<td>{_e(a['reason'])}</td><td>{_e(_numbers(a, ('t', 'action', 'reason')))}</td>"
            for a in actions]
    return _table("Actions", "The policy decided nothing: no alert, no reload.",
                  ("at", "action", "reason", "numbers"), rows)


def _table(title: str, empty: str, headers: tuple, rows: list) -> str:
    """A titled table of rows (each its cells' HTML), or the `empty` sentence."""
    if not rows:
        return f"<h2>{title}</h2><p>{empty}</p>"
    head = "".join(f"<th>{h}</th>" for h in headers)
    return f"<h2>{title}</h2><table><tr>{head}</tr>" + "".join(
        f"<tr>{r}</tr>" for r in rows) + "</table>"


def _numbers(d: dict, skip: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items() if k not in skip and v is not None)


def _shapes_html(report: dict) -> str:
    sh = report["shapes"]
    if not sh["counts"]:
        return ("<h2>Input shapes</h2><p>No varying input size seen: nothing to bucket. (The "
                "agent reports shapes for models wrapped in <code>torch_watchdog.agent.watch()</code>; "
                "recorded traces carry each request's shape.)</p>" + plot.histogram({}))
    best = sh["recommended"]
    head = (f"<h2>Input shapes</h2><p>{sh['total']:,} {_e(sh['basis'])}, {sh['distinct']:,} "
            f"distinct; sizes along dimension {sh['dimension']} (of {sh['rank']}).</p>")
    hist = plot.histogram(dict(sh["counts"]), boundaries=best["boundaries"],
                          title=f"{sh['basis']} per size, {best['max_buckets']} suggested buckets")
    return head + hist + _advisor_html(sh["advisor"], best)


def _advisor_html(rows: list, best: dict) -> str:
    cells = "".join(
        f"<tr><td class=num>{r['max_buckets']}</td><td>{_e(_list(r['boundaries']))}</td>"
        f"<td class=num>{100 * r['padding_ratio']:.1f} %</td><td class=num>"
        f"{r['graphs_before']} → {r['graphs_after']}</td><td class=num>"
        f"{human_bytes(r['memory_saved_bytes'])}</td></tr>" for r in rows)
    return ("<h2>Bucket advisor</h2><p>Pad each request up to the next boundary: one CUDA graph "
            "(or compile) per bucket instead of per size.</p><table><tr><th>buckets</th>"
            "<th>boundaries</th><th>padding overhead</th><th>graphs</th><th>memory saved</th>"
            f"</tr>{cells}</table><p>Suggested: {best['max_buckets']} buckets.</p>"
            f"<pre>{_e(apply_code(best['boundaries']))}</pre>")


def apply_code(boundaries: Iterable[int]) -> str:
    b = tuple(boundaries)
    return (f"BUCKETS = {b}\n\n"
            "def bucket(n: int) -> int:\n"
            "    # pad the input up to this size (sizes above the last bucket: split or reject)\n"
            "    return next(b for b in BUCKETS if b >= n)\n\n"
            "# torch >= 2.9: record CUDA graphs for these sizes only\n"
            "torch._inductor.config.triton.cudagraph_capture_sizes = BUCKETS\n"
            "# dynamic=False: keep len(BUCKETS) <= the recompile limit "
            "(torch._dynamo.config.recompile_limit, 8 by default)\n")


def _list(values: list, limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f", … ({len(values)} in all)" if len(values) > limit else "")


