"""The pure step over a whole host: each GPU its own budget, each server its own state, a leak
is growth too, the re-check and the reset decided inside the step (replay = live)."""
from __future__ import annotations

import dataclasses

from torch_watchdog import events
from torch_watchdog.sidecar.config import Config, ForecastConfig, PolicyConfig, ReloadConfig
from torch_watchdog.sidecar.core.forecast import FAIL_FREE_BYTES
from torch_watchdog.sidecar.core.step import Host, step
from torch_watchdog.sidecar.core.observations import (DeviceSample, ProcessSample, ReloadOutcome,
                                                      Sample)

MB = 1 << 20
GB = 1 << 30
A, B = "GPU-aaaa", "GPU-bbbb"
POLICY = PolicyConfig(reload_lead_s=60, alert_lead_s=600, hold_polls=3, warmup_s=0,
                      cooldown_s=600)
CFG = Config(policy=POLICY, forecast=ForecastConfig(headroom_bytes=0, window_s=30),
             reload=ReloadConfig(method="signal"))


def hello(t: float, pid: int, server: str, devices: list[str]) -> events.Hello:
    return events.Hello(t=t, pid=pid, torch="2.13", agent="test", devices=devices, config={},
                        capabilities={}, watched=["m"], argv="serve", server=server)


def compile_event(t: float, pid: int) -> events.Compile:
    return events.Compile(t=t, pid=pid, compile_id="0/0", function="f", seconds=1.0)


def calls(t: float, pid: int, n: int, distinct: int) -> events.Calls:
    return events.Calls(t=t, pid=pid, name="m", calls=n, seconds=n * 1e-3, stall_calls=0,
                        stall_seconds=0.0, distinct_shapes=distinct, window_s=1.0)


def sample(t: float, gpus: dict, procs: dict) -> Sample:
    """gpus: uuid -> (used, total); procs: pid -> {uuid: bytes}."""
    return Sample(t=t, devices=tuple(DeviceSample(u, used, total, total - used)
                                     for u, (used, total) in gpus.items()),
                  processes=tuple(ProcessSample(pid, True, 1 << 30, dict(g))
                                  for pid, g in procs.items()))


class Host2:
    """Two replicas, one per GPU, one sidecar; each grows as told."""

    def __init__(self, cfg: Config = CFG):
        self.cfg, self.host, self.t, self.actions = cfg, Host(), 1000.0, []
        self.mine = {101: 2 * GB, 202: 2 * GB}
        for pid, server, gpu in ((101, "replica-a", A), (202, "replica-b", B)):
            self.feed(hello(self.t, pid, server, [gpu]), compile_event(self.t, pid))

    def feed(self, *observations) -> list:
        out = []
        for o in observations:
            out += step(self.host, o, self.cfg).actions
        self.actions += out
        return out

    def poll(self, grow_a: int = 0, grow_b: int = 0, dt: float = 0.25) -> list:
        self.t += dt
        self.mine[101] += grow_a
        self.mine[202] += grow_b
        s = sample(self.t, {A: (self.mine[101] + GB, 10 * GB), B: (self.mine[202] + GB, 10 * GB)},
                   {101: {A: self.mine[101]}, 202: {B: self.mine[202]}})
        return self.feed(s)

    def of(self, kind: str) -> list:
        return [a for a in self.actions if a.kind == kind]


def test_each_gpu_has_its_own_budget_and_only_the_growing_replica_is_reloaded():
    h = Host2()
    for _ in range(10):
        h.poll()
    while not h.of("execute") and h.t < 2000:
        h.poll(grow_a=10 * MB)
    # A: 3 GB used of 10, 40 MB/s -> OOM in ~3 min; summed with B's GPU, ~6 min
    (decided,) = h.of("reload")
    assert decided.server == "replica-a" and decided.pids == (101,) and decided.gpus == (A,)
    (carried,) = h.of("execute")
    assert carried.server == "replica-a" and carried.pids == (101,)
    a, b = h.host.servers["replica-a"], h.host.servers["replica-b"]
    assert a.forecast.gpu_uuid == A and a.forecast.seconds <= 60
    assert b.forecast.seconds == float("inf") and b.pids == {202: 1000.0}
    # its own GPU's, not the sum of two, to where its allocations fail
    assert a.forecast.budget_bytes == 10 * GB - FAIL_FREE_BYTES


