"""The sidecar's status as one JSON-able dict (served as /status.json, drawn by page.py), and
its terminal summary (`torch-watchdog status`). Pure: built from a published `StatusView`.

Memory is shown in binary units (MiB, GiB, like the chart and nvidia-smi), the memory per CUDA
graph too (the estimate is kept in decimal MB, `mb_per_graph`, as its metric is named).
"""
from __future__ import annotations

import math
from typing import Any, Optional

from torch_watchdog.sidecar.present.history import SeriesView, StatusView
from torch_watchdog.sidecar.present.units import (counted, fmt_bytes, fmt_clock, fmt_duration,
                                                  fmt_mb, fmt_share)

GRAPH_KEYS = ("recordings", "warmups", "distinct_shapes", "requests", "compiles", "recompiles",
              "recompile_limit_hits", "compile_seconds", "graph_breaks", "stalls",
              "stall_seconds", "ooms", "mb_per_graph", "mb_per_graph_confidence",
              "fx_cache_hits", "fx_cache_misses")
FORECAST_KEYS = ("seconds_to_oom", "seconds_to_oom_earliest", "seconds_to_oom_linear",
                 "seconds_to_oom_discovery", "plateau_bytes", "budget_bytes", "level_bytes",
                 "will_oom", "shape_space_estimate", "growth_bytes_per_s",
                 "seconds_to_oom_unexplained", "unexplained_bytes_per_s", "driver", "gpu_uuid")
SOURCE_NAMES = {"process": "server process GPU memory (NVML)",
                "device": "device used memory (NVML)",
                "rss": "the server's own memory, PSS (host-memory mode)"}


# -- formatting: present/units.py (one rule for every surface) ------------------------------
__all__ = ["fmt_bytes", "fmt_clock", "fmt_duration", "fmt_mb", "build_status", "format_terminal"]


def _finite(value: Any) -> Any:
    """JSON has no Infinity/NaN: they become null (here: "not known" or "never")."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# -- summaries ---------------------------------------------------------------------------------
def cause_summary(cause: str, detail: dict[str, Any], graphs: dict[str, Any]) -> str:
    """A cause in one line, with the current numbers where they are kept up to date."""
    if cause == "cudagraph_per_shape":
        rec, mb = graphs.get("recordings") or detail.get("recordings", 0), \
            graphs.get("mb_per_graph") or detail.get("mb_per_graph")
        text = f"{rec:,} CUDA graphs for {graphs.get('distinct_shapes', 0):,} distinct shapes"
        return text + (f", {fmt_mb(mb)} each, {fmt_mb(mb * rec)} so far" if mb else "")
    if cause == "recompile_storm":
        return (f"{detail.get('recompiles_in_window', '?')} recompiles within "
                f"{fmt_duration(detail.get('window_s', 0))}, "
                f"{fmt_duration(graphs.get('compile_seconds') or 0)} compiling so far")
    if cause == "recompile_limit_eager_fallback":
        where = f" in {detail['function']}" if detail.get("function") else ""
        how = "reported by the agent" if detail.get("source") == "agent" else "inferred"
        return f"recompile limit {detail.get('limit', '?')} reached{where} ({how}): " \
               "new shapes run eager"
    if cause == "memory_growth_unexplained":
        return (f"{fmt_mb(detail.get('unexplained_mb', 0))} of "
                f"{fmt_mb(detail.get('growth_mb', 0))} growth explained by no recording or "
                "compile")
    return ", ".join(f"{k}={v}" for k, v in list(detail.items())[:4])


def padding_rows(padding: dict[str, Any]) -> list[dict[str, Any]]:
    """The agent's padding, one row per padded model (`watch(..., pad=...)`)."""
    rows = []
    for model, v in sorted((padding or {}).items()):
        checks, seconds = v.get("checks") or 0, v.get("check_seconds") or 0.0
        rows.append({"model": model, "on": bool(v.get("on")), "buckets": list(v.get("buckets")
                     or []), "padding_fraction": v.get("padding_fraction"),
                     "recordings_saved": v.get("recordings_saved"), "checks": checks,
                     "check_ms": round(1e3 * seconds / checks, 3) if checks else None,
                     "max_error": dict(v.get("max_error") or {}), "error": v.get("error"),
                     "refused": v.get("refused"), "summary": padding_summary(model, v)})
    return rows


