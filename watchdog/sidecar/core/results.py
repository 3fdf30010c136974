"""What the step decides: typed actions, and the step's result (the actions and what fires)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class ActionKind(str, enum.Enum):
    """What an action asks of the daemon, or tells it."""
    ALERT = "alert"                      # a cause, the OOM forecast, a suppressed reload
    RELOAD = "reload"                    # decided; carried out one poll later if it holds
    EXECUTE = "execute"                  # carry out the reload decided at `decided_t`
    CANCEL = "cancel"                    # the reload decided at `decided_t` no longer holds
    RESTART = "restart"                  # a server's process restarted outside a reload
    RELOAD_OK = "reload_ok"              # a reload's outcome: the server is back
    RELOAD_FAILED = "reload_failed"      # carried out, and the server did not come back
    RELOAD_NOT_DONE = "reload_not_done"  # not carried out (refused, no target, an error)


@dataclass(frozen=True)
class Action:
    t: float
    kind: ActionKind
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)  # what it says: the numbers behind it
    server: Optional[str] = None   # the target: a server, its pids and its GPUs (UUIDs)
    pids: tuple[int, ...] = ()
    gpus: tuple[str, ...] = ()
    cause: Optional[str] = None        # RELOAD, EXECUTE, CANCEL: the cause that decided it
    dry_run: Optional[bool] = None     # RELOAD, EXECUTE, CANCEL: policy.dry_run when decided
    decided_t: Optional[float] = None  # EXECUTE, CANCEL: when the reload was decided
    # RELOAD: why it will not be carried out (a dry run, reload.method none); None: it will be
    not_done: Optional[str] = None

    def shown(self) -> dict[str, Any]:
        """Its detail with the typed fields that are set: what logs and pages show."""
        out = dict(self.detail)
        if self.dry_run is not None:
            out["dry_run"] = self.dry_run
        if self.cause is not None:
            out["cause"] = self.cause
        if self.decided_t is not None:
            out["decided_t"] = self.decided_t
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**self.shown(), "t": round(self.t, 3), "action": self.kind.value,
                "reason": self.reason, "server": self.server, "pids": list(self.pids),
                "gpus": list(self.gpus)}


@dataclass
class StepResult:
    """One observation's step: its actions, in order, and after a sample, what fires for each
    server (cause -> detail; `None` after an event or an outcome: the alerts are decided once
    a poll)."""
    actions: list[Action] = field(default_factory=list)
    firing: Optional[dict[str, dict[str, dict[str, Any]]]] = None
