"""What fires, to Alertmanager: labels per server, the alert book, the sender's thread.

Each poll the step says what fires for each server; here it becomes Alertmanager alerts
(alerts.build), kept in the book (resends, resolutions) and handed to the sender, which posts on
its own thread. An alert is built again only when what it is built from changed (its
description is a few strings, for every firing alert, every poll).
"""
from __future__ import annotations

import socket
from typing import Callable

from torch_watchdog import events
from torch_watchdog.sidecar.actions import alerts
from torch_watchdog.sidecar.config import AlertsConfig
from torch_watchdog.sidecar.core.results import PollResult, ServerView


class Alerting:
    def __init__(self, cfg: AlertsConfig, on_failure: Callable[[str, str], None]):
        self.cfg = cfg
        self.book = alerts.AlertBook(cfg.resend_s, cfg.resolved_retention_s)
        self.sender = (alerts.AlertSender(cfg.urls, cfg.timeout_s, on_failure=on_failure)
                       if cfg.urls else None)
        self._kept: dict[str, tuple] = {}  # server -> (what alerts.build read, what it built)

    def start(self) -> None:
        if self.sender is not None:
            self.sender.start()

    def stop(self) -> None:
        if self.sender is not None:
            self.sender.stop()

    def dispatch(self, now: float, poll: PollResult) -> None:
        """Hand what fires, for every server and for the host, to the sender's thread."""
        if self.sender is None:
            return
        base = {"service": self.cfg.service, "instance": self.cfg.instance or
                socket.gethostname()}
        firing: dict = {}
        for name, fires in poll.firing.items():
            if fires:  # the common case: nothing of it fires
                firing.update(self._alerts(name, fires, poll.views[name], base))
        if len(self._kept) > len(poll.firing):  # servers come and go
            self._kept = {k: v for k, v in self._kept.items() if k in poll.firing}
        if poll.host_firing:
            firing.update(alerts.build(poll.host_firing, {}, {}, base))
        self.book.update(firing, now)
        self.sender.submit(self.book.due(now))

    def _alerts(self, name: str, fires: dict, view: ServerView, base: dict) -> dict:
        labels = {**base, "server": name}
        deployment = events.serve_deployment(name)
        if deployment is not None:  # Alertmanager groups a deployment's replicas on all nodes
            labels["deployment"] = deployment
        uuid = view["forecast"]["gpu_uuid"] or (view["gpus"][0] if view["gpus"] else None)
        if uuid:
            labels["gpu_uuid"] = uuid
        was = self._kept.get(name)
        if was is None or was[0] != fires or was[1] != view["estimates"] \
                or was[2] != view["forecast"] or was[3] != labels:
            was = self._kept[name] = (fires, view["estimates"], view["forecast"], labels,
                                      alerts.build(fires, view["estimates"], view["forecast"],
                                                   labels))
        return was[4]

    def counts(self) -> dict[str, dict]:
        """The sender's counters by url: sent, failed posts, dropped alerts."""
        s = self.sender
        return {"sent": dict(s.sent) if s else {}, "failed": dict(s.failed) if s else {},
                "dropped": dict(s.dropped) if s else {}}