def padding_summary(model: str, v: dict[str, Any]) -> str:
    """A padded model in one line: "llm: on, 8 buckets (256 … 2048), 11.9 % of tokens padding,
    1,990 CUDA graphs not recorded, 9 checks (12.1 ms each), max error float16 0.0021"."""
    if not v.get("on"):
        error = v.get("error")
        return (f"{model}: OFF (a check refused it" + (f", error {error:.3g}" if error is not None
                                                        else "") + f"): {v.get('refused') or ''}")
    b = list(v.get("buckets") or [])
    plan = f"{len(b)} buckets" + (f" ({b[0]} … {b[-1]})" if len(b) > 1 else
                                  f" ({b[0]})" if b else "")
    parts = [f"{model}: on, {plan}"]
    if v.get("padding_fraction") is not None:
        parts.append(f"{100 * v['padding_fraction']:.1f} % of tokens padding")
    parts.append(f"{v.get('recordings_saved') or 0:,} CUDA graphs not recorded")
    checks = v.get("checks") or 0
    if checks:
        parts.append(f"{checks} checks ({1e3 * (v.get('check_seconds') or 0) / checks:.1f} ms "
                     "each)")
    errors = v.get("max_error") or {}
    if errors:
        parts.append("max error " + ", ".join(f"{k} {e:.2g}" for k, e in sorted(errors.items())))
    return ", ".join(parts)


def over_budget(fc: dict[str, Any]) -> bool:
    """At or over the budget now: no time left to forecast ("~0.0 s" said nothing)."""
    level, budget = fc.get("level_bytes"), fc.get("budget_bytes")
    return level is not None and budget is not None and level >= budget


def forecast_summary(fc: dict[str, Any]) -> str:
    seconds = fc.get("seconds_to_oom")
    if fc.get("budget_bytes") is None:
        return "no forecast (memory not known yet)"
    if over_budget(fc):
        return (f"over budget: {fmt_bytes(fc.get('level_bytes'))} of the "
                f"{fmt_bytes(fc.get('budget_bytes'))} budget")
    if seconds is None:
        text = "no OOM forecast"
    else:
        model = "discovery model" if fc.get("seconds_to_oom_discovery") is not None \
            else "linear trend"
        text = f"OOM in ~{fmt_duration(seconds)} ({model})"
    plateau = fc.get("plateau_bytes")
    if plateau is not None:
        verdict = "above the budget: it will run out" if fc.get("will_oom") \
            else "under the budget: no OOM expected"
        text += f"; plateau {fmt_bytes(plateau)}, {verdict}"
    return text + f"; budget {fmt_bytes(fc.get('budget_bytes'))}"


def action_summary(a: dict[str, Any]) -> str:
    d, action, reason = a.get("detail") or {}, a.get("action"), a.get("reason")
    eta = d.get("seconds_to_oom")
    eta_text = f", OOM in ~{fmt_duration(eta)}" if eta is not None else ""
    if action == "alert":
        forecast = reason in ("oom_forecast", "reload_suppressed")
        return f"alert {reason}{eta_text if forecast else ''}"
    # a reload names its cause (cudagraph_per_shape, memory_growth_unexplained), where known
    cause = a.get("cause") or d.get("cause") or reason
    if action == "reload":
        return f"reload decided ({cause}{eta_text}){' — dry run' if d.get('dry_run') else ''}"
    if action == "freeze":
        return (f"freeze asked ({cause}{eta_text}): new sizes to run without CUDA graphs"
                + (" — dry run" if d.get("dry_run") else ""))
    if action == "unfreeze":
        return "unfreeze asked by hand: new sizes are recorded again"
    if action in ("reload_ok", "reload_not_done", "reload_failed"):
        took = d.get("reload_seconds")
        done = {"reload_ok": "reload done", "reload_failed": "reload failed"}.get(
            action, "reload not done")
        return f"{done}: {d.get('outcome', '')}" + (f" ({fmt_duration(took)})" if took else "")
    return f"{action} {cause if action == 'execute' else reason}"


