"""The demo's timeline (pure): what the server, the agent and the sidecar report, as readable
lines with times from the demo's start, and the facts the demo's exit code is decided on.

Inputs are the parsed JSON lines of the three sources: the demo server's stdout (`ev` lines),
the agent's event log (schema-v1 events) and the sidecar's structlog log (`event` lines). No
I/O, no clock: every line carries its own time (`t`, or the sidecar's ISO `timestamp`).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Optional

from torch_watchdog.sidecar.present.status import cause_summary, fmt_bytes, fmt_duration

STALLS_SHOWN = 8          # new-shape stalls printed one by one; the rest are counted
RECORDS_SHOWN = 3         # CUDA-graph recordings printed one by one (GPU)
SLOWDOWN_MIN_CALLS = 30   # calls after the fallback before its cost is printed


@dataclass
class Facts:
    """What the demo saw; the exit code is 0 only when all four steps were seen."""
    recompiles: int = 0                     # with a guard-failure reason
    limit_hit: bool = False                 # the agent's recompile_limit event
    fallback_found: bool = False            # the sidecar's recompile_limit_eager_fallback
    storm_found: bool = False
    reload_decided: bool = False
    reload_ok: Optional[bool] = None
    reload_detail: str = ""
    sigterm_t: Optional[float] = None       # when the sidecar began the reload
    first_pid: Optional[int] = None
    again_pid: Optional[int] = None         # a server started after the reload
    served_again: int = 0                   # requests it served
    slowdown: Optional[tuple] = None        # (ms before, ms after) the fallback
    device: Optional[str] = None            # "CPU" or "CUDA", from the server's start line

    def missing(self) -> list[str]:
        """The steps not seen, in the words the demo prints."""
        out = []
        if not self.recompiles:
            out.append("no recompile with a guard-failure reason was reported")
        if not (self.limit_hit or self.fallback_found):
            out.append("the recompile limit was not hit (no eager fallback)")
        if not self.reload_ok:
            out.append("the sidecar did not reload the server" + (
                f" ({self.reload_detail})" if self.reload_detail else ""))
        if not self.served_again:
            out.append("no restarted server served a request")
        return out


@dataclass
class _Calls:
    """One server process's `calls` windows: (t, calls, seconds, stall calls, stall seconds)."""
    windows: list = field(default_factory=list)
    limit_t: Optional[float] = None
    shown: bool = False


def parse_time(value: Any) -> Optional[float]:
    """structlog's ISO timestamp (UTC, "…Z") as epoch seconds; None if not one."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def short_reason(reason: Optional[str]) -> str:
    """Dynamo's reason without its "0/1: " frame/attempt prefix."""
    if not reason:
        return "no reason reported"
    head, sep, tail = reason.partition(": ")
    return tail if sep and head.replace("/", "").isdigit() else reason


def function_name(function: Optional[str]) -> str:
    """"forward (server.py:40)" → "forward"."""
    return (function or "the model").split(" (")[0]


def steady_ms(windows: list) -> tuple[int, Optional[float]]:
    """Calls that were not stalls, and their mean latency in ms."""
    calls = sum(w[1] - w[3] for w in windows)
    seconds = sum(w[2] - w[4] for w in windows)
    return calls, (1e3 * seconds / calls if calls > 0 else None)