def test_one_replica_reloads_at_a_time_then_the_other():
    h = Host2()
    for _ in range(10):
        h.poll()
    while len(h.of("execute")) < 1 and h.t < 2000:
        h.poll(grow_a=10 * MB, grow_b=10 * MB)
    first = h.of("execute")[0].server
    for _ in range(5):  # the first reload runs: the other one waits (the host-wide cap)
        h.poll(grow_a=10 * MB, grow_b=10 * MB)
    assert [a.server for a in h.of("reload")] == [first]
    h.feed(ReloadOutcome(True, "exited after SIGTERM", 3.0).at(h.t, first))
    for _ in range(5):
        h.poll(grow_b=10 * MB if first == "replica-a" else 0,
               grow_a=10 * MB if first == "replica-b" else 0)
    assert sorted(a.server for a in h.of("reload")) == ["replica-a", "replica-b"]
    assert h.host.servers[first].state.first_t is None or \
        h.host.servers[first].state.records == 0  # the reloaded one starts afresh


def bucketed(h: Host2, polls: int, leak: int = 0) -> None:
    """Replica A: 8 bucket sizes, recorded at warm-up, thousands of requests since."""
    for _ in range(polls):
        h.feed(calls(h.t + 0.1, 101, 100, 8))
        h.poll(grow_a=leak)


def warm_bucketed(h: Host2) -> None:
    for k in range(8):
        h.feed(events.NewShape(t=h.t, pid=101, name="m", shape=[[1, 32 << k]], seconds=0.05,
                               distinct=k + 1))
        for phase in ("warmup", "record"):
            h.feed(events.CudagraphRecord(t=h.t, pid=101, phase=phase, compile_id="0/0",
                                          key=[32 << k], shape=None, seconds=0.01))
    h.poll(grow_a=8 * MB)


def test_a_leak_under_bucketed_traffic_is_reloaded_as_unexplained_growth():
    h = Host2()
    warm_bucketed(h)
    bucketed(h, 120)
    assert not h.of("reload")
    while not h.of("reload") and h.t < 4000:
        bucketed(h, 10, leak=int(1.5 * MB))  # the server's own code keeps 6 MiB/s alive
    (decided,) = h.of("reload")
    assert decided.server == "replica-a" and decided.cause == "memory_growth_unexplained"
    assert h.host.servers["replica-a"].forecast.driver == "unexplained"
    room = 10 * GB - (h.mine[101] + GB)
    assert 30 * 6 * MB < room < 90 * 6 * MB  # decided about a minute (the lead) before the OOM
    assert decided.detail["seconds_to_oom"] <= POLICY.reload_lead_s


def test_the_bucketed_control_and_a_plateau_near_full_get_no_reload():
    h = Host2()
    warm_bucketed(h)
    bucketed(h, 600)
    h.mine[101] = int(9.97 * GB) - GB  # a server that holds 99.7 % of its GPU, flat
    bucketed(h, 600)
    assert not h.of("reload") and not h.of("execute")
    assert h.host.servers["replica-a"].forecast.seconds == float("inf")


def test_an_event_from_the_far_future_cannot_switch_the_forecast_off():
    h = Host2()
    for _ in range(10):
        h.poll()
    h.feed(dataclasses.replace(calls(h.t, 101, 1, 1), t=h.t + 1e9))
    assert h.host.skewed_events == 1
    while not h.of("reload") and h.t < 2000:
        h.poll(grow_a=10 * MB)
    assert h.of("reload")[0].server == "replica-a"


def test_a_cancelled_decision_then_a_restart_then_fresh_alerts():
    h = Host2()
    for _ in range(10):
        h.poll()
    while not h.of("reload") and h.t < 2000:
        h.poll(grow_a=10 * MB)
    h.poll(grow_a=-4 * GB)  # let go of 4 GB: at the re-check the forecast has cleared
    (cancel,) = h.of("cancel")
    assert cancel.server == "replica-a" and not h.of("execute")
    assert h.host.servers["replica-a"].policy.reloads == []  # no cooldown from it
    # the replica crashes; systemd starts a new process, which says hello
    h.feed(sample(h.t + 1, {A: (GB, 10 * GB), B: (3 * GB, 10 * GB)},
                  {101: {}, 202: {B: h.mine[202]}}))
    h.host.alive[101] = False
    before = len(h.of("alert"))
    h.feed(hello(h.t + 2, 303, "replica-a", [A]))
    (restart,) = h.of("restart")
    assert restart.server == "replica-a" and restart.detail["old_pids"] == [101]
    a = h.host.servers["replica-a"]
    assert set(a.pids) == {303} and a.state.records == 0 and a.policy.alerted == set()
    assert len(h.of("alert")) == before


