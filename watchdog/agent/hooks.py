"""Torch hooks → events, chosen by feature detection (torch 2.4 → 2.14; reference torch-hooks §0,
§8).

Sources, each optional:
- `CompilationMetrics` pushed through logger `torch._utils_internal` (every Dynamo compile, the
  recompile reason from 2.7, the recompile-limit entry from 2.7); never the 64-entry deque.
- `torch._dynamo.callback` start/end: `CUDAGRAPH_RECORDING` (2.8+); Dynamo compiles only when
  compilation metrics logging is off. Re-registered after `torch._dynamo.reset()` clears them.
- Loggers: the recompile-limit warning, graph breaks, "Recording cudagraph tree for symint key",
  Inductor's cudagraph warnings. We tap them with a logging *filter* (no handler, no change to
  propagation): it sees each record, then lets through only what would have passed before we
  lowered the level, so nothing new reaches stderr and the app's own TORCH_LOGS still works.
- The CUDA allocator's OOM observer, attached once CUDA is initialised (never initialised by us:
  that would break servers that fork after import).
Every hook body is wrapped: an error is counted (`on_error`), never raised into torch.

What differs between torch versions (each measured on PyPI's 2.4.1, 2.6.0, 2.9.1 and 2.13.0):
- a recompile-limit hit's metrics entry: `fail_reason` "cache_size_limit reached" (≤ 2.6),
  "recompile_limit reached" (2.7–2.9), "Dynamo recompile limit exceeded…" (2.10+);
- a graph break's log record: "Graph break: from user code at:" + the user's stack, the cause
  only in the record's exc_info (2.4); "Graph break in user code at FILE:LINE" + "Graph Break
  Reason:" (2.6+), whose cause from 2.9 is a paragraph of its own ("Explanation: …");
- FX-graph cache hits/misses: per-compile metrics fields (2.6 has them but leaves the local
  ones None), else the deltas of torch's `counters["inductor"]["fxgraph_cache_hit"/"_miss"]`.
"""
from __future__ import annotations

import logging
import os
import re
import time
from time import perf_counter_ns
from typing import Any, Callable, Optional

from torch_watchdog import events
from torch_watchdog.agent.inflight import current_shape
from torch_watchdog.agent.signature import as_shape
from torch_watchdog.agent.wrapper import tls

Emit = Callable[[events.Event], None]

LIMIT_PREFIX = "torch._dynamo hit config."
_LIMIT_RE = re.compile(r"hit config\.(\w+) \((\d+)\)")
_LIMIT_FN_RE = re.compile(r"function: '([^']*)' \(([^)]*)\)")
_LIMIT_REASON_RE = re.compile(r"last reason: (.*)")
_BREAK_AT_RE = re.compile(r"in user code at (\S+)")
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')
_REASON_RE = re.compile(r"^(?:Graph Break )?Reason:", re.MULTILINE)
_LIMIT_FAIL_RE = re.compile(r"(recompile|cache_size)_limit|recompile limit exceeded")
# "Graph Break Reason:" text that only says which bytecode was traced (2.9+ put the real cause
# in a paragraph of its own below it)
_TRACE_PREAMBLE = "Encountered graph break when attempting to trace"
_SIZES_RE = re.compile(r"observed (\d+) distinct sizes")
_ATTEMPT_RE = re.compile(r"(\d+)/(\d+)")


