"""The sidecar's sample log: one JSON line per observation, in the order the step saw them.

The daemon writes every poll's agent events, reload outcomes and sample, the config in force
at start and after each SIGHUP, and at start the reload history; offline/traces.py reads them
back for replay, which then decides what the live sidecar decided.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Optional

from torch_watchdog import events
from torch_watchdog.jsonl import JsonLines
from torch_watchdog.sidecar.core.observations import OPERATOR_REQUESTS, DeviceSample, \
    KnownServer, OperatorRequest, ProcessSample, RecordUnreadable, ReloadHistory, \
    ReloadOutcome, Sample, ServersKnown


def sample_to_dict(s: Sample) -> dict[str, Any]:
    """One line of the sidecar's sample log (read back by traces.py for replay)."""
    line = {"kind": "sample", "t": s.t, "nvml_up": s.nvml_up, "query_s": s.query_s,
            "devices": [{"uuid": d.uuid, "used": d.used_bytes, "total": d.total_bytes,
                         "free": d.free_bytes} for d in s.devices],
            "processes": [{"pid": p.pid, "alive": p.alive, "rss": p.rss_bytes,
                           "gpu": p.gpu_bytes, **({"pss": p.pss_bytes} if p.pss_bytes
                                                  is not None else {}),
                           **({"limit": p.mem_limit_bytes} if p.mem_limit_bytes
                              is not None else {})}
                          for p in s.processes],
            "host_total": s.host_total_bytes, "host_available": s.host_available_bytes}
    if s.configured:  # "servers": the configured servers' pids
        line["servers"] = {k: list(v) for k, v in s.configured.items()}
    if s.nvml_down:  # only when some device is down: healthy lines stay as they were
        line["nvml_down"] = dict(s.nvml_down)
    return line


def sample_from_dict(d: dict[str, Any]) -> Sample:
    """Raises KeyError/TypeError/ValueError on a malformed line."""
    def opt_int(v: Any) -> Optional[int]:
        return None if v is None else int(v)

    return Sample(
        t=float(d["t"]), nvml_up=bool(d["nvml_up"]),
        query_s=None if d.get("query_s") is None else float(d["query_s"]),
        devices=tuple(DeviceSample(str(x["uuid"]), int(x["used"]), int(x["total"]),
                                   opt_int(x.get("free"))) for x in d["devices"]),
        processes=tuple(ProcessSample(int(x["pid"]), bool(x["alive"]), opt_int(x.get("rss")),
                                      {str(k): opt_int(v) for k, v in x["gpu"].items()},
                                      opt_int(x.get("pss")), opt_int(x.get("limit")))
                        for x in d["processes"]),
        host_total_bytes=opt_int(d.get("host_total")),
        host_available_bytes=opt_int(d.get("host_available")),
        configured={str(k): tuple(int(p) for p in v)
                    for k, v in (d.get("servers") or {}).items()},
        nvml_down={str(k): str(v) for k, v in (d.get("nvml_down") or {}).items()})


def config_to_dict(t: float, config: Any) -> dict[str, Any]:
    """A sample-log line; `config.from_mapping` reads the mapping back."""
    return {"kind": "config", "t": t, "config": dataclasses.asdict(config)}


def outcome_to_dict(o: ReloadOutcome) -> dict[str, Any]:
    line = {"kind": "reload_outcome", "t": o.t, "server": o.server, "ok": o.ok,
            "detail": o.detail, "seconds": o.seconds}
    if o.retry_after_s is not None:
        line["retry_after_s"] = o.retry_after_s
    if o.failed:  # only then: other lines stay as they were
        line["failed"] = True
    return line


def outcome_from_dict(d: dict[str, Any]) -> ReloadOutcome:
    """Raises KeyError/TypeError/ValueError on a malformed line."""
    if not isinstance(d["ok"], bool) or not isinstance(d.get("failed", False), bool):
        raise ValueError("ok and failed must be booleans")
    retry = d.get("retry_after_s")
    return ReloadOutcome(d["ok"], str(d["detail"]), float(d.get("seconds", 0.0)),
                         None if retry is None else float(retry), d.get("failed", False),
                         t=float(d["t"]), server=str(d["server"]))