# -- the dict ---------------------------------------------------------------------------------
def build_status(view: Optional[StatusView], now: float,
                 server: Optional[str] = None) -> dict[str, Any]:
    """Everything the page and `torch-watchdog status` show; `view` None: no poll yet.

    `servers` lists every server on the host (its state, memory against its budget, time to
    OOM, causes, last action, a reload held back); the other sections are about one server,
    `server` (the drill-down) or else the one nearest to OOM, and never mix in another's."""
    if view is None:
        return {"t": None, "age_s": None, "sidecar": {}, "memory": {"source": None,
                "level_bytes": None, "devices": [], "server": {}}, "graphs": {}, "causes": [],
                "forecast": {}, "forecast_summary": "no poll yet", "actions": [], "servers": [],
                "padding": [], "stopped": [], "detail": {"server": None, "chosen": False},
                "actions_total": {}, "sources": {}, "events": {},
                "history": {"points": [], "marks": [], "marks_total": {}, "breaks": []}}
    s = view.snapshot
    focus = s.focus if s.focus is not None else next(  # a Snapshot built without its focus
        (name for name, v in s.servers.items() if v.get("estimates") == s.estimates), None)
    chosen = server is not None and (server in s.servers or server in view.servers)
    name = server if chosen else focus
    listed = s.servers.get(name or "")
    series = view.servers.get(name or "")
    if listed is None and series is None:  # one server, or a Snapshot of one (no servers)
        estimates, fc_all, found = s.estimates, s.forecast, list(view.causes)
        points, marks, totals, breaks = view.points, view.marks, view.marks_total, view.breaks
        source, server_mem = view.memory_source, {"alive": s.server_alive, "gpu_bytes": dict(
            s.server_gpu_bytes), "rss_bytes": s.server_rss_bytes}
        devices, actions_of = s.devices, list(view.actions)
    else:
        v = listed or {}
        estimates, fc_all = {**v.get("estimates", {}), **v.get("forecast", {})}, \
            v.get("forecast", {})
        # a History fed Snapshots without servers has the host's series alone (one server)
        series = series or SeriesView(view.points, view.memory_source, view.marks,
                                      view.marks_total, view.breaks, causes=view.causes)
        found = list(series.causes)
        points, marks, totals, breaks = series.points, series.marks, series.marks_total, \
            series.breaks
        source = series.memory_source
        server_mem = {"alive": False if listed is None else v.get("up"),
                      "gpu_bytes": dict(v.get("gpu_bytes") or {}), "rss_bytes": v.get(
                          "rss_bytes")}
        gpus = set(v.get("gpus") or ())
        devices = tuple(d for d in s.devices if d.uuid in gpus) if gpus else s.devices
        # the detail block's server's own actions (the host's: one per row, `last_action`)
        actions_of = [a for a in view.actions if a.get("server") in (None, name)]
    graphs = {k: estimates.get(k) for k in GRAPH_KEYS if k in estimates}
    fc = {k: fc_all.get(k) for k in FORECAST_KEYS if k in fc_all}
    causes = [{"cause": c.get("cause"), "since_t": c.get("t"), "server": name,
               "summary": cause_summary(str(c.get("cause")), c, graphs),
               "detail": {k: v for k, v in c.items() if k not in ("cause", "t")}}
              for c in found]
    rows = server_rows(view, now)
    out: dict[str, Any] = _finite({
        "t": s.t, "age_s": round(max(0.0, now - s.t), 3),
        "sidecar": {**view.info, "watching_since_t": view.first_t},
        # whose the sections below are: `server` if asked for (`chosen`), else the one nearest
        # to OOM; `asked`: a server asked for that is not known
        "detail": {"server": name, "chosen": chosen,
                   "asked": server if server is not None and not chosen else None},
        "memory": {
            "source": source, "level_bytes": points[-1][1] if points else None,
            "attribution": attribution_note(source, s.gpu_attribution),
            "devices": [{"uuid": d.uuid, "used_bytes": d.used_bytes, "total_bytes":
                         d.total_bytes, "free_bytes": d.free_bytes} for d in devices],
            "server": server_mem},
        "graphs": graphs, "scope": _scope(view, name), "causes": causes, "forecast": fc,
        "padding": padding_rows(estimates.get("padding") or {}),
        "forecast_summary": forecast_summary(fc),
        "actions": [{**a, "summary": action_summary(a)} for a in reversed(actions_of)],
        # every server on the host, listed now or gone, in name order
        "servers": rows,
        "host_causes": sum(len(r["causes"]) for r in rows),
        "stopped": list(s.stopped),
        "actions_total": dict(s.actions_total), "sources": dict(s.sources_up),
        "source_errors": {"nvml": s.nvml_error} if s.nvml_error else {},
        "events": {"received_total": s.events_received_total,
                   "dropped_total": dict(s.events_dropped_total),
                   "agent_lost_total": s.agent_events_lost_total},
        "history": {"points": [list(p) for p in points],
                    "marks": [list(m) for m in marks],
                    "marks_total": dict(totals),
                    "breaks": list(breaks)},
    })
    return out