class LogTap(logging.Filter):
    """Sees every record of one logger at `level` and up; passes on only what passed before."""

    def __init__(self, name: str, level: int, fn: Callable[[logging.LogRecord], None],
                 on_error: Callable[[BaseException], None]):
        super().__init__()
        self.logger = logging.getLogger(name)
        self.level = level
        self.fn = fn
        self.on_error = on_error
        self.saved_level = self.logger.level
        self.set_level = self.logger.level
        self.pass_level = logging.WARNING

    def attach(self) -> None:
        self.saved_level = self.logger.level
        self._adjust()
        self.logger.addFilter(self)

    def heal(self) -> None:
        """Undo what torch._logging.set_logs() or the app did to our tap; cheap when intact."""
        if self not in self.logger.filters:
            self.logger.addFilter(self)
        if self.logger.level != self.set_level:
            self._adjust()

    def detach(self) -> None:
        self.logger.removeFilter(self)
        if self.logger.level == self.set_level:
            self.logger.setLevel(self.saved_level)

    def _adjust(self) -> None:
        self.pass_level = self.logger.getEffectiveLevel()
        if self.pass_level > self.level:
            self.logger.setLevel(self.level)
        self.set_level = self.logger.level

    def filter(self, record: logging.LogRecord) -> bool:
        """Everything here is guarded: logging calls filters inside the app's (and torch's)
        own logging calls, so an exception here would raise there. The answer is always what
        the record would have got without us."""
        try:
            self.fn(record)
        except Exception as e:
            try:
                self.on_error(e)
            except Exception:
                pass
        return self.passes(record)

    def passes(self, record: Any) -> bool:
        """Would `record` have reached this logger's handlers without our lowered level? A
        record whose level cannot be compared (a hand-made one passed to `logger.handle()`)
        passes, as it would with no filter of ours."""
        try:
            return bool(record.levelno >= self.pass_level)
        except Exception:
            return True


def _key_list(key: Any) -> Optional[list[int]]:
    """The cudagraph tree's int key (int, tuple of ints, or None) as a JSON list."""
    if key is None:
        return None
    try:
        return [int(k) for k in key] if isinstance(key, tuple) else [int(key)]
    except (TypeError, ValueError):
        return None


# Per-compile FX-graph cache fields of CompilationMetrics, newest names first: local plus
# remote where torch splits them.
_FX_FIELDS = {
    "hit": ("inductor_fx_local_cache_hit_count", "inductor_fx_remote_cache_hit_count",
            "inductor_fx_cache_hit_count", "fx_graph_cache_hit_count"),
    "miss": ("inductor_fx_local_cache_miss_count", "inductor_fx_remote_cache_miss_count",
             "inductor_fx_cache_miss_count", "fx_graph_cache_miss_count"),
}


def _fx_cache(m: Any, which: str) -> Optional[int]:
    """Inductor FX-graph cache hits or misses of one compile from its metrics, else None."""
    counts = [getattr(m, name, None) for name in _FX_FIELDS[which]]
    counts = [c for c in counts if isinstance(c, int) and not isinstance(c, bool)]
    return sum(counts) if counts else None


def is_limit_hit(fail_reason: Optional[str]) -> bool:
    """Is this compile's `fail_reason` a recompile-limit hit, on any supported torch?"""
    return bool(fail_reason) and bool(_LIMIT_FAIL_RE.search(fail_reason))


def graph_break_details(text: str, exc: Optional[BaseException] = None
                        ) -> tuple[str, Optional[str]]:
    """(cause, "file:line" of the user's code) of one graph-break log message, any layout.

    2.6+: "Graph break in user code at F:L\n[Graph Break ]Reason: <cause>\n<user stack>"; from
    2.9 the cause opens with a generic "Encountered graph break when attempting to trace …"
    paragraph, then "<type>\n  Explanation: <what>" — we keep "<type>: <what>". 2.4: "Graph
    break: from user code at:\n<user stack>", the cause only in the exception (exc_info).
    """
    where = _BREAK_AT_RE.search(text)
    location = where.group(1) if where else None
    reason_at = _REASON_RE.search(text)
    head = text[:reason_at.start()] if reason_at else text
    body = text[reason_at.end():] if reason_at else ""
    if location is None:
        stack = head.split("Traceback (most recent call last)", 1)[0]
        frames = _FRAME_RE.findall(stack)
        if frames:  # the innermost user frame is the line that broke the graph
            location = f"{frames[-1][0]}:{frames[-1][1]}"
    body = body.split("User code traceback:", 1)[0]
    paragraphs = [p.strip() for p in body.split("\n\n") if p.strip()]
    reason = ""
    for p in paragraphs:
        lines = [ln.strip() for ln in p.splitlines() if ln.strip()]
        for i, ln in enumerate(lines):
            if ln.startswith("Explanation:"):
                what = ln[len("Explanation:"):].strip()
                reason = f"{lines[i - 1]}: {what}" if i > 0 else what
                break
        if reason:
            break
    if not reason:
        causes = [p for p in paragraphs if not p.startswith(_TRACE_PREAMBLE)] or paragraphs
        if causes:
            reason = " ".join(causes[0].split())
    if exc is not None and (not reason or reason.startswith(_TRACE_PREAMBLE)):
        msg = str(getattr(exc, "msg", None) or exc).strip()
        if msg:
            reason = f"{type(exc).__name__}: {msg.splitlines()[0]}"
    if not reason:
        reason = text.split("\n", 1)[0]
    return reason, location