def test_configured_pids_are_owned_by_their_server_whatever_the_agent_says():
    h = Host2()
    s = dataclasses.replace(sample(h.t + 1, {A: (3 * GB, 10 * GB)}, {101: {A: 2 * GB}}),
                            configured={"llm.service": (101,)})
    h.feed(s)
    assert h.host.owner[101] == "llm.service"
    h.feed(hello(h.t + 2, 101, "pgid:55", [A]))
    assert h.host.owner[101] == "llm.service"
    assert 101 not in h.host.servers["replica-a"].pids


def test_no_server_exists_without_a_process_and_an_early_pid_is_adopted_by_its_hello():
    host = Host()
    s = sample(1000.0, {A: (3 * GB, 10 * GB), B: (3 * GB, 10 * GB)}, {})
    assert step(host, s, CFG).actions == [] and host.servers == {}
    assert host.focus().name == "default" and host.servers == {}  # shown, not kept
    step(host, calls(1000.5, 101, 5, 2), CFG)  # heard before its hello (a sidecar restart)
    assert host.servers == {} and 101 not in host.owner  # held, in no server
    step(host, hello(1001.0, 101, "replica-a", [A]), CFG)
    assert list(host.servers) == ["replica-a"]
    assert host.servers["replica-a"].state.calls.requests == 5  # what it held, folded
    assert host.unplaced == {}


def test_growth_on_a_shared_gpu_without_per_process_numbers_is_alerted_not_reloaded():
    """Two servers on one GPU, NVML without per-process memory (a container, MIG): the
    device grows, but nothing pins it on either: an alert, no reload."""
    h = Host2()
    used = 3 * GB
    for pid, server in ((101, "replica-a"), (202, "replica-b")):
        h.feed(hello(h.t, pid, server, [A]))
    for i in range(800):
        h.t += 0.25
        used += 10 * MB if i > 10 else 0
        h.feed(Sample(t=h.t, devices=(DeviceSample(A, used, 10 * GB, 10 * GB - used),),
                      processes=(ProcessSample(101, True, GB, {A: None}),
                                 ProcessSample(202, True, GB, {A: None}))))
        if used > 9 * GB:
            break
    assert [a.reason for a in h.of("alert") if a.reason == "oom_forecast"]
    assert not h.of("reload") and not h.of("execute")


def test_a_server_restarted_under_a_new_process_group_keeps_its_reload_history():
    """A supervisor restarts the server in a new process group: the agent's default name
    (`pgid:N`) changes, but the cooldown must hold (the demo reloaded again 21 s after)."""
    h = Host2()
    h.feed(dataclasses.replace(hello(h.t, 303, "pgid:303", [A]), ppid=50))
    h.mine[303] = 2 * GB
    for _ in range(10):
        h.poll()
    h.host.servers["pgid:303"].policy.reloads.append(h.t)  # reloaded just now
    h.feed(ReloadOutcome(True, "exited after SIGTERM", 2.0).at(h.t, "pgid:303"))
    h.feed(dataclasses.replace(hello(h.t + 5, 404, "pgid:404", [A]), ppid=50))
    assert "pgid:303" not in h.host.servers
    assert h.host.servers["pgid:404"].policy.reloads == [h.t]
    # another supervisor's server is another server
    h.feed(dataclasses.replace(hello(h.t + 6, 505, "pgid:505", [B]), ppid=60))
    assert h.host.servers["pgid:505"].policy.reloads == []