def server_rows(view: StatusView, now: float) -> list[dict[str, Any]]:
    """One row per server, as nvitop lists processes: its state (up; down from the poll its
    last process exits; stopped once the sidecar let it go), its memory against its budget,
    time to OOM, active causes, last action and a reload held back."""
    s = view.snapshot
    rows = []
    for name in sorted(set(s.servers) | set(view.servers)):
        v, series = s.servers.get(name), view.servers.get(name)
        est, fc = (v or {}).get("estimates") or {}, (v or {}).get("forecast") or {}
        found = list(series.causes) if series else [
            {"cause": c} for c in (v or {}).get("active_causes") or ()]
        last = next((a for a in reversed(view.actions) if a.get("server") == name), None)
        held = (v or {}).get("held")
        fc_view = {k: fc.get(k) for k in FORECAST_KEYS}
        state = "stopped" if v is None else "down" if v.get("up") is False else "up"
        rows.append({
            "server": name, "label": str((v or {}).get("label") or name), "state": state,
            "pids": list((v or {}).get("pids") or []), "gpus": list((v or {}).get("gpus") or []),
            "memory_bytes": est.get("memory_bytes"),
            "level_bytes": fc.get("level_bytes"), "budget_bytes": fc.get("budget_bytes"),
            "seconds_to_oom": fc.get("seconds_to_oom"), "over_budget": over_budget(fc_view),
            "forecast_summary": forecast_summary(fc_view) if v else "stopped: no forecast",
            "active_causes": [c["cause"] for c in found],
            "causes": [{"cause": c["cause"], "since_t": c.get("t"),
                        "summary": cause_summary(str(c["cause"]), c, est)} for c in found],
            "recordings": est.get("recordings"), "compiles": est.get("compiles"),
            "recompiles": est.get("recompiles"),
            "last_action": None if last is None else {"t": last["t"], "action": last["action"],
                                                      "summary": action_summary(last)},
            "held": None if not held else {**held, "summary": held_summary(held, now)},
            "freeze": freeze_summary((v or {}).get("freeze")),
            "last_seen_t": series.last_t if series else s.t})
    return rows


HELD_WORDS = {
    "dry_run": "dry run (policy.dry_run): reloads are decided, never carried out",
    "method_none": "reload.method is none: the sidecar alerts, it never reloads",
    "concurrency_cap": "another server's reload is under way (policy.max_concurrent_reloads)",
    "frozen": "the server's recording is frozen (policy.remedy): reloaded only if the memory "
              "still grows",
    "remedy_freeze": "policy.remedy is freeze: the sidecar freezes recording, it never reloads",
}
PRECONDITIONS = {
    "refused": "the last reload was refused (a PodDisruptionBudget or the like)",
    "no_process": "no process of the server is left to reload",
    "shared_gpu": ("its memory is read on GPUs it shares with another server: growth cannot "
                   "be pinned on it, so it is alerted, not reloaded"),
}