def _function_name(m: Any) -> Optional[str]:
    name = getattr(m, "co_name", None)
    if name is None:
        return None
    filename = getattr(m, "co_filename", None)
    where = (f" ({os.path.basename(filename)}:{getattr(m, 'co_firstlineno', '?')})"
             if filename else "")
    return f"{name}{where}"


# torch's own frame around a compiled torch.nn module (torch._dynamo.external_utils.wrap_inline,
# `def inner`): what Dynamo names in its recompile-limit report for torch.compile(nn.Linear(...))
_WRAPPER_RE = re.compile(r"^inner \(external_utils\.py\b")


def users_function(function: Optional[str], watched: list[str]) -> Optional[str]:
    """The compiled function to name: the user's, not torch's wrapper frame. For `inner`
    (external_utils.py), the watched model where one is, said with torch's frame."""
    if function is None or not _WRAPPER_RE.match(function):
        return function
    who = watched[0] if len(watched) == 1 else \
        ("one of " + ", ".join(watched[:3])) if watched else "a compiled torch.nn module"
    return f"{who} (torch's wrapper frame {function})"


def _attempt(compile_id: Optional[str]) -> Optional[int]:
    match = _ATTEMPT_RE.search(compile_id or "")
    return int(match.group(2)) if match else None


def _note_activity(kind: str) -> None:
    tls.activity = kind
    tls.activity_ns = perf_counter_ns()


