"""Each poll, made visible: the snapshot behind /metrics, the status page, the findings' log.

The views and the snapshot are read by other threads (the metrics and status HTTP servers): each
is published by one reference swap and never changed after. A failure here only leaves the page
a poll behind: the watching goes on.
"""
from __future__ import annotations

import collections
from typing import Any, Mapping, Optional

from torch_watchdog import __version__
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core.host import DEFAULT_SERVER
from torch_watchdog.sidecar.core.observations import Sample
from torch_watchdog.sidecar.core.results import Action, PollResult, ServerView
from torch_watchdog.sidecar.present import snapshot as snapshot_mod
from torch_watchdog.sidecar.present.history import History, StatusView
from torch_watchdog.sidecar.present.metrics import SnapshotCollector, make_registry
from torch_watchdog.sidecar.present.snapshot import Processes, Snapshot

PUBLISH_S = 1.0  # the status page's view is rebuilt at most this often, or when the step acts
# a gone server's action counts stay this long after its last poll: the shipped rules'
# longest window over torch_watchdog_actions_total (`increase(...[1h])`, TorchCompileReloadLoop)
ACTIONS_KEPT_S = 3600.0


class Publisher:
    def __init__(self, cfg: Config, log: Any):
        self.cfg, self.log = cfg, log
        self.collector = SnapshotCollector()
        self.registry = make_registry(self.collector)
        self.history = History()                   # the status page's series, marks, actions
        self.status: Optional[StatusView] = None   # read by HTTP threads
        self.actions_total: collections.Counter[str] = collections.Counter()
        # (server label, action): counted at the next snapshot, once this poll's labels are
        # known (an action can be a new server's first)
        self.server_actions: collections.Counter[tuple[str, str]] = collections.Counter()
        self._uncounted: list[tuple[str, str]] = []      # (server name, action)
        self._labels: dict[str, str] = {}                # server name -> label, last poll
        self._label_seen: dict[str, float] = {}          # label -> the last poll it was in
        self._gpu_seen = False                           # NVML listed a GPU since the start
        self._failed = False
        self._published_t = -1e18
        self._held: dict[str, dict[str, Any]] = {}  # server -> the hold last logged

    def count(self, action: Action) -> None:
        self.actions_total[action.kind.value] += 1
        self._uncounted.append((action.server, action.kind.value))

    def log_findings(self, poll: PollResult) -> None:
        for server, finding in poll.new_findings:
            self.log.warning("finding", server=server, **finding)
        self.log_held(poll)

    def log_held(self, poll: PollResult) -> None:
        """One line when a server's reload starts being held back (or its reason changes),
        and one when the hold ends; not one a poll."""
        now = {name: held for name, v in poll.views.items() if (held := v.get("held"))}
        for name, held in now.items():
            if (self._held.get(name) or {}).get("reason") != held["reason"]:
                self.log.warning("reload held back", server=name, **held)
        for name in self._held.keys() - now.keys():
            self.log.info("reload no longer held back", server=name,
                          reason=self._held[name]["reason"])
        self._held = now

    def snapshot(self, sample: Sample, poll: PollResult, counts: dict[str, Any]) -> Snapshot:
        """This poll's snapshot; `counts`: the sources' and actions' counters, as the
        Snapshot's fields name them."""
        focus = poll.focus_view
        gpu, rss_bytes, any_alive = _process_sums(sample)
        labels = {name: v["label"] for name, v in poll.views.items()}
        for name, kind in self._uncounted:  # a server gone this poll: its last poll's label
            self.server_actions[(labels.get(name) or self._labels.get(name, name), kind)] += 1
        self._uncounted.clear()
        self._labels = labels  # this poll's servers only: names change with each start
        self._forget_gone_labels(sample.t, labels.values())
        self._gpu_seen = self._gpu_seen or bool(sample.devices or sample.nvml_down)
        snap = snapshot_mod.make(dict(
            t=sample.t, devices=sample.devices, server_gpu_bytes=gpu,
            gpu_attribution=self.cfg.gpu.attribution, server_rss_bytes=rss_bytes,
            server_alive=any_alive if sample.processes else None,
            estimates={**focus["estimates"], **focus["forecast"]}, forecast=focus["forecast"],
            active_causes=focus["active_causes"], actions_total=dict(self.actions_total),
            servers=_with_processes(poll.views, sample), focus=poll.focus, stopped=poll.stopped,
            sources_up={"nvml": sample.nvml_up, "process": any_alive,
                        "agent": poll.agents_alive},
            nvml_error=None if sample.nvml_up else sample.nvml_error,
            nvml_query_seconds=sample.query_s, events_skewed_total=poll.skewed_events,
            agent_events_lost_total=poll.agent_events_lost,
            processes=readings(sample, poll.views),
            server_actions_total=dict(self.server_actions),
            nvml_in_use=nvml_in_use(self._gpu_seen, sample.nvml_error), **counts))
        self.collector.update(snap)
        return snap

    def _forget_gone_labels(self, now: float, current: Any) -> None:
        """Names change with each start (`pgid:N`): a gone server's counts are dropped
        ACTIONS_KEPT_S after its last poll, or the series would grow with every restart."""
        self._label_seen.update(dict.fromkeys(current, now))
        self._label_seen.update({label: now for label, _ in self.server_actions
                                 if label not in self._label_seen})
        gone = {label for label, seen in self._label_seen.items()
                if now - seen > ACTIONS_KEPT_S}
        if gone:
            for key in [k for k in self.server_actions if k[0] in gone]:
                del self.server_actions[key]
            for label in gone:
                del self._label_seen[label]

    def publish(self, snap: Snapshot, observations: list[Any], decided: list[Action],
                poll: PollResult, polls: int) -> None:
        """The status page's view of this poll: one reference swap, read by HTTP threads."""
        cfg = self.cfg
        try:
            self.history.update(snap, observations, decided)
            if decided or snap.t - self._published_t >= PUBLISH_S or \
                    snap.t < self._published_t:
                info = {"version": __version__, "polls": polls, "poll_interval_s":
                        cfg.poll_interval_s, "socket": cfg.agent.socket_path,
                        "reload_method": cfg.reload.method, "dry_run": cfg.policy.dry_run}
                self.status = self.history.view(snap, poll.focus_causes, info, poll.firing)
                self._published_t = snap.t
        except Exception as e:
            if not self._failed:  # once: it would repeat every poll
                self.log.exception("status page not updated", error=repr(e))
            self._failed = True