def freeze_summary(freeze: Optional[dict[str, Any]]) -> Optional[str]:
    """The freeze in one line, while it stands or after it did not take: "recording frozen at
    312 sizes since 14:02:11: new sizes run without CUDA graphs; pad or bucket the inputs to
    8 lengths (64, 128, ...) to end it"; None: never asked, or ended by hand."""
    if not freeze or freeze.get("released_t") is not None:
        return None
    limited = freeze.get("rerecord_limited") or {}
    if freeze.get("asked_t") is None:   # torch's own re-record limit (2.15), not a freeze
        limits = sorted(set(limited.values()))
        return (f"torch stopped recording {len(limited)} graph(s) at "
                f"cudagraph_dynamic_shape_rerecord_limit={'/'.join(map(str, limits))}: their "
                "new sizes run without CUDA graphs")
    if not freeze.get("frozen"):
        why = freeze.get("unavailable") or "no agent answered"
        return f"freeze asked at {fmt_clock(freeze.get('asked_t'))} did not take: {why}"
    sizes = freeze.get("sizes_kept")
    text = (f"recording frozen{f' at {sizes} sizes' if sizes is not None else ''} since "
            f"{fmt_clock(freeze.get('since'))}: new sizes run without CUDA graphs")
    advice = freeze.get("advice") or {}
    if advice.get("buckets"):
        cut = advice["buckets"]
        shown = ", ".join(map(str, cut[:8])) + (", ..." if len(cut) > 8 else "")
        text += (f"; pad or bucket {advice.get('model')}'s dimension {advice.get('dimension')} "
                 f"to {len(cut)} lengths ({shown}) to end it")
    return text


def held_summary(held: dict[str, Any], now: float) -> str:
    """Why the reload the forecast calls for is held back, and until when, in one line:
    "cooldown until 12:10:01 (9.5 min left): 600 s after the reload at 12:00:01"."""
    reason, until = held.get("reason"), held.get("until_t")
    when = "" if until is None else \
        f" until {fmt_clock(until)} ({fmt_duration(max(0.0, until - now))} left)"
    if reason == "cooldown":
        text = (f"cooldown{when}: policy.cooldown_s {fmt_duration(held.get('cooldown_s'))} "
                f"after the reload at {fmt_clock(held.get('last_reload_t'))}")
    elif reason == "hourly_maximum":
        text = (f"hourly maximum{when}: {held.get('reloads_last_hour')} reloads in the last "
                f"hour, policy.max_reloads_per_hour {held.get('max_reloads_per_hour')}")
    elif reason == "precondition":
        text = PRECONDITIONS.get(str(held.get("precondition")), "a precondition failed") + (
            f"; asked again at {fmt_clock(until)}" if until is not None else "")
    else:
        text = HELD_WORDS.get(str(reason), str(reason)) + when
    return f"{text} (held since {fmt_clock(held.get('since_t'))})"


def _scope(view: StatusView, focus: Optional[str]) -> dict[str, Any]:
    """Which process the counters belong to: a reload or a restart gives the server a new
    process and its counters start again (the chart, marks and actions cover the whole run)."""
    server = view.snapshot.servers.get(focus or "", {})
    since = next((a for a in reversed(view.actions) if a.get("action") in ("reload_ok", "restart")
                  and a.get("server") in (None, focus)), None)
    return {"server": focus, "pids": list(server.get("pids") or []),
            "since_t": since["t"] if since else view.first_t,
            "since": {"reload_ok": "reload", "restart": "restart"}.get(
                since["action"], "") if since else "start"}


def attribution_note(source: Optional[str], setting: Optional[str]) -> Optional[str]:
    """Why the plotted memory is the device's rather than the server's processes' (config
    gpu.attribution), or why there is none; None when there is nothing to explain."""
    if source == "device" and setting == "device":
        return ("gpu.attribution device: the used memory of the server's GPUs, whoever holds "
                "it, is taken as the server's")
    if source == "device":
        return ("device-level: NVML lists none of the server's processes (in a pod without "
                "hostPID their pids are not the host's), so the used memory of its GPUs is "
                "taken as the server's: right while the server has its GPUs to itself "
                "(gpu.attribution auto)")
    if source is None and setting == "process":
        return ("no reading: gpu.attribution process and NVML lists none of the server's "
                "processes (in Kubernetes: the node-level mode, with hostPID)")
    return None