def test_a_replica_started_where_another_died_does_not_take_its_reload_history():
    """Replicas under one supervisor (parent 50), one GPU each: the one on GPU 0 is reloaded
    and never comes back; a new replica on GPU 1 of the same supervisor is not it, nor is a
    named one, while the GPU 0 replica's next start under a new group is."""
    h = Host2()
    h.feed(dataclasses.replace(hello(h.t, 303, "pgid:50/cuda:0", [A]), ppid=50))
    h.mine[303] = 2 * GB
    h.poll()
    h.host.servers["pgid:50/cuda:0"].policy.reloads.append(h.t)
    h.feed(dataclasses.replace(sample(h.t + 1, {A: (3 * GB, 10 * GB)}, {}),
                               processes=(ProcessSample(303, False, 0, {}),)))
    h.feed(dataclasses.replace(hello(h.t + 2, 404, "pgid:50/cuda:1", [B]), ppid=50))
    h.feed(dataclasses.replace(hello(h.t + 2, 405, "replica-c", [B]), ppid=50))
    assert h.host.servers["pgid:50/cuda:1"].policy.reloads == []
    assert h.host.servers["replica-c"].policy.reloads == []
    h.feed(dataclasses.replace(hello(h.t + 3, 406, "pgid:60/cuda:0", [A]), ppid=50))
    assert "pgid:50/cuda:0" not in h.host.servers
    assert h.host.servers["pgid:60/cuda:0"].policy.reloads == [h.t]


def test_a_server_whose_processes_are_gone_leaves_the_page():
    """Issue 26: after a server died the page still listed it ("379 MiB over budget") and
    plotted its last memory flat. Once its processes are forgotten it is left out of the
    views (its reload history stays for its next start)."""
    h = Host2()
    for _ in range(4):
        h.poll()
    h.host.servers["replica-b"].policy.reloads.append(h.t)
    t = h.t
    for dt in (1, 40):  # dead at the next sample, forgotten once silent for AGENT_SILENT_S
        s = sample(t + dt, {A: (3 * GB, 10 * GB), B: (GB, 10 * GB)}, {101: {A: 2 * GB}})
        result = step(h.host, dataclasses.replace(s, processes=s.processes + (
            ProcessSample(202, False, None, {}),)), CFG)
    assert set(result.poll.views) == {"replica-a"} and result.poll.focus == "replica-a"
    assert h.host.servers["replica-b"].policy.reloads  # kept for its next start


def test_once_every_server_is_gone_the_views_wait_and_name_them():
    """The last server stopped: the page plotted its last memory flat and forecast against
    it. It leaves the views, which name it as stopped (the page's waiting state)."""
    h = Host2()
    for _ in range(4):
        h.poll()
    t = h.t
    dead = (ProcessSample(101, False, None, {}), ProcessSample(202, False, None, {}))
    for dt in (1, 40):  # both dead at the next sample, forgotten once silent
        s = sample(t + dt, {A: (GB, 10 * GB), B: (GB, 10 * GB)}, {})
        result = step(h.host, dataclasses.replace(s, processes=dead), CFG)
    poll = result.poll
    assert poll.views == {} and poll.focus is None
    assert poll.stopped == ("replica-a", "replica-b")
    assert poll.focus_view["estimates"]["memory_bytes"] is None
    assert set(h.host.servers) == {"replica-a", "replica-b"}  # kept for their next start


def test_pids_heard_before_their_hellos_are_held_in_no_server_until_each_names_its_own():
    """Two processes heard before their hellos (a sidecar restarted beside them): no server
    gets them, so no server's memory sums theirs and no policy can reload them (the restarted
    sidecar drained every server on the host through a `default` of the unplaced); once one
    names its server, it and its held events are that server's only."""
    h = Host2()
    for pid in (303, 304):
        h.feed(calls(h.t, pid, 5, 1))
    assert "default" not in h.host.servers and set(h.host.unplaced) == {303, 304}
    h.feed(hello(h.t + 1, 303, "llm", [A]))
    assert set(h.host.servers["llm"].pids) == {303} and h.host.owner[303] == "llm"
    assert h.host.servers["llm"].state.calls.requests == 5
    assert set(h.host.unplaced) == {304} and 304 not in h.host.owner
    assert "default" not in h.host.servers


