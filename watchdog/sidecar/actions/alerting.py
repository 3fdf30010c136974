"""What fires, to Alertmanager: labels per server, the alert book, the sender's thread.

Each poll the step says what fires for each server; here it becomes Alertmanager alerts
(alerts.build), kept in the book (resends, resolutions) and handed to the sender, which posts on
its own thread.

Every alert carries `host`, this host's name (socket.gethostname(), as the metrics'
`torch_watchdog_host_info` has it), so that an inhibit rule pairs it with a Prometheus rule's
alert on the same server (config/alertmanager-example.yml: `equal: [host, server]`):
`instance` cannot, as it is the scrape target there.
"""
from __future__ import annotations

import socket
from typing import Any, Callable

from torch_watchdog import events
from torch_watchdog.sidecar.actions import alerts
from torch_watchdog.sidecar.config import AlertsConfig
from torch_watchdog.sidecar.core.results import PollResult, ServerView


class Alerting:
    def __init__(self, cfg: AlertsConfig, on_failure: Callable[[str, str], None]):
        self.cfg = cfg
        self.book = alerts.AlertBook(cfg.resend_s, cfg.resolved_retention_s,
                                     min_firing_s={"reload": cfg.reload_min_firing_s})
        self.sender = (alerts.AlertSender(cfg.urls, cfg.timeout_s, on_failure=on_failure)
                       if cfg.urls else None)

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
        host = socket.gethostname()
        base = {"service": self.cfg.service, "instance": self.cfg.instance or host,
                "host": host}
        firing: dict[tuple[Any, ...], dict[str, Any]] = {}
        for name, fires in poll.firing.items():
            if fires:  # the common case: nothing of it fires
                firing.update(self._alerts(name, fires, poll.views[name], base))
        if poll.host_firing:
            firing.update(alerts.build(poll.host_firing, {}, {}, base))
        self.book.update(firing, now)
        self.sender.submit(self.book.due(now))

    def _alerts(self, name: str, fires: dict[str, dict[str, Any]], view: ServerView,
                base: dict[str, str]) -> dict[tuple[Any, ...], dict[str, Any]]:
        # its label, as its metrics': the same over its restarts (core/labels.py)
        labels = {**base, "server": view.get("label") or name}
        deployment = events.serve_deployment(name)
        if deployment is not None:  # Alertmanager groups a deployment's replicas on all nodes
            labels["deployment"] = deployment
        uuid = view["forecast"]["gpu_uuid"] or (view["gpus"][0] if view["gpus"] else None)
        if uuid:
            labels["gpu_uuid"] = uuid
        return alerts.build(fires, view["estimates"], view["forecast"], labels)

    def counts(self) -> dict[str, dict[str, Any]]:
        """The sender's counters by url: sent, failed posts, dropped alerts."""
        s = self.sender
        return {"sent": dict(s.sent) if s else {}, "failed": dict(s.failed) if s else {},
                "dropped": dict(s.dropped) if s else {}}
