"""What the step decides and shows: typed actions, and the step's result (the actions, and after a
sample what fires and every server's view)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, TypedDict, cast

from torch_watchdog.sidecar.core.observations import KnownServer


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
    FREEZE = "freeze"                    # ask the server's agents to stop recording new sizes
    UNFREEZE = "unfreeze"                # ask them to record again (by hand)


@dataclass(frozen=True)
class Verdict:
    """What the policy decides for one server, before the step names its target: an alert, or
    a reload decision (`dry_run`: policy.dry_run when decided)."""
    t: float
    kind: ActionKind                     # ALERT, RELOAD or FREEZE
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False


# why a reload the forecast calls for is not carried out (Held.reason)
HELD_REASONS = ("cooldown", "hourly_maximum", "concurrency_cap", "dry_run", "method_none",
                "precondition", "frozen", "remedy_freeze")


@dataclass(frozen=True)
class Held:
    """A reload held back: the forecast calls for one and the policy does not decide it, or
    decides one that is not carried out. `until`: when the hold ends by itself (None: no
    end known, as with a dry run or a cap held by another server's reload); `detail`: the
    numbers behind it."""
    reason: str                          # one of HELD_REASONS
    since: float
    until: Optional[float] = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "since_t": self.since, "until_t": self.until,
                **self.detail}


@dataclass(frozen=True)
class Action:
    """What the step asks of the daemon, or tells it, about one server: one type per kind
    (below), each with the fields its kind has. The target: the server, its pids and its GPUs
    (UUIDs)."""
    t: float
    reason: str
    detail: dict[str, Any]   # what it says: the numbers behind it
    server: str
    pids: tuple[int, ...]
    gpus: tuple[str, ...]
    kind: ClassVar[ActionKind]

    def shown(self) -> dict[str, Any]:
        """Its detail with the fields of its kind: what logs and pages show."""
        return dict(self.detail)

    def as_dict(self) -> dict[str, Any]:
        return {**self.shown(), "t": round(self.t, 3), "action": self.kind.value,
                "reason": self.reason, "server": self.server, "pids": list(self.pids),
                "gpus": list(self.gpus)}


@dataclass(frozen=True)
class Alert(Action):
    """A cause, the OOM forecast, a suppressed reload."""
    kind: ClassVar[ActionKind] = ActionKind.ALERT


@dataclass(frozen=True)
class Freeze(Action):
    """Ask the server's agents, over the control channel, to stop recording CUDA graphs for
    new sizes (recorded sizes keep replaying); `dry_run`: decided, not asked."""
    dry_run: bool
    kind: ClassVar[ActionKind] = ActionKind.FREEZE

    def shown(self) -> dict[str, Any]:
        return {**self.detail, "dry_run": self.dry_run}


@dataclass(frozen=True)
class Unfreeze(Action):
    """Ask them to record new sizes again (`torch-watchdog unfreeze SERVER`)."""
    kind: ClassVar[ActionKind] = ActionKind.UNFREEZE


@dataclass(frozen=True)
class Restart(Action):
    """A server's process restarted outside a reload."""
    kind: ClassVar[ActionKind] = ActionKind.RESTART


@dataclass(frozen=True)
class ReloadAction(Action):
    """A reload decision and what became of it before its outcome."""
    cause: str        # the cause that decided it
    dry_run: bool     # policy.dry_run when decided

    def shown(self) -> dict[str, Any]:
        return {**self.detail, "dry_run": self.dry_run, "cause": self.cause}


@dataclass(frozen=True)
class Reload(ReloadAction):
    """Decided; carried out one poll later if it holds. `not_done`: why it will not be carried
    out (a dry run, reload.method none); None: it will be."""
    not_done: Optional[str]
    kind: ClassVar[ActionKind] = ActionKind.RELOAD


@dataclass(frozen=True)
class FollowUp(ReloadAction):
    """What became of the reload decided at `decided_t`, one poll later."""
    decided_t: float

    def shown(self) -> dict[str, Any]:
        return {**super().shown(), "decided_t": self.decided_t}


@dataclass(frozen=True)
class Execute(FollowUp):
    """Carry out the reload decided at `decided_t`."""
    kind: ClassVar[ActionKind] = ActionKind.EXECUTE


@dataclass(frozen=True)
class Cancel(FollowUp):
    """The reload decided at `decided_t` no longer holds."""
    kind: ClassVar[ActionKind] = ActionKind.CANCEL


@dataclass(frozen=True)
class ReloadOk(Action):
    """A reload's outcome: the server is back."""
    kind: ClassVar[ActionKind] = ActionKind.RELOAD_OK


@dataclass(frozen=True)
class ReloadFailed(Action):
    """A reload's outcome: carried out, and the server did not come back."""
    kind: ClassVar[ActionKind] = ActionKind.RELOAD_FAILED


@dataclass(frozen=True)
class ReloadNotDone(Action):
    """A reload's outcome: not carried out (refused, no target, an error)."""
    kind: ClassVar[ActionKind] = ActionKind.RELOAD_NOT_DONE


class Estimates(TypedDict):
    """A server's numbers (correlate.State.estimates), as metrics, pages and replay show them."""
    mb_per_graph: Optional[float]
    mb_per_graph_confidence: Optional[float]
    recordings: int
    warmups: int
    distinct_shapes: int
    requests: int
    compiles: int
    recompiles: int
    compile_seconds: float
    fx_cache_hits: int
    fx_cache_misses: int
    recompile_limit_hits: int
    graph_breaks: int
    stalls: int
    stall_seconds: float
    ooms: int
    memory_source: Optional[str]
    memory_bytes: Optional[int]
    memory_growth_bytes: Optional[int]
    explained_by_recordings_bytes: int
    unexplained_bytes: int
    device_used_bytes: Optional[int]
    device_total_bytes: Optional[int]
    steady_ms: Optional[float]
    steady_ms_after_fallback: Optional[float]
    padding: dict[str, dict[str, Any]]   # model -> what the agent's padding reported


class ForecastView(TypedDict):
    """A server's forecast (forecast.Forecast.as_dict): seconds None where no OOM is in sight."""
    seconds_to_oom: Optional[float]
    seconds_to_oom_earliest: Optional[float]   # the policy's: the trend's next step at its soonest
    seconds_to_oom_linear: Optional[float]
    seconds_to_oom_discovery: Optional[float]
    seconds_to_oom_unexplained: Optional[float]
    driver: Optional[str]
    gpu_uuid: Optional[str]
    plateau_bytes: Optional[float]
    will_oom: Optional[bool]
    budget_bytes: Optional[int]
    level_bytes: Optional[int]
    shape_space_estimate: Optional[float]
    growth_bytes_per_s: Optional[float]
    unexplained_bytes_per_s: Optional[float]


class ServerView(TypedDict):
    """One server as the presenters show it (Snapshot.servers)."""
    estimates: Estimates
    forecast: ForecastView
    active_causes: tuple[str, ...]
    pids: list[int]
    gpus: list[str]
    held: Optional[dict[str, Any]]       # Held.as_dict() while a reload is held back, else None
    freeze: Optional[dict[str, Any]]     # correlate.freeze.Freeze.view(): None, never asked
    label: str        # its `server` in metrics (core/labels.py): stable over its restarts


@dataclass(frozen=True)
class PollResult:
    """What a sample's step leaves for the alerts and the presenters."""
    firing: dict[str, dict[str, dict[str, Any]]]  # server -> cause -> detail
    host_firing: dict[str, dict[str, Any]]         # cause -> detail, of no one server
    views: dict[str, ServerView]                   # server -> its view
    focus: Optional[str]          # the server nearest to OOM; None before any is known
    focus_view: ServerView        # its view (an empty server's before any is known)
    focus_causes: list[dict[str, Any]]  # its active findings, as shown
    agents_alive: bool            # a process that sent events is alive
    skewed_events: int            # event times moved onto the sidecar's clock, so far
    agent_events_lost: int        # events the agents said they dropped, so far
    # the servers known while none has a process left: they left the views (the page waits
    # for a server again and names them); their state and reload history stay
    stopped: tuple[str, ...] = ()
    # the findings of every server since the last poll's result, in order: (server, finding)
    new_findings: tuple[tuple[str, dict[str, Any]], ...] = ()
    # the pids the next poll's sources read: the agents' (their liveness) and, where the
    # agents' pids are trusted, every server's
    pids_to_read: frozenset[int] = frozenset()
    placed_pids: frozenset[int] = frozenset()  # the pids the config placed in a server
    # the servers the agents placed, for the next sidecar (`<state_dir>/servers.json`)
    known: tuple[KnownServer, ...] = ()

    @staticmethod
    def before_any() -> "PollResult":
        """The result before the first poll: nothing fires, no server, nothing to read."""
        empty: ServerView = {"estimates": cast(Estimates, {}), "forecast": cast(ForecastView, {}),
                             "active_causes": (), "pids": [], "gpus": [], "held": None,
                             "freeze": None, "label": ""}
        return PollResult(firing={}, host_firing={}, views={}, focus=None, focus_view=empty,
                          focus_causes=[], agents_alive=False, skewed_events=0,
                          agent_events_lost=0)


@dataclass
class StepResult:
    """One observation's step: its actions, in order, and after a sample (`poll`) what fires and
    what every server shows; `poll` is None after an event or an outcome (the alerts are
    decided once a poll)."""
    actions: list[Action] = field(default_factory=list)
    poll: Optional[PollResult] = None


# -- what the offline tools (replay, report) follow of a run: views of the step's state, given
# out by core/views.py (the state itself stays the step's)
@dataclass(frozen=True)
class FindingView:
    """A server's finding (a cause it was found to have), `t` unrounded."""
    t: float
    cause: str
    detail: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {**self.detail, "t": round(self.t, 3), "cause": self.cause}


@dataclass(frozen=True)
class ServerMoment:
    """A server after an observation. `key`: the server, the same over its renames; `process`:
    its correlation state, a new one at each reload or restart (keys are the run's own)."""
    key: int
    name: str
    process: int
    pids: frozenset[int]
    gpus: frozenset[str]       # its memory's GPUs, else the agents' and NVML's


@dataclass(frozen=True)
class ServerReading:
    """A server after a sample: its memory, its forecast and whether the policy would act on
    it during its warm-up (`reload_lead`: policy.reload_lead; None before its first
    observation)."""
    key: int
    process: int
    memory_source: Optional[str]
    memory_bytes: Optional[int]
    has_pids: bool
    alive: bool                # one of its processes is not dead in the sample
    seconds: float             # its forecast's seconds to OOM (forecast.FOREVER: none)
    budget_bytes: Optional[int]
    level_bytes: Optional[int]
    forecast: ForecastView
    warming_up: bool
    reload_lead: Optional[float]


@dataclass(frozen=True)
class ProcessTotals:
    """One process of a server (a correlation state: from its start to its reload or restart,
    or the end), as its counts stood at its end."""
    records: int
    compiles: int
    recompiles: int
    limit_hits: int
    limit: Optional[int]       # the recompile limit its agent's hello reported
    distinct_shapes: int
    requests: int
    stalls: int
    stall_seconds: float
    ooms: int
    memory_bytes: Optional[int]
    findings: tuple[FindingView, ...]
    estimates: Estimates


@dataclass(frozen=True)
class HostOutcome:
    """The host at the end of a replay: the focus server and its numbers (its estimates with
    its forecast once a sample came), every server's numbers, every finding (with its server,
    in time order) and the last time seen (the last sample's, else the focus state's)."""
    server: str
    estimates: dict[str, Any]
    servers: dict[str, dict[str, Any]]
    findings: list[dict[str, Any]]
    last_t: Optional[float]