def test_a_process_of_another_user_naming_a_server_is_a_server_of_its_own():
    """Issue 28, item 4: another user's process says hello as the victim's server, then grows:
    the reload targets it alone (under `<name>@uid:<uid>`). The server's root master's workers
    under another user, and root, still join it."""
    h = Host2()
    h.host.servers["replica-a"].uid = 1000
    h.feed(dataclasses.replace(hello(h.t, 666, "replica-a", [A]), uid=1001, ppid=1),
           compile_event(h.t - 30, 666))
    assert h.host.owner[666] == "replica-a@uid:1001"
    assert h.host.servers["replica-a"].pids.keys() == {101}
    h.feed(dataclasses.replace(hello(h.t, 102, "replica-a", [A]), uid=33, ppid=101))  # worker
    h.feed(dataclasses.replace(hello(h.t, 103, "replica-a", [A]), uid=0, ppid=1))     # root
    assert h.host.owner[102] == h.host.owner[103] == "replica-a"
    h.mine[666] = 2 * GB
    for _ in range(600):
        h.t += 0.25
        h.mine[666] += 8 * MB
        h.feed(sample(h.t, {A: (h.mine[101] + h.mine[666] + GB, 10 * GB),
                            B: (h.mine[202] + GB, 10 * GB)},
                      {101: {A: h.mine[101]}, 202: {B: h.mine[202]}, 666: {A: h.mine[666]},
                       102: {}, 103: {}}))
    decided = h.of("reload")
    assert decided and {a.server for a in decided} == {"replica-a@uid:1001"}
    assert decided[0].pids == (666,)


def test_an_agent_naming_a_configured_server_cannot_add_a_pid_to_it():
    """Another local process says hello as the unit's server, then grows: the reload of that
    server still targets the unit's own pids only (it would have SIGTERMed both on main)."""
    h = Host2()
    configured = dataclasses.replace(sample(h.t + 1, {A: (3 * GB, 10 * GB)}, {101: {A: 2 * GB}}),
                                     configured={"llm.service": (101,)})
    h.feed(configured)
    h.feed(hello(h.t + 2, 666, "llm.service", [A]))  # the forger
    assert h.host.servers["llm.service"].pids.keys() == {101}
    assert h.host.owner[666] == "default"  # a server of its own: a reload signals it alone
    h.feed(events.CudagraphRecord(t=h.t + 3, pid=666, phase="record", compile_id="0/0",
                                  key=[1], shape=None, seconds=0.01))
    assert h.host.servers["llm.service"].state.records == 0  # nothing folded into the unit's


def test_agent_liveness_drops_at_the_first_poll_with_every_agent_gone():
    def seen(t, alive):
        return Sample(t=t, processes=tuple(ProcessSample(pid, up, 100)
                                           for pid, up in alive.items()))
    host = Host()
    for obs in (seen(0.0, {}), hello(0.5, 11, "svc", []), hello(0.6, 12, "svc", [])):
        step(host, obs, CFG)
    assert host.agents_alive()  # heard, not read yet
    step(host, seen(1.0, {11: True, 12: True}), CFG)
    assert host.agents_alive()
    step(host, seen(2.0, {11: False, 12: True}), CFG)
    assert host.agents_alive()
    step(host, seen(3.0, {11: False, 12: False}), CFG)
    assert not host.agents_alive()  # the next poll, not 30 s later
    step(host, seen(40.0, {11: False, 12: False}), CFG)
    assert host.agents == {} and not host.agents_alive()


def test_a_reload_refused_for_now_is_asked_again_soon_and_not_counted():
    """An eviction answered 429 (the PodDisruptionBudget: another replica is restarting): no
    cooldown, not counted toward the hourly maximum, decided again after retry_after_s."""
    h = Host2()
    for _ in range(10):
        h.poll()
    while not h.of("execute") and h.t < 2000:
        h.poll(grow_a=10 * MB)
    decided = h.of("reload")[0].t
    h.feed(ReloadOutcome(False, "HTTP 429", 0.1, retry_after_s=10.0).at(h.t, "replica-a"))
    refused_at = h.t
    assert h.host.servers["replica-a"].policy.reloads == []
    while len(h.of("reload")) < 2 and h.t < refused_at + 60:
        h.poll(grow_a=10 * MB)
    again = h.of("reload")[1].t
    assert refused_at + 10.0 <= again < refused_at + 12.0 and again > decided