def request_to_dict(r: OperatorRequest) -> dict[str, Any]:
    return {"kind": "operator_request", "t": r.t, "server": r.server, "request": r.request}


def request_from_dict(d: dict[str, Any]) -> OperatorRequest:
    """Raises KeyError/TypeError/ValueError on a malformed line."""
    if not isinstance(d["server"], str) or d["request"] not in OPERATOR_REQUESTS:
        raise ValueError(f"a request names a server and one of {OPERATOR_REQUESTS}")
    return OperatorRequest(float(d["t"]), d["server"], d["request"])


def unreadable_to_dict(o: RecordUnreadable) -> dict[str, Any]:
    return {"kind": "record_unreadable", "t": o.t, "detail": o.detail}


def unreadable_from_dict(d: dict[str, Any]) -> RecordUnreadable:
    """Raises KeyError/TypeError/ValueError on a malformed line."""
    if not isinstance(d["detail"], str):
        raise ValueError("detail must be text")
    return RecordUnreadable(float(d["t"]), d["detail"])


def history_to_dict(h: ReloadHistory) -> dict[str, Any]:
    return {"kind": "reload_history", "t": h.t,
            "decisions": [[t, server] for t, server in h.decisions]}


def history_from_dict(d: dict[str, Any]) -> ReloadHistory:
    """Raises KeyError/TypeError/ValueError on a malformed line."""
    decisions = []
    for t, server in d["decisions"]:
        if server is not None and not isinstance(server, str):
            raise ValueError("a decision's server must be text or null")
        decisions.append((float(t), server))
    return ReloadHistory(float(d["t"]), tuple(decisions))


def known_to_dict(k: ServersKnown) -> dict[str, Any]:
    return {"kind": "servers_known", "t": k.t,
            "servers": [dataclasses.asdict(s) for s in k.servers]}


def known_from_dict(d: dict[str, Any]) -> ServersKnown:
    """Raises KeyError/TypeError/ValueError on a malformed line (or file: actions/known.py
    reads `servers.json` with it)."""
    servers = []
    for s in d["servers"]:
        name, argv, uid = s["name"], s.get("argv"), s.get("uid")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ValueError("a server's name must be text")
        if argv is not None and not isinstance(argv, str) or \
                uid is not None and not isinstance(uid, int):
            raise ValueError("argv must be text, uid a number")
        servers.append(KnownServer(name, _ints(s["pids"], 2), uid,
                                   _ints(s.get("parents", ()), 0),
                                   tuple(str(g) for g in s.get("gpus", ())), argv))
    return ServersKnown(float(d["t"]), tuple(servers))


def _ints(values: Any, least: int) -> tuple[int, ...]:
    out = tuple(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= least for v in out):
        raise ValueError(f"pids must be numbers >= {least}")
    return out


_TO_DICT: dict[type, Any] = {Sample: sample_to_dict, ReloadOutcome: outcome_to_dict,
                             RecordUnreadable: unreadable_to_dict,
                             OperatorRequest: request_to_dict,
                             ReloadHistory: history_to_dict, ServersKnown: known_to_dict}


def encode(observations: Iterable[Any]) -> bytes:
    """Lines of observations: agent events as the schema encodes them, the sidecar's own as
    above."""
    return b"\n".join(
        json.dumps(_TO_DICT[type(o)](o), separators=(",", ":")).encode()
        if type(o) in _TO_DICT else events.encode(o)
        for o in observations)


class Writer:
    """The sample log of a running sidecar: one write per poll, rotated by size; a failure is
    logged once and retried every few seconds (JsonLines), never raised into the loop."""

    def __init__(self, path: str, max_bytes: int, log: Any):
        self.path, self.log = path, log
        self._lines = JsonLines(path, 5.0, max_bytes)
        self._failed = False

    def observations(self, observations: Iterable[Any]) -> None:
        if not self._lines.write(encode(observations)) and not self._failed:
            self._failed = True
            self.log.error("cannot write the sample log", path=self.path)

    def config(self, t: float, config: Any) -> None:
        """The config in force from now on, for a replay of the log."""
        self._lines.write(json.dumps(config_to_dict(t, config), separators=(",", ":")).encode())

    def close(self) -> None:
        self._lines.close()