class TorchHooks:
    def __init__(self, torch: Any, emit: Emit, on_error: Callable[[BaseException], None],
                 on_recompile: Callable[[], None] = lambda: None,
                 on_cudagraph_key: Callable[[Any], None] = lambda key: None,
                 watched_names: Callable[[], list[str]] = list):
        self.torch = torch
        self.watched_names = watched_names  # watch()'s names: who `inner` compiled
        self.emit = emit
        self.on_error = on_error
        self.on_recompile = on_recompile
        self.on_cudagraph_key = on_cudagraph_key
        self.pid = os.getpid()
        self.taps: list[LogTap] = []
        self.capabilities: dict[str, bool] = {}
        self.oom_attached = False
        self._handler: Any = None
        self._callbacks_on = False
        self._shape_keys: dict[Any, Any] = {}  # watched input shape -> cudagraph key (warm-up)
        self._fx_seen: Optional[tuple[int, int]] = None  # torch's FX-cache counters (< 2.6)
        self.installed = False

    # -- life cycle ---------------------------------------------------------------------
    def install(self) -> None:
        import torch._dynamo  # noqa: F401  (registers the loggers and the callback handler)

        taps = [
            ("torch._utils_internal", logging.INFO, self._on_metrics_record),
            ("torch._dynamo.convert_frame", logging.WARNING, self._on_convert_frame_record),
            ("torch._dynamo.symbolic_convert.__graph_breaks", logging.DEBUG, self._on_graph_break),
            ("torch._dynamo.convert_frame.__graph_breaks", logging.DEBUG, self._on_graph_break),
            ("torch._inductor.cudagraph_trees.__cudagraphs", logging.INFO, self._on_cudagraph_tree),
            ("torch._inductor.cudagraph_utils.__cudagraphs", logging.WARNING,
             self._on_cudagraph_warning),
        ]
        self.taps = [LogTap(name, level, fn, self.on_error) for name, level, fn in taps]
        for tap in self.taps:
            tap.attach()
        self._install_callbacks()
        self._fx_seen = self._fx_counters()  # hits before install are not ours to report
        self.capabilities = self._detect()
        self.attach_oom_observer()
        self.installed = True

    def heal(self) -> None:
        """Called every agent tick: put back what resets and set_logs took away."""
        for tap in self.taps:
            tap.heal()
        if self._handler is not None and not self._callbacks_registered():
            self._register_callbacks()
        self.attach_oom_observer()

    def uninstall(self) -> None:
        self.installed = False
        for tap in self.taps:
            tap.detach()
        self.taps = []
        if self._handler is not None:
            self._unregister_callbacks()
            if "clear" in vars(self._handler):
                del self._handler.clear
            self._handler = None

    def _detect(self) -> dict[str, bool]:
        torch = self.torch
        dyn_utils = getattr(torch._dynamo, "utils", None)
        fields = getattr(getattr(dyn_utils, "CompilationMetrics", None), "__dataclass_fields__", {})
        triton_cfg = getattr(getattr(torch, "_inductor", None), "config", None)
        triton_cfg = getattr(triton_cfg, "triton", None)
        return {
            "compile_callbacks": self._handler is not None,
            "cudagraph_recording_callback": hasattr(
                getattr(torch._dynamo.callback, "CallbackTrigger", None), "CUDAGRAPH_RECORDING"),
            "compilation_metrics": self._metrics_flowing(),
            "compile_ids": "compile_id" in fields,
            "recompile_reason": "recompile_reason" in fields,
            "guard_failures": hasattr(dyn_utils, "guard_failures"),
            "fx_cache_fields": any(n in fields for names in _FX_FIELDS.values() for n in names),
            "fx_cache_counters": self._fx_counters() is not None,
            "cudagraph_capture_sizes": hasattr(triton_cfg, "cudagraph_capture_sizes"),
            "set_stance": hasattr(getattr(torch, "compiler", None), "set_stance"),
            "oom_observer": hasattr(torch._C, "_cuda_attach_out_of_memory_observer"),
        }

    # -- callbacks ----------------------------------------------------------------------
    def _install_callbacks(self) -> None:
        callback = getattr(self.torch._dynamo, "callback", None)
        handler = getattr(callback, "callback_handler", None)
        if handler is None or not hasattr(callback, "on_compile_start"):
            return
        self._handler = handler
        self._register_callbacks()
        original = handler.clear

        def clear(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)  # torch._dynamo.reset() drops every callback
            self._callbacks_on = False
            try:
                self._register_callbacks()
            except Exception as e:
                self.on_error(e)
            return result

        handler.clear = clear  # instance attribute shadows the method; removed on uninstall

    def _callbacks_registered(self) -> bool:
        starts = getattr(self._handler, "start_callbacks", None)
        return starts is None or self._cb_start in starts

    def _register_callbacks(self) -> None:
        callback = self.torch._dynamo.callback
        if not self._callbacks_registered() or not self._callbacks_on:
            callback.on_compile_start(self._cb_start)
            callback.on_compile_end(self._cb_end)
            self._callbacks_on = True

    def _unregister_callbacks(self) -> None:
        for remove, cb in (("remove_start_callback", self._cb_start),
                           ("remove_end_callback", self._cb_end)):
            try:
                getattr(self._handler, remove)(cb)
            except (AttributeError, ValueError):
                pass
        self._callbacks_on = False

    def _cb_start(self, args: Any = None) -> None:
        try:
            trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
            if trigger == "CUDAGRAPH_RECORDING":
                tls.record_ns = perf_counter_ns()
                _note_activity("cudagraph_record")
            elif trigger == "DYNAMO":
                _note_activity("compile")
        except Exception as e:
            self.on_error(e)

    def _cb_end(self, args: Any = None) -> None:
        try:
            trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
            compile_id = getattr(args, "compile_id", None)
            if trigger == "CUDAGRAPH_RECORDING":
                self._recorded(compile_id)
            elif trigger == "DYNAMO" and not self._metrics_flowing():
                self._compiled(compile_id, None, None, None, None)  # fallback path
        except Exception as e:
            self.on_error(e)

    def _metrics_flowing(self) -> bool:
        """Do compilation metrics reach our tap? Read live: the app may turn them off."""
        config = self.torch._dynamo.config
        return (hasattr(self.torch._dynamo.utils, "CompilationMetrics")
                and bool(getattr(config, "log_compilation_metrics", True)))

    def _recorded(self, compile_id: Optional[str]) -> None:
        start = getattr(tls, "record_ns", None)
        seconds = (perf_counter_ns() - start) / 1e9 if start else None
        shape = current_shape()
        key = self._shape_keys.get(shape) if shape is not None else None
        self.emit(events.CudagraphRecord(
            t=time.time(), pid=self.pid, phase="record", compile_id=str(compile_id),
            key=_key_list(key), shape=_as_shape(shape), seconds=seconds))

    # -- compilation metrics ------------------------------------------------------------
    def _on_metrics_record(self, record: logging.LogRecord) -> None:
        args = record.args
        if not isinstance(args, tuple) or not args:
            return
        m = args[0]
        if type(m).__name__ != "CompilationMetrics" or getattr(m, "is_runtime", False):
            return  # signposts, and the runtime entries (2 per recorded size): no compile
        compile_id = getattr(m, "compile_id", None)
        compile_id = None if compile_id is None else str(compile_id)
        fail = getattr(m, "fail_reason", None) or ""
        counted = self._fx_counter_delta()  # always: keeps the counters' baseline current
        hits, misses = _fx_cache(m, "hit"), _fx_cache(m, "miss")
        if hits is None and misses is None:  # 2.6 has the fields but fills them only remotely
            hits, misses = counted
        if is_limit_hit(fail):
            if getattr(tls, "limit_warned", False):
                tls.limit_warned = False  # the warning already reported this hit
                return
            self.emit(events.RecompileLimit(
                t=time.time(), pid=self.pid,
                function=users_function(_function_name(m), self.watched_names()),
                limit=self._limit(),
                reason=events.clip(getattr(m, "recompile_reason", None)), compile_id=compile_id))
            return
        attempt = _attempt(compile_id)
        recompile = (attempt > 0) if attempt is not None else bool(getattr(m, "cache_size", 0))
        reason = getattr(m, "recompile_reason", None)
        if recompile and not reason:
            reason = self._guard_failure_reason(m)
        seconds = getattr(m, "entire_frame_compile_time_s", None)
        self._compiled(compile_id, _function_name(m), seconds, recompile, reason, hits, misses)

    def _fx_counters(self) -> Optional[tuple[int, int]]:
        counters = getattr(getattr(self.torch._dynamo, "utils", None), "counters", None)
        try:
            inductor = counters["inductor"]  # a defaultdict of Counters: created when absent
        except (TypeError, KeyError):
            return None
        return (int(inductor.get("fxgraph_cache_hit", 0)),
                int(inductor.get("fxgraph_cache_miss", 0)))

    def _fx_counter_delta(self) -> tuple[Optional[int], Optional[int]]:
        """This compile's FX-cache hits and misses as the change of torch's process-wide
        counters since the previous compile's metrics (Dynamo compiles one frame at a time):
        what 2.4-2.6 report, whose metrics have no (filled) per-compile fields. None when
        neither moved: no Inductor compile (another backend)."""
        now = self._fx_counters()
        if now is None:
            return None, None
        before, self._fx_seen = self._fx_seen, now
        if before is None or now[0] < before[0] or now[1] < before[1]:
            before = (0, 0)  # counters were cleared (torch._dynamo.reset in some versions)
        hits, misses = now[0] - before[0], now[1] - before[1]
        return (hits, misses) if hits or misses else (None, None)

    def _compiled(self, compile_id: Optional[str], function: Optional[str],
                  seconds: Optional[float], recompile: Optional[bool],
                  reason: Optional[str], hits: Optional[int] = None,
                  misses: Optional[int] = None) -> None:
        if recompile is None:
            attempt = _attempt(compile_id)
            recompile = bool(attempt)
        _note_activity("recompile" if recompile else "compile")
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
            seconds = float(seconds)
        else:
            seconds = None
        common = dict(t=time.time(), pid=self.pid, compile_id=compile_id,
                      function=events.clip(function, 300), seconds=seconds,
                      fx_cache_hits=hits, fx_cache_misses=misses)
        if recompile:
            self.emit(events.Recompile(reason=events.clip(reason), **common))
            self.on_recompile()
        else:
            self.emit(events.Compile(**common))

    def _guard_failure_reason(self, m: Any) -> Optional[str]:
        """torch < 2.7: the newest guard failure recorded for this code object."""
        failures = getattr(self.torch._dynamo.utils, "guard_failures", None) or {}
        for code, reasons in list(failures.items()):
            if (getattr(code, "co_name", None) == m.co_name
                    and getattr(code, "co_firstlineno", None) == m.co_firstlineno
                    and reasons):
                batch = reasons[-max(1, getattr(m, "cache_size", 1) or 1):]
                return str(batch[0])
        return None

    def _limit(self) -> Optional[int]:
        config = self.torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        return None

    # -- log records ----------------------------------------------------------------------
    def _on_convert_frame_record(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING:
            return
        text = record.getMessage()
        if not text.startswith(LIMIT_PREFIX):
            return
        limit = _LIMIT_RE.search(text)
        function = _LIMIT_FN_RE.search(text)
        reason = _LIMIT_REASON_RE.search(text)
        tls.limit_warned = True  # the metrics entry that follows (2.7+) is the same hit
        self.emit(events.RecompileLimit(
            t=time.time(), pid=self.pid,
            function=events.clip(users_function(
                f"{function.group(1)} ({os.path.basename(function.group(2))})"
                if function else None, self.watched_names()), 300),
            limit=int(limit.group(2)) if limit else self._limit(),
            reason=events.clip(reason.group(1).strip() if reason else None), compile_id=None))

    def _on_graph_break(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "Graph break" not in text:
            return
        exc_info = record.exc_info
        exc = exc_info[1] if isinstance(exc_info, tuple) and len(exc_info) > 1 else None
        reason, location = graph_break_details(
            text, exc if isinstance(exc, BaseException) else None)
        self.emit(events.GraphBreak(t=time.time(), pid=self.pid, reason=events.clip(reason),
                                    location=events.clip(location, 300)))

    def _on_cudagraph_tree(self, record: logging.LogRecord) -> None:
        msg = record.msg if isinstance(record.msg, str) else ""
        lowered = msg.lower()
        if "rerecord_limit" in lowered and record.levelno >= logging.WARNING:
            self._on_rerecord_limit(record)
            return
        if "recording cudagraph tree" not in lowered:
            return
        args = record.args if isinstance(record.args, tuple) else ()
        key = args[-1] if "symint key" in lowered and args else None
        compile_id = str(args[0]) if msg.startswith("[%s]") and len(args) >= 1 else None
        shape = current_shape()
        if shape is not None:
            if len(self._shape_keys) >= 4096:
                self._shape_keys.clear()
            self._shape_keys[shape] = key
        _note_activity("cudagraph_warmup")
        self.on_cudagraph_key(key)
        self.emit(events.CudagraphRecord(
            t=time.time(), pid=self.pid, phase="warmup", compile_id=compile_id,
            key=_key_list(key), shape=_as_shape(shape), seconds=None))

    def _on_rerecord_limit(self, record: logging.LogRecord) -> None:
        """torch 2.15: "[%s] %s graph hit cudagraph_dynamic_shape_rerecord_limit=%s; ..."
        (a warning_once per compiled graph and mode, on the cudagraphs artifact logger)."""
        args = record.args if isinstance(record.args, tuple) else ()
        limit = args[2] if len(args) >= 3 and isinstance(args[2], int) else None
        graph = f"{args[0]} {args[1]}" if len(args) >= 2 else None
        self.emit(events.CudagraphWarning(
            t=time.time(), pid=self.pid, message=events.clip(record.getMessage(), 500),
            distinct_sizes=None, rerecord_limit=limit, graph=graph))

    def _on_cudagraph_warning(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING:
            return
        text = record.getMessage()
        sizes = _SIZES_RE.search(text)
        self.emit(events.CudagraphWarning(
            t=time.time(), pid=self.pid, message=events.clip(text, 500),
            distinct_sizes=int(sizes.group(1)) if sizes else None))

    # -- OOM ------------------------------------------------------------------------------
    def attach_oom_observer(self) -> None:
        """Once, after the server itself initialised CUDA (segfaults before: torch#107330)."""
        cuda = self.torch.cuda
        attach = getattr(self.torch._C, "_cuda_attach_out_of_memory_observer", None)
        if self.oom_attached or attach is None or not cuda.is_initialized():
            return
        attach(self._on_oom)  # observers cannot be detached: _on_oom checks `installed`
        self.oom_attached = True

    def _on_oom(self, device: int, alloc: int, limit: int, free: int) -> None:
        try:
            if not self.installed:
                return
            tls.oom_ns = perf_counter_ns()
            self.emit(events.Oom(t=time.time(), pid=self.pid, source="allocator",
                                 device=int(device), requested_bytes=int(alloc),
                                 limit_bytes=int(limit), free_bytes=int(free), message=None))
        except Exception as e:
            self.on_error(e)

    # -- what the hello event reports ---------------------------------------------------------
    def devices(self) -> list[str]:
        cuda = self.torch.cuda
        if not cuda.is_initialized():
            return []
        uuids = []
        for i in range(cuda.device_count()):
            uuid = str(getattr(cuda.get_device_properties(i), "uuid", ""))
            if uuid:
                uuids.append(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        return uuids

    def compile_config(self) -> dict[str, events.Scalar]:
        dyn = self.torch._dynamo.config
        out: dict[str, events.Scalar] = {}
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "automatic_dynamic_shapes", "assume_static_by_default"):
            _put(out, name, getattr(dyn, name, None))
        inductor = getattr(self.torch, "_inductor", None)
        triton = getattr(getattr(inductor, "config", None), "triton", None)
        for name in ("cudagraphs", "cudagraph_trees", "cudagraph_dynamic_shape_warn_limit",
                     "cudagraph_capture_sizes", "cudagraph_skip_dynamic_graphs",
                     # torch 2.15: a limit on recordings per graph; the graph pool primed in
                     # one block at start (NVML jumps once, then stays flat while it fills)
                     "cudagraph_dynamic_shape_rerecord_limit",
                     "cudagraph_initial_mempool_allocation_gb"):
            _put(out, f"triton.{name}", getattr(triton, name, None))
        _put(out, "graph_partition",
             getattr(getattr(inductor, "config", None), "graph_partition", None))
        return out


def _put(out: dict, name: str, value: Any) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        out[name] = value
    else:
        out[name] = events.clip(repr(value), 200)


def _as_shape(sig: Any) -> Optional[events.Shape]:
    return None if sig is None else as_shape(sig)