def test_a_reload_that_does_not_bring_the_server_back_is_reload_failed_until_it_is_back():
    """Carried out, but no new process said hello in time: `reload_failed` (alerted, critical),
    not `reload_ok` and no reset; a hello from a new process of the server clears it. An
    outcome read back from the sample log is the same observation (replay = live)."""
    from torch_watchdog.sidecar.actions import alerts
    from torch_watchdog.sidecar.offline.sample_log import outcome_from_dict, outcome_to_dict

    h = Host2()
    for _ in range(10):
        h.poll()
    while not h.of("execute") and h.t < 2000:
        h.poll(grow_a=10 * MB)
    failed = ReloadOutcome(False, "exited after SIGTERM; no hello from a new process of the "
                           "server within 120 s", 125.0, failed=True).at(h.t, "replica-a")
    assert outcome_from_dict(outcome_to_dict(failed)) == failed
    assert "failed" not in outcome_to_dict(dataclasses.replace(failed, failed=False))
    (done,) = h.feed(outcome_from_dict(outcome_to_dict(failed)))
    assert done.kind == "reload_failed" and done.server == "replica-a" and not h.of("reload_ok")
    h.poll()
    a = h.host.servers["replica-a"]
    assert a.firing["reload_failed"]["outcome"] == failed.detail
    built = alerts.build(a.firing, {}, {}, {"server": "replica-a"})
    (label,) = [dict(k) for k in built if dict(k)["cause"] == "reload_failed"]
    assert label["alertname"] == "TorchCompileReloadFailed" and label["severity"] == "critical"
    h.feed(hello(h.t, 101, "replica-a", [A]))  # the old process's periodic hello: not back
    h.poll()
    assert "reload_failed" in a.firing
    h.feed(hello(h.t, 111, "replica-a", [A]))  # a new process of it: back
    h.poll()
    assert "reload_failed" not in a.firing


def test_the_other_replica_s_reload_holds_this_one_back_and_its_view_says_so():
    h = Host2()
    for _ in range(10):
        h.poll()
    while not h.of("execute") and h.t < 2000:
        h.poll(grow_a=10 * MB, grow_b=10 * MB)
    first = h.of("execute")[0].server
    other = "replica-b" if first == "replica-a" else "replica-a"
    for _ in range(5):
        h.poll(grow_a=10 * MB, grow_b=10 * MB)
    views = step(h.host, sample(h.t + 0.01, {}, {101: {A: h.mine[101]}, 202: {B: h.mine[202]}}),
                 h.cfg).poll.views
    assert views[other]["held"]["reason"] == "concurrency_cap"
    assert views[other]["held"]["until_t"] is None  # it ends with the other reload
    assert views[first]["held"] is None  # its own reload under way holds nothing back


def test_a_dry_run_says_it_holds_every_reload_back():
    cfg = dataclasses.replace(CFG, policy=dataclasses.replace(CFG.policy, dry_run=True))
    h = Host2(cfg)
    for _ in range(10):
        h.poll()
    while not h.of("reload") and h.t < 2000:
        h.poll(grow_a=10 * MB)
    decided = h.of("reload")[0]
    assert decided.not_done == "dry run"
    for _ in range(8):  # the cooldown follows the decision; the reason shown stays the dry run
        h.poll(grow_a=10 * MB)
    view = h.host.servers["replica-a"]
    assert view.policy.held.reason == "dry_run" and view.policy.held.since == decided.t
    assert h.host.servers["replica-b"].policy.held is None


def test_the_new_process_s_events_heard_before_the_reload_ends_are_kept():
    """A reload's new process often says hello and compiles before the reload's outcome comes
    back: those compiles are its own, and its counts start with them, not at zero."""
    h = Host2()
    for _ in range(10):
        h.poll()
    while not h.of("execute") and h.t < 2000:
        h.poll(grow_a=10 * MB)
    assert [a.server for a in h.of("execute")] == ["replica-a"]
    h.t += 1  # the old process has exited (SIGTERM): the new one is the reload's, not a restart
    h.feed(Sample(t=h.t, devices=(DeviceSample(A, GB, 10 * GB, 9 * GB),),
                  processes=(ProcessSample(101, False, 0, {}),)))
    h.feed(hello(h.t, 303, "replica-a", [A]), compile_event(h.t, 303),
           compile_event(h.t + 0.1, 303))
    h.feed(ReloadOutcome(True, "exited after SIGTERM", 3.0).at(h.t + 1, "replica-a"))
    a = h.host.servers["replica-a"]
    assert set(a.pids) == {303}
    assert a.state.compiles.compiles == 2  # the new process's two, not 0, not the old one's too
    assert not h.of("restart") and [k.kind for k in h.actions[-1:]] == ["reload_ok"]