STALE_POLLS = 5      # polls missed before the status is called stale
STALE_MIN_S = 5.0    # … and at least this long: the page is rebuilt about once a second


def stale_s(status: dict[str, Any], now: float) -> Optional[float]:
    """How long the last poll is overdue by, where the status is stale (the loop stopped
    polling, or every poll fails before its end): the page says so in red, `status` exits 3.
    None: fresh, or no poll yet."""
    t = status.get("t")
    if t is None:
        return None
    every = (status.get("sidecar") or {}).get("poll_interval_s") or 1.0
    age = now - t
    return age if age > max(STALE_MIN_S, STALE_POLLS * every) else None


def host_memory_mode(status: dict[str, Any]) -> bool:
    """No GPU here: the server's own memory against its cgroup's limit or the machine's
    (NVML down is expected)."""
    mem = status.get("memory") or {}
    return (mem.get("source") == "rss" and not mem.get("devices")) or no_gpu(status)


# NVML's own words for a host without the NVIDIA driver (or without nvidia-ml-py)
NO_GPU_ERRORS = ("LibraryNotFound", "DriverNotLoaded", "No module named")


def no_gpu(status: dict[str, Any]) -> bool:
    """NVML is down because this host has no NVIDIA driver: nothing is wrong."""
    why = (status.get("source_errors") or {}).get("nvml") or ""
    return not (status.get("memory") or {}).get("devices") and \
        any(e in why for e in NO_GPU_ERRORS)


def waiting(status: dict[str, Any]) -> bool:
    """Polling, but no server: none yet (no agent said hello and no configured server was
    found), or every one known has stopped."""
    graphs = status.get("graphs") or {}
    rows = status.get("servers") or []
    if status.get("t") is not None and status.get("stopped") and \
            all(r.get("state") == "stopped" for r in rows):
        return True  # every server it knew has stopped (their rows stay, marked stopped)
    return status.get("t") is not None and not status.get("servers") and \
        not (status.get("scope") or {}).get("pids") and \
        ((status.get("memory") or {}).get("server") or {}).get("alive") is None and \
        not any(graphs.get(k) for k in ("recordings", "compiles", "requests", "distinct_shapes")) \
        and not (status.get("history") or {}).get("marks")


def waiting_lines(status: dict[str, Any]) -> list[str]:
    """What the sidecar waits for, and how to connect a server (the page's and `status`'s)."""
    sock = (status.get("sidecar") or {}).get("socket") or "the sidecar's agent.socket_path"
    stopped = status.get("stopped") or []
    head = (f"no server now: {', '.join(stopped)} stopped (no process of "
            f"{'it' if len(stopped) == 1 else 'them'} is left); the sidecar waits for "
            f"{'it' if len(stopped) == 1 else 'one'} to start again, or for another. What it did "
            "until then: `torch-watchdog report` over the sample log." if stopped else
            f"no server yet: no agent has said hello on {sock}, and no configured server "
            "(server.unit, server.pidfile, servers) was found.")
    return [head,
            f"Connect one: start the server with TORCH_WATCHDOG_SOCKET={sock} in its "
            "environment and `import torch_watchdog.agent.auto` as its first import "
            "(docs/agent.md, \"Run it, step by step\")."]


def chart_budget(status: dict[str, Any]) -> Optional[float]:
    """The budget on the chart's scale. The forecast measures the device (or host) against its
    budget; the chart may plot the server's own memory, so the line is where the server's
    memory would meet the budget if everything else stays as it is now."""
    fc, mem = status.get("forecast") or {}, status.get("memory") or {}
    budget, level, series = fc.get("budget_bytes"), fc.get("level_bytes"), mem.get("level_bytes")
    if budget is None:
        return None
    out: Optional[float] = budget if level is None or series is None else \
        budget - (level - series)
    return out


