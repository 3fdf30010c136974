"""Each server's view, for the metrics, the alerts and the status page: what its state and
forecast say, as plain dicts (Snapshot.servers). A view is built each poll and never changed
after: its readers (metrics, alerts, the status page, HTTP threads) only read it."""
from __future__ import annotations

from typing import Any

from torch_watchdog.sidecar.config import CorrelateConfig


def server_views(servers: dict, cfg: CorrelateConfig) -> dict[str, dict[str, Any]]:
    """name -> {"estimates", "forecast", "active_causes", "pids", "gpus"} of every server
    (step.Server) in `servers`."""
    out = {}
    for name, server in servers.items():
        state = server.state
        out[name] = {"estimates": state.estimates(cfg), "forecast": server.forecast.as_dict(),
                     "active_causes": tuple(state.active), "pids": sorted(server.pids),
                     "gpus": sorted(state.gpus or server.gpus)}
    return out
