"""A reload's lifecycle and a server's, each one phase value with one transition function (pure).

A reload: idle → decided (carried out next poll if the forecast still holds, or cancelled) →
executing (carried out: waiting for its outcome) → renewed (its new process said hello first)
→ ended (the outcome shown for one poll) or failed (carried out, not back: alerted until a new
process of the server says hello). `advance(reload, transition)` is the only way a phase
changes; a transition that does not apply to the phase leaves it as it is (an outcome of a
reload a sidecar before this one carried out ends an idle one: it is still shown).

A server: announced (a hello or the config named it; no process of it read alive yet) → up (a
process of it alive) → down (every process of it dead or forgotten) → forgotten (down for
`RETAIN_S`: its state leaves the host; its reload history stays, in the host's and in
`<state_dir>/reloads.json`). A name whose processes are all gone starts afresh when reused.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from torch_watchdog.sidecar.core.results import Reload

# A stopped server's state is kept this long (a restart under the same name within it is told
# apart as one: its Restart action, the page's "stopped"), then dropped: the sidecar's memory
# and each poll's cost follow the servers alive, not every server the host ever ran (a churn
# soak held 106 stopped servers and its idle CPU went 1.0 % -> 3.8 %: benchmarks/results/soak.md)
RETAIN_S = 600.0


class Phase(enum.Enum):
    IDLE = "idle"
    DECIDED = "decided"
    EXECUTING = "executing"
    RENEWED = "renewed"
    ENDED = "ended"
    FAILED = "failed"


BUSY = frozenset({Phase.DECIDED, Phase.EXECUTING, Phase.RENEWED})


@dataclass(frozen=True)
class ReloadUnderWay:
    """The `reload` alert while a reload is carried out."""
    method: str
    seconds_to_oom: Optional[float]
    cause: str

    def detail(self) -> dict[str, Any]:
        return {"outcome": "in progress", "method": self.method,
                "seconds_to_oom": self.seconds_to_oom, "cause": self.cause}


@dataclass(frozen=True)
class ReloadEnded:
    """The `reload` alert once a reload's outcome is known (shown for one poll), and the
    `reload_failed` alert's detail."""
    outcome: str
    seconds: float
    cause: Optional[str]   # None: an outcome for a reload this sidecar did not carry out

    def detail(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "reload_seconds": round(self.seconds, 3),
                "done": True, "cause": self.cause}


@dataclass(frozen=True)
class ReloadState:
    phase: Phase = Phase.IDLE
    decision: Optional[Reload] = None          # decided, executing, renewed
    under_way: Optional[ReloadUnderWay] = None  # executing, renewed: the `reload` alert
    ended: Optional[ReloadEnded] = None        # ended, failed
    old_pids: frozenset[int] = frozenset()     # failed: a hello from another pid is the server
    shown: bool = False                        # failed: its `reload` alert shown once

    @property
    def busy(self) -> bool:
        """One decision at a time per server: decided or carried out, not yet ended."""
        return self.phase in BUSY


# -- transitions: what happened ------------------------------------------------------------
@dataclass(frozen=True)
class Decide:
    decision: Reload


@dataclass(frozen=True)
class Execute:
    under_way: ReloadUnderWay


@dataclass(frozen=True)
class Cancel:
    pass


@dataclass(frozen=True)
class Renew:
    """The reload's new process said hello before the outcome."""


@dataclass(frozen=True)
class Outcome:
    ended: ReloadEnded
    failed: bool
    old_pids: frozenset[int]


@dataclass(frozen=True)
class Shown:
    """A poll's alerts showed the phase."""


@dataclass(frozen=True)
class Back:
    """A hello from `pid`: the server is back if it is none of the failed reload's."""
    pid: int


Transition = Union[Decide, Execute, Cancel, Renew, Outcome, Shown, Back]
IDLE = ReloadState()


def advance(r: ReloadState, tr: Transition) -> ReloadState:
    """The reload's phase after `tr`."""
    p = r.phase
    if isinstance(tr, Decide):
        return ReloadState(Phase.DECIDED, tr.decision) if p not in BUSY else r
    if isinstance(tr, Execute):
        return replace(r, phase=Phase.EXECUTING, under_way=tr.under_way) \
            if p is Phase.DECIDED else r
    if isinstance(tr, Cancel):
        return IDLE if p is Phase.DECIDED else r
    if isinstance(tr, Renew):
        return replace(r, phase=Phase.RENEWED) if p is Phase.EXECUTING else r
    if isinstance(tr, Outcome):
        if p is Phase.DECIDED:
            return r  # not carried out yet: no outcome of it can have come
        return ReloadState(Phase.FAILED if tr.failed else Phase.ENDED, ended=tr.ended,
                           old_pids=tr.old_pids)
    if isinstance(tr, Shown):
        if p is Phase.ENDED:
            return IDLE
        return replace(r, shown=True) if p is Phase.FAILED else r
    if p is Phase.FAILED and tr.pid not in r.old_pids:  # Back: a new process of it
        return IDLE
    return r


def alerts(r: ReloadState) -> dict[str, dict[str, Any]]:
    """What the phase fires: `reload` from the execution until the outcome has been shown
    once, `reload_failed` while failed."""
    if r.under_way is not None and r.phase in (Phase.EXECUTING, Phase.RENEWED):
        return {"reload": r.under_way.detail()}
    if r.ended is None:
        return {}
    out = {} if r.phase is Phase.FAILED and r.shown else {"reload": r.ended.detail()}
    if r.phase is Phase.FAILED:
        out["reload_failed"] = r.ended.detail()
    return out


# -- a server's life --------------------------------------------------------------------------
class Life(enum.Enum):
    ANNOUNCED = "announced"
    UP = "up"
    DOWN = "down"


def life_after(life: Life, alive: Optional[bool]) -> Life:
    """The server's life after a poll: `alive` True where a process of it is alive (or not
    read yet), False where every process it had is dead or forgotten, None where it has had
    none."""
    return life if alive is None else Life.UP if alive else Life.DOWN