# -- the terminal ------------------------------------------------------------------------------
def _memory_lines(m: dict[str, Any]) -> list[str]:
    lines = []
    server = m.get("server") or {}
    parts = [f"{fmt_bytes(m.get('level_bytes'))} "
             f"({SOURCE_NAMES.get(str(m.get('source')), 'unknown')})"]
    if server.get("rss_bytes") is not None:
        parts.append(f"RSS {fmt_bytes(server['rss_bytes'])}")
    alive = server.get("alive")
    parts.append({True: "up", False: "DOWN", None: "not found"}[alive])
    lines.append("server   " + ", ".join(parts))
    if m.get("attribution"):
        lines.append(f"         {m['attribution']}")
    for uuid, b in sorted((server.get("gpu_bytes") or {}).items()):
        lines.append(f"         {uuid}: server {fmt_bytes(b)}")
    for d in m.get("devices") or []:
        lines.append(f"device   {d['uuid']}: {fmt_bytes(d['used_bytes'])} used of "
                     f"{fmt_bytes(d['total_bytes'])}")
    return lines


def scope_text(scope: dict[str, Any]) -> str:
    """Whose counters these are, in words: "counts of server a (pid 12) since the reload at
    12:00:01"."""
    who = f"server {scope['server']}" if scope.get("server") else "the server"
    pids = scope.get("pids") or []
    if pids:
        who += f" (pid{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))})"
    since = scope.get("since")
    when = fmt_clock(scope.get("since_t"))
    if since in ("reload", "restart") and not pids:
        return (f"counts of {who} since the {since} at {when}: no process of it has started "
                "since, so they are 0; the chart and the actions cover the whole run")
    if since in ("reload", "restart"):
        return (f"counts of {who}: its new process, since the {since} at {when}; the chart and "
                "the actions cover the whole run")
    return f"counts of {who} since {when}, when the sidecar started watching"


def _graph_line(g: dict[str, Any]) -> str:
    mb = g.get("mb_per_graph")
    per = f", {fmt_mb(mb)}/graph (confidence {g.get('mb_per_graph_confidence') or 0:.2f})" \
        if mb is not None else ", memory per graph: not enough recordings yet"
    return (f"graphs   {g.get('recordings', 0):,} recorded, {g.get('distinct_shapes', 0):,} "
            f"distinct shapes, {counted(g.get('compiles', 0), 'compile')}, "
            f"{counted(g.get('recompiles', 0), 'recompile')}{per}")


def memory_text(row: dict[str, Any]) -> str:
    """A server's own memory; none once its processes exited (the last reading is not)."""
    return fmt_bytes(row.get("memory_bytes")) if row.get("state") == "up" else "-"


def budget_text(row: dict[str, Any]) -> str:
    """A server's memory against its budget: "1.62 GiB of 835 MiB (199 %)"."""
    level, budget = row.get("level_bytes"), row.get("budget_bytes")
    if row.get("state") != "up":
        return f"- of {fmt_bytes(budget)}" if budget is not None else "-"
    if budget is None:
        return "no budget yet"
    return f"{fmt_bytes(level)} of {fmt_bytes(budget)} ({fmt_share(level, budget)})"


def oom_text(row: dict[str, Any]) -> str:
    """A server's time to OOM in a table cell."""
    if row.get("state") != "up":
        return "-"
    if row.get("over_budget"):
        return "over budget now"
    seconds = row.get("seconds_to_oom")
    return "none forecast" if seconds is None else f"~{fmt_duration(seconds)}"


def named(row: dict[str, Any]) -> str:
    """A server's name, and its metrics' `server` label where that differs (a `pgid:` name
    changes with each start; the label stays)."""
    label = row.get("label") or row["server"]
    return row["server"] if label == row["server"] else f"{row['server']} ({label})"


