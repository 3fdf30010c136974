"""`torch-watchdog replay`'s readable form (pure): for each server, what was decided, when and
why, its alerts (one per cause found, and the OOM forecast), and its numbers at the end of the
recording; `--json` prints the result as is.

Times are seconds from the start of the recording (`replay.since_start`), as `+44.3 s`.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Optional

from torch_watchdog.sidecar.present.units import fmt_bytes, fmt_duration, fmt_mb

# the actions that are decisions, and those that tell what became of one
# Forecast.driver: what the forecast's OOM comes from
DRIVERS = {"recordings": "from the CUDA-graph recordings", "trend": "from the memory trend",
           "unexplained": "from the unexplained growth"}
DECISIONS = ("reload", "execute", "cancel", "reload_ok", "reload_failed", "reload_not_done",
             "restart", "freeze", "unfreeze")


def summary(result: dict[str, Any], since_start: Callable[[float], float]) -> list[str]:
    """The lines `replay` prints for `result` (replay.replay's), `since_start(t)` placing a
    time in its recording."""
    info = result["replay"]
    lines = [f"# {info['observations']:,} observations, {info['bad_lines']:,} bad line(s), "
             f"{info['trace_seconds']:,.1f} s of recording; times in seconds from its start"]
    servers = result.get("servers") or {}
    names = sorted(set(servers) | {a["server"] for a in result["actions"]}
                   | {f["server"] for f in result["findings"]})
    if len(names) > 1:
        lines.append(f"# {len(names)} servers: {', '.join(names)}")
    for name in names:
        lines += _server(name, result, servers.get(name), since_start)
    return lines


def _server(name: str, result: dict[str, Any], end: Optional[dict[str, Any]],
            since_start: Callable[[float], float]) -> list[str]:
    actions = [a for a in result["actions"] if a["server"] == name]

    def at(t: float) -> str:
        return f"+{since_start(t):.1f} s"

    decided = [a for a in actions if a["action"] in DECISIONS]
    alerts = [a for a in actions if a["action"] == "alert"]
    out = [f"server {name}"]
    out.append("  decided:" + ("" if decided else " nothing"))
    out += [f"    {at(a['t'])}  {a['action']}: {_why(a, at)}" for a in decided]
    counts = collections.Counter(a["reason"] for a in alerts)
    out.append("  alerts: " + ("none" if not alerts else ", ".join(
        f"{cause} ×{n}" if n > 1 else cause for cause, n in counts.items())))
    out += [f"    {at(a['t'])}  {a['reason']}{_alert_detail(a)}" for a in alerts]
    # a reload or a restart starts the server's numbers again: those of its last process
    out.append("  at the end, since its last start:" + (" no numbers" if end is None else ""))
    out += [f"    {part}" for part in (_estimates(end) if end is not None else ())]
    return out


def _why(a: dict[str, Any], at: Callable[[float], str]) -> str:
    """Why an action: its cause and the numbers behind it, or what became of a decision."""
    kind = a["action"]
    if kind == "reload":
        text = f"cause {a.get('cause') or a['reason']}{_oom(a)}"
        return text + (" (dry run: not carried out)" if a.get("dry_run") else "")
    if kind == "freeze":
        text = (f"cause {a.get('cause') or a['reason']}{_oom(a)}: its agents asked to stop "
                "recording CUDA graphs for new sizes (policy.remedy)")
        return text + (" (dry run: not asked)" if a.get("dry_run") else "")
    if kind == "unfreeze":
        return "asked by hand (torch-watchdog unfreeze): new sizes are recorded again"
    if kind in ("execute", "cancel"):
        done = "carried out" if kind == "execute" else "cancelled: the forecast cleared"
        return (f"the reload decided at {at(a['decided_t'])} (cause "
                f"{a.get('cause') or a['reason']}), {done}")
    if kind == "restart":
        return (f"the server's process restarted outside a reload (pid "
                f"{', '.join(map(str, a.get('old_pids') or [])) or '?'} -> "
                f"{a.get('new_pid', '?')})")
    outcome = a.get("outcome") or kind
    took = a.get("reload_seconds")
    return f"{outcome}" + ("" if took is None else f", in {fmt_duration(took)}") + \
        ("" if not a.get("cause") else f" (cause {a['cause']})")


def _oom(a: dict[str, Any]) -> str:
    seconds = a.get("seconds_to_oom")
    return "" if seconds is None else f", OOM forecast in {fmt_duration(seconds)}"


def _alert_detail(a: dict[str, Any]) -> str:
    if a["reason"] == "oom_forecast":
        level, budget = a.get("level_bytes"), a.get("budget_bytes")
        used = "" if level is None or budget is None else f" ({_room(level, budget)})"
        return f": {_oom(a)[2:]}{used}" if _oom(a) else ""
    if a.get("recordings") is not None and a.get("mb_per_graph") is not None:
        return (f": {_n(a['recordings'], 'CUDA graph', 'CUDA graphs')} recorded, "
                f"{fmt_mb(a['mb_per_graph'])} each")
    if a.get("recompiles_in_window") is not None:
        return (f": {_n(a['recompiles_in_window'], 'recompile', 'recompiles')} within "
                f"{fmt_duration(a['window_s'])}")
    return ""


def _estimates(e: dict[str, Any]) -> list[str]:
    """A server's numbers at the end (step.estimates: correlation and forecast)."""
    parts = [_n(e.get("recordings", 0), "CUDA graph recorded", "CUDA graphs recorded")
             + ("" if e.get("mb_per_graph") is None else
                f" ({fmt_mb(e['mb_per_graph'])} each, confidence "
                f"{e.get('mb_per_graph_confidence') or 0:.2f})"),
             _n(e.get("compiles", 0), "first compile", "first compiles") + ", "
             + _n(e.get("recompiles", 0), "recompile", "recompiles"),
             _n(e.get("requests", 0), "call", "calls") + ", "
             + _n(e.get("distinct_shapes", 0), "distinct shape", "distinct shapes")]
    level, budget = e.get("level_bytes"), e.get("budget_bytes")
    if level is not None and budget is not None:
        parts.append(f"memory {fmt_bytes(level)}, {_room(level, budget)}")
    seconds = e.get("seconds_to_oom")
    driver = DRIVERS.get(e.get("driver") or "")
    parts.append("no OOM forecast" if seconds is None else
                 f"OOM forecast in {fmt_duration(seconds)}" + (f" ({driver})" if driver else ""))
    return parts


def _room(level: float, budget: float) -> str:
    """Where a level stands against its budget: what is left, or how far over it is (two
    numbers close to each other would read alike)."""
    if level > budget:
        return f"{fmt_bytes(level - budget)} over its {fmt_bytes(budget)} budget"
    return f"{fmt_bytes(budget - level)} left of its {fmt_bytes(budget)} budget"


def _n(count: int, one: str, many: str) -> str:
    return f"{count:,} {one if count == 1 else many}"