class Timeline:
    def __init__(self, start: float):
        self.start = start
        self.facts = Facts()
        self.calls: dict[int, _Calls] = {}
        self.hello: set[int] = set()
        self.stalls = 0
        self.records = 0
        self.served: dict[int, int] = {}

    def line(self, t: Optional[float], source: str, text: str) -> str:
        rel = max(0.0, (t if t is not None else self.start) - self.start)
        return f"+{rel:5.1f}s {source:8s} {text}"

    # -- the agent's events ---------------------------------------------------------------
    def agent(self, e: dict) -> list[str]:
        kind, t, pid = e.get("kind"), e.get("t"), e.get("pid")
        if kind == "calls":
            self._agent_calls(e)
            return self._slowdown(pid)
        handler = getattr(self, f"_agent_{kind}", None)
        text = handler(e) if handler else None
        return [] if text is None else [self.line(t, "agent", text)]

    def _agent_hello(self, e: dict) -> Optional[str]:
        if e["pid"] in self.hello:
            return None
        self.hello.add(e["pid"])
        limit = (e.get("config") or {}).get("recompile_limit")
        devices = e.get("devices") or []
        return (f"pid {e['pid']}: hooks installed (torch {e.get('torch')}, recompile_limit "
                f"{limit if limit is not None else '?'}"
                + (f", {len(devices)} GPU(s)" if devices else "") + "), events to the sidecar")

    def _agent_compile(self, e: dict) -> str:
        return f"compiled {function_name(e.get('function'))} in {_secs(e.get('seconds'))}"

    def _agent_recompile(self, e: dict) -> str:
        self.facts.recompiles += bool(e.get("reason"))
        attempt = (e.get("compile_id") or "").rsplit("/", 1)[-1]
        number = f" #{attempt}" if attempt.isdigit() else ""
        return (f"recompile{number} of {function_name(e.get('function'))}: "
                f"{short_reason(e.get('reason'))} ({_secs(e.get('seconds'))})")

    def _agent_recompile_limit(self, e: dict) -> str:
        self.facts.limit_hit = True
        self.calls.setdefault(e["pid"], _Calls()).limit_t = e.get("t")
        return (f"RECOMPILE LIMIT {e.get('limit')} hit in {function_name(e.get('function'))}: "
                "new lengths now run eager: no error, only torch's `hit config.recompile_limit` "
                "warning in the server's log")

    def _agent_stall(self, e: dict) -> Optional[str]:
        self.stalls += 1
        if self.stalls > STALLS_SHOWN:
            return None
        shape = e.get("shape") or []
        what = f"new shape {shape[0] if len(shape) == 1 else shape}" if e.get("new_shape") \
            else f"shape {shape}"
        more = " (further stalls are counted on the status page)" \
            if self.stalls == STALLS_SHOWN else ""
        return (f"stall {_secs(e.get('seconds'))} on {what}: cause "
                f"{e.get('cause') or 'unknown'}{more}")

    def _agent_cudagraph_record(self, e: dict) -> Optional[str]:
        if e.get("phase") != "record":
            return None
        self.records += 1
        if self.records > RECORDS_SHOWN:
            return None
        return f"CUDA graph recorded for shape {e.get('shape') or e.get('key')}" + (
            " (further recordings are counted on the status page)"
            if self.records == RECORDS_SHOWN else "")

    def _agent_calls(self, e: dict) -> None:
        c = self.calls.setdefault(e["pid"], _Calls())
        c.windows.append((e["t"], e["calls"], e["seconds"], e["stall_calls"],
                          e["stall_seconds"], e.get("window_s", 0.0)))

    def _slowdown(self, pid: int) -> list[str]:
        """Once enough calls ran after the fallback: its cost, from the agent's calls windows
        (a window is "before" if it ended by the limit, "after" if it began after it)."""
        c = self.calls.get(pid)
        if c is None or c.limit_t is None or c.shown:
            return []
        before = [w for w in c.windows if w[0] <= c.limit_t]
        after = [w for w in c.windows if w[0] - w[5] >= c.limit_t]
        (_, ms_before), (n_after, ms_after) = steady_ms(before), steady_ms(after)
        if ms_before is None or ms_after is None or n_after < SLOWDOWN_MIN_CALLS:
            return []
        c.shown = True
        if self.facts.slowdown is None:
            self.facts.slowdown = (ms_before, ms_after)
        ratio = ms_after / ms_before
        verdict = f"{ratio:.1f}x slower" if ratio >= 1.05 else f"{ratio:.1f}x: no slower here"
        return [self.line(after[-1][0], "agent",
                          f"eager fallback: {ms_before:.2f} ms per call while compiled, "
                          f"{ms_after:.2f} ms after the limit ({verdict}; mean of {n_after} "
                          "calls, stalls left out)")]

    def _agent_oom(self, e: dict) -> str:
        return f"OUT OF MEMORY ({e.get('source')}): {e.get('message') or ''}"[:300]

    def _agent_dropped(self, e: dict) -> str:
        return f"the agent lost {e.get('count')} event(s) ({e.get('reason')})"

    def _agent_mitigation(self, e: dict) -> str:
        return f"mitigation {e.get('name')} {e.get('action')}: {e.get('detail')}"

    # -- the sidecar's log ----------------------------------------------------------------
    def sidecar(self, d: dict) -> list[str]:
        event = d.get("event")
        handler = _SIDECAR.get(event)
        text = handler(self, d) if handler else None
        if text is None and d.get("level") in ("error", "critical"):
            extra = {k: v for k, v in d.items() if k not in ("event", "level", "timestamp")}
            text = f"ERROR {event}: {extra}"
        return [] if text is None else [self.line(parse_time(d.get("timestamp")), "sidecar",
                                                  text)]

    def _sidecar_started(self, d: dict) -> str:
        return f"started: polling every {d.get('poll_interval_s')} s, agent socket " \
               f"{d.get('socket')}"

    def _sidecar_finding(self, d: dict) -> str:
        cause = str(d.get("cause"))
        self.facts.fallback_found |= cause == "recompile_limit_eager_fallback"
        self.facts.storm_found |= cause == "recompile_storm"
        detail = {k: v for k, v in d.items() if k not in ("event", "level", "timestamp")}
        graphs = {"compile_seconds": d.get("compile_seconds") or 0}
        text = f"FOUND {cause}: {cause_summary(cause, detail, graphs)}"
        if d.get("steady_ms_before") is not None:
            text += f"; {d['steady_ms_before']:.2f} ms per call until then"
        if cause == "memory_growth_unexplained":
            text += " (right: the stand-in is no CUDA graph the agent could report)"
        return text

    def _sidecar_action(self, d: dict) -> Optional[str]:
        action, reason = d.get("action"), d.get("reason")
        eta = d.get("seconds_to_oom")
        numbers = (f"forecast OOM in {fmt_duration(eta)}: server at "
                   f"{fmt_bytes(d.get('level_bytes'))} of its {fmt_bytes(d.get('budget_bytes'))}"
                   " budget")
        if action == "reload":
            self.facts.reload_decided = True
            dry = " (dry run: not carried out)" if d.get("dry_run") else ""
            return f"RELOAD decided: {numbers}{dry}"
        if action == "alert" and reason in ("oom_forecast", "reload_suppressed"):
            return f"ALERT {reason}: {numbers}"
        return None  # alerts for causes repeat the FOUND line

    def _sidecar_reloading(self, d: dict) -> str:
        self.facts.sigterm_t = parse_time(d.get("timestamp"))
        pids = ", ".join(str(p) for p in d.get("pids") or []) or "none known"
        return f"reloading the server: method {d.get('method')}, SIGTERM to pid {pids}"

    def _sidecar_reload_finished(self, d: dict) -> str:
        self.facts.reload_ok = bool(d.get("ok"))
        self.facts.reload_detail = str(d.get("detail") or "")
        done = "reload done" if d.get("ok") else "reload NOT done"
        return f"{done}: {d.get('detail')} ({_secs(d.get('seconds'))})"

    def _sidecar_config_reloaded(self, d: dict) -> str:
        return "config re-read (SIGHUP): the new budget applies from this poll"

    def _sidecar_stopping(self, d: dict) -> str:
        return f"stopping ({d.get('signal')})"

    # -- the demo server's own lines ------------------------------------------------------
    def server(self, d: dict) -> list[str]:
        handler = getattr(self, f"_server_{d.get('ev')}", None)
        text = handler(d) if handler else None
        return [] if text is None else [self.line(d.get("t"), "server", text)]

    def _server_start(self, d: dict) -> str:
        self.facts.first_pid = self.facts.first_pid or d["pid"]
        self.facts.device = d.get("device")
        stand_in = (f"; STAND-IN: it keeps {d['standin_mb']} MB of "
                    f"{d.get('standin_where') or 'memory'} per distinct length, as a CUDA graph "
                    "pool takes per size on a GPU") if d.get("standin_mb") else ""
        return (f"pid {d['pid']} started: {d.get('model')}, {d.get('compile')} on "
                f"{d.get('device')} (torch {d.get('torch')}){stand_in}")

    def _server_traffic(self, d: dict) -> str:
        return f"traffic: {d.get('what')}"

    def _server_serving(self, d: dict) -> str:
        pid = d["pid"]
        self.served[pid] = max(self.served.get(pid, 0), d.get("served", 1))
        if pid != self.facts.first_pid and self.facts.sigterm_t is not None:
            self.facts.again_pid = pid
            self.facts.served_again = self.served[pid]
            return (f"pid {pid} serving again ({d.get('t', 0) - self.facts.sigterm_t:.1f} s "
                    f"after SIGTERM; first request took {_secs(d.get('first_s'))})")
        return f"pid {pid} serving (first request took {_secs(d.get('first_s'))}: the compile)"

    def _server_progress(self, d: dict) -> None:
        pid = d["pid"]
        self.served[pid] = max(self.served.get(pid, 0), d.get("served", 0))
        if pid == self.facts.again_pid:
            self.facts.served_again = self.served[pid]
        return None  # the driver prints progress with the sidecar's forecast: progress_text

    def _server_stopping(self, d: dict) -> str:
        return (f"pid {d['pid']} got {d.get('signal')}: finishing the request in hand and "
                f"exiting ({d.get('served', 0):,} requests served)")

    def _server_error(self, d: dict) -> str:
        return f"pid {d.get('pid')} failed: {d.get('error')}"


