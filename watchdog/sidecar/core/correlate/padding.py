"""The agent's padding (watch(..., pad=...)) per watched model: the latest `padding` totals and
plan, and whether a check refused it (mitigation `padding` `refused`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_watchdog import events

MAX_PADDED_MODELS = 64   # padded models tracked per server (their names label metrics)


@dataclass
class Padding:
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> as shown

    def on_padding(self, e: events.Padding) -> None:
        v = self._model(e.name)
        if not v:
            return
        total = e.real_tokens + e.padding_tokens
        v.update(on=e.on and not v["refused"], buckets=list(e.buckets), calls=e.calls,
                 padded_calls=e.padded_calls, real_tokens=e.real_tokens,
                 padding_tokens=e.padding_tokens, checks=e.checks,
                 check_seconds=e.check_seconds, max_error=dict(e.max_error),
                 recordings_saved=e.recordings_saved, checks_skipped=e.checks_skipped or 0,
                 checks_stopped=e.checks_stopped, check_pool=e.check_pool,
                 padding_fraction=round(e.padding_tokens / total, 6) if total else None)

    def on_mitigation(self, e: events.Mitigation) -> None:
        if e.name != "padding" or not e.model:
            return
        v = self._model(e.model)
        if not v:
            return
        if e.buckets is not None:
            v["buckets"] = list(e.buckets)
        if e.action == "refused":
            v.update(on=False, refused=e.detail, error=e.error, off_t=e.t)

    def view(self) -> dict[str, dict[str, Any]]:
        """Every model's, as shown (copies)."""
        return {m: dict(v, buckets=list(v["buckets"]), max_error=dict(v["max_error"]))
                for m, v in self.models.items()}

    def refused(self) -> dict[str, dict[str, Any]]:
        """Models whose padding a check refused: model -> {error, detail, t}."""
        return {m: {"error": v.get("error"), "detail": v.get("refused"), "t": v.get("off_t")}
                for m, v in self.models.items() if v.get("refused")}

    def _model(self, model: str) -> dict[str, Any]:
        v = self.models.get(model)
        if v is None:
            if len(self.models) >= MAX_PADDED_MODELS:  # names come from the agent: bounded
                return {}
            v = self.models[model] = {
                "on": True, "buckets": [], "calls": 0, "padded_calls": 0, "real_tokens": 0,
                "padding_tokens": 0, "padding_fraction": None, "checks": 0,
                "check_seconds": 0.0, "max_error": {}, "recordings_saved": 0, "error": None,
                "refused": None, "off_t": None}
        return v