def server_table(rows: list[dict[str, Any]]) -> list[str]:
    """The host's servers as aligned columns (nvitop's process table), a reload held back on
    the line under its server."""
    head = ("SERVER", "STATE", "PIDS", "MEMORY", "AGAINST BUDGET", "TO OOM", "CAUSES",
            "LAST ACTION")
    cells = [(named(r), r["state"].upper() if r["state"] != "up" else "up",
              ",".join(map(str, r["pids"])) or "-", memory_text(r),
              budget_text(r), oom_text(r), ", ".join(r["active_causes"]) or "none",
              "none" if not r.get("last_action") else
              f"{fmt_clock(r['last_action']['t'])} {r['last_action']['summary']}")
             for r in rows]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head) - 1)]
    lines = []
    for row, c in zip([None, *rows], [head, *cells], strict=True):
        lines.append("  ".join(x.ljust(w) for x, w in zip(c, widths, strict=False))
                     + "  " + c[-1])
        if row is not None and row.get("held"):
            lines.append(" " * (widths[0] + 2) + "reload held back: " + row["held"]["summary"])
        if row is not None and row.get("freeze"):
            lines.append(" " * (widths[0] + 2) + row["freeze"])
    return lines


def format_terminal(status: dict[str, Any], url: str, now: float, actions: int = 5) -> str:
    """A few aligned lines for a terminal."""
    if status.get("t") is None:
        return f"sidecar  {url}: started, no poll yet\n"
    side = status.get("sidecar") or {}
    since = side.get("watching_since_t")
    late = stale_s(status, now)
    lines = [f"sidecar  {url}, last poll {fmt_duration(max(0.0, now - status['t']))} ago"
             + (" (STALE: the sidecar is not polling; these numbers are old)" if late else "")
             + (f", watching for {fmt_duration(now - since)}" if since else "")
             + (f", reloads: {side['reload_method']}" if side.get("reload_method") else "")]
    servers = status.get("servers") or []
    detail = status.get("detail") or {}
    if len(servers) > 1 or detail.get("chosen") or detail.get("asked"):
        lines += [("servers  " if i == 0 else "         ") + line
                  for i, line in enumerate(server_table(servers))]
    if detail.get("asked"):
        lines.append(f"detail   no server {detail['asked']} here: the servers are the rows "
                     "above; below, the one nearest to OOM")
    if waiting(status):
        lines += [("waiting  " if i == 0 else "         ") + line
                  for i, line in enumerate(waiting_lines(status))]
    else:
        if len(servers) > 1 or detail.get("chosen"):
            why = "asked for" if detail.get("chosen") else \
                "nearest to OOM; `status --server NAME` for another"
            lines.append(f"detail   server {detail.get('server')} ({why}): its own numbers "
                         "below")
        lines += _memory_lines(status.get("memory") or {})
        lines.append(_graph_line(status.get("graphs") or {}))
        lines.append("         " + scope_text(status.get("scope") or {}))
        causes = status.get("causes") or []
        elsewhere = (status.get("host_causes") or 0) - len(causes)
        lines.append("causes   " + (f"{causes[0]['cause']}: {causes[0]['summary']}" if causes
                                    else f"none on this server; {elsewhere} on others (their "
                                    "rows above)" if elsewhere > 0 else "none"))
        lines += [f"         {c['cause']}: {c['summary']}" for c in causes[1:]]
        padding = status.get("padding") or []
        lines += [("padding  " if i == 0 else "         ") + row["summary"]
                  for i, row in enumerate(padding)]
        lines.append(f"forecast {status.get('forecast_summary', '?')}")
        held = next((r["held"] for r in servers if r["server"] == detail.get("server")
                     and r.get("held")), None)
        if held:
            lines.append(f"reload   held back: {held['summary']}")
        frozen = next((r["freeze"] for r in servers if r["server"] == detail.get("server")
                       and r.get("freeze")), None)
        if frozen:
            lines.append(f"freeze   {frozen}")
    sources = status.get("sources") or {}
    host_mode = host_memory_mode(status)
    lines.append("sources  " + ", ".join(
        f"{k} not used (no GPU: host-memory mode)" if k == "nvml" and not v and host_mode
        else f"{k} {'up' if v else 'DOWN'}" for k, v in sorted(sources.items())))
    recent = (status.get("actions") or [])[:actions]
    lines.append("actions  " + ("none" if not recent else
                                f"{fmt_clock(recent[0]['t'])} {recent[0]['summary']}"))
    lines += [f"         {fmt_clock(a['t'])} {a['summary']}" for a in recent[1:]]
    return "\n".join(lines) + "\n"
