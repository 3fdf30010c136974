"""The demo's two profiles (full, `--short`) and the sidecar config it writes (pure).

The numbers are chosen so every step shows within minutes on a laptop CPU (2 cores: measured
in the demo's tests): a recompile limit of 4 instead of torch's 8, a stand-in budget of the
server's memory after warm-up plus a margin, a forecast window and reload lead of seconds
instead of minutes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class Profile:
    name: str
    rate: float              # requests per second the demo server is fed
    warm_requests: int       # first requests, in 3 lengths only: compiled, steady
    standin_mb: int          # stand-in memory per distinct length (server.py says why)
    margin_bytes: int        # budget = the server's memory after warm-up + this
    settle_s: float          # after the recompile limit: then the budget is set
    budget_anyway_s: float   # set it this long after the first request even without a limit
    window_s: float          # forecast.window_s
    reload_lead_s: float     # policy.reload_lead_s
    warmup_s: float          # policy.warmup_s
    serve_again: int         # requests the restarted server serves before the demo ends
    timeout_s: float         # the demo gives up after this long
    # benchmarks/results/demo.md: warm compile cache, cold; on MEASURED_ON
    expected_s: tuple = (55, 75)
    limit: int = 4           # torch._dynamo.config.recompile_limit (torch's default: 8)
    lengths: tuple = (16, 320)          # request lengths after the warm requests, inclusive
    warm_lengths: tuple = (120, 168, 216)  # their mean is the uniform range's mean: the
                                           # fallback's cost is not a change of lengths


FULL = Profile("full", rate=5.0, warm_requests=40, standin_mb=4, margin_bytes=480 * MiB,
               settle_s=4.0, budget_anyway_s=150.0, window_s=10.0, reload_lead_s=10.0,
               warmup_s=5.0, serve_again=20, timeout_s=420.0)
SHORT = Profile("short", rate=8.0, warm_requests=24, standin_mb=4, margin_bytes=400 * MiB,
                settle_s=2.0, budget_anyway_s=60.0, window_s=5.0, reload_lead_s=5.0,
                warmup_s=3.0, serve_again=12, timeout_s=240.0,
                expected_s=(30, 50))
PROFILES = {p.name: p for p in (FULL, SHORT)}
# the machine and date of `expected_s` (benchmarks/results/demo.md)
MEASURED_ON = "a 2-core, 24 GiB machine with no GPU, 2026-12-02"


def render_config(p: Profile, *, work: str, socket_path: str, port: int, budget_bytes: int,
                  dry_run: bool = False) -> str:
    """The sidecar's YAML: everything under the demo's work directory, reloads by signal."""
    return f"""# Written by `torch-watchdog demo` ({p.name} profile); config/watchdog.yaml documents
# every key. The budget is the server's memory after warm-up plus a margin: the demo's
# stand-in for a full GPU (until warm-up: the machine's RAM, so no reload can happen).
poll_interval_s: 0.1
metrics_address: "127.0.0.1"
metrics_port: {port}
state_dir: "{work}/state"
sample_log: "{work}/sidecar-samples.jsonl"
server:
  trust_agent_pids: true
agent:
  socket_path: "{socket_path}"
  allowed_uids: [{os.getuid()}]   # the demo's server runs as you (signal reloads need it)
correlate:
  storm_recompiles: 3             # the demo's limit of 4 allows 3 recompiles
  storm_window_s: 120.0
forecast:
  window_s: {p.window_s}
  process_budget_bytes: {int(budget_bytes)}
policy:
  reload_lead_s: {p.reload_lead_s}
  alert_lead_s: {max(30.0, 6 * p.reload_lead_s)}
  hold_polls: 3
  warmup_s: {p.warmup_s}
  cooldown_s: 600.0               # one reload per demo
  max_reloads_per_hour: 3
  dry_run: {str(dry_run).lower()}
reload:
  method: signal                  # SIGTERM; the demo restarts the server (systemd would)
  grace_s: 20.0
"""