# NVML's errors where the host has no GPU stack at all (no nvidia-ml-py, no library, no
# driver): NVML is then no source of this sidecar's, and its series are left out
NO_GPU_STACK = ("ModuleNotFoundError", "ImportError", "NVMLError_LibraryNotFound",
                "NVMLError_DriverNotLoaded")


def nvml_in_use(gpu_seen: bool, error: Optional[str]) -> bool:
    """Whether NVML is a source here: it listed a GPU since the start (`gpu_seen`), or it fails
    for another reason than a missing GPU stack (no permission, a library mismatch: a GPU
    host where NVML is broken, which its alert must tell). Not before its first answer."""
    if gpu_seen:
        return True
    if error is None or not error.startswith("NVML unavailable: "):
        return False  # not read yet, or read with no GPU listed
    return not error[len("NVML unavailable: "):].startswith(NO_GPU_STACK)


def readings(sample: Sample, views: Mapping[str, ServerView]) -> dict[str, Processes]:
    """Each server's processes as `sample` read them: whether one is alive, and the live
    ones' RSS and GPU memory (None where none said). Without a server that has pids of its
    own (agents' pids not trusted), every process read is the default server's, as its
    numbers are (metrics._servers)."""
    groups = {name: set(view["pids"]) for name, view in views.items()} or (
        {DEFAULT_SERVER: {p.pid for p in sample.processes}} if sample.processes else {})
    out = {}
    for name, pids in groups.items():
        procs = [p for p in sample.processes if p.pid in pids]
        alive = [p for p in procs if p.alive]
        rss = [p.rss_bytes for p in alive if p.rss_bytes is not None]
        gpu: dict[str, Optional[int]] = {}
        for p in alive:
            for uuid, used in p.gpu_bytes.items():
                was = gpu.get(uuid, 0)
                gpu[uuid] = None if used is None or was is None else was + used
        out[name] = Processes(up=bool(alive) if procs else None,
                              rss_bytes=sum(rss) if rss else None, gpu_bytes=gpu)
    return out


def _process_sums(sample: Sample) -> tuple[dict[str, Optional[int]], Optional[int], bool]:
    """GPU bytes by device (None where NVML does not say for one process), the host memory,
    and whether any is alive, over the sample's processes."""
    gpu: dict[str, Optional[int]] = {}
    for p in sample.processes:
        for uuid, used in p.gpu_bytes.items():
            was = gpu.get(uuid, 0)
            gpu[uuid] = None if used is None or was is None else was + used
    alive = [p for p in sample.processes if p.alive]
    rss = [p.host_bytes for p in alive if p.host_bytes is not None]
    return gpu, sum(rss) if rss else None, bool(alive)


def _with_processes(views: dict[str, Any], sample: Sample) -> dict[str, dict[str, Any]]:
    """Each server's view with its own processes as the process source read them this poll:
    its GPU bytes by device, its host memory, and whether one is alive (`up`: False the poll
    its last process exits, not when the step forgets its pids; None: none was read)."""
    out = {}
    by_pid = {p.pid: p for p in sample.processes}
    for name, view in views.items():
        mine = [p for pid in view.get("pids") or () if (p := by_pid.get(pid)) is not None]
        gpu: dict[str, Optional[int]] = {}
        for p in mine:
            for uuid, used in p.gpu_bytes.items():
                was = gpu.get(uuid, 0)
                gpu[uuid] = None if used is None or was is None else was + used
        rss = [p.host_bytes for p in mine if p.alive and p.host_bytes is not None]
        out[name] = {**view, "gpu_bytes": gpu, "rss_bytes": sum(rss) if rss else None,
                     "up": any(p.alive for p in mine) if mine else None}
    return out