_SIDECAR = {"started": Timeline._sidecar_started, "finding": Timeline._sidecar_finding,
            "action": Timeline._sidecar_action,
            "reloading the server": Timeline._sidecar_reloading,
            "reload finished": Timeline._sidecar_reload_finished,
            "config reloaded": Timeline._sidecar_config_reloaded,
            "stopping": Timeline._sidecar_stopping}


def progress_text(p: dict, status: Optional[dict]) -> str:
    """One progress line: the server's counts, its memory as the sidecar measures it (else its
    own RSS), the sidecar's forecast."""
    text = (f"pid {p.get('pid')}: {_n(p.get('served', 0), 'request')}, "
            f"{_n(p.get('distinct', 0), 'distinct length')}")
    memory = (status or {}).get("memory") or {}
    if memory.get("level_bytes") is not None:
        text += (f", {MEMORY_NAMES.get(memory.get('source'), 'memory')} "
                 f"{fmt_bytes(memory['level_bytes'])}")
    elif p.get("rss_bytes") is not None:
        text += f", RSS {fmt_bytes(p['rss_bytes'])}"
    if p.get("standin_bytes"):
        text += f" (stand-in {fmt_bytes(p['standin_bytes'])})"
    if status:
        text += f" | sidecar: {status.get('forecast_summary', '?')}"
    return text


MEMORY_NAMES = {"rss": "PSS/RSS", "process": "GPU memory (NVML)", "device": "GPU used (NVML)"}


def line_time(line: str) -> float:
    """A timeline line's seconds ("+ 12.3s …" → 12.3), to print a batch in time order."""
    try:
        return float(line[1:line.index("s")])
    except ValueError:
        return 0.0


def _secs(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "? s"
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.1f} s"


def _n(count: int, what: str) -> str:
    return f"{count:,} {what}{'' if count == 1 else 's'}"
