"""step.fold_events, the daemon's path for a poll's agent events, is step() of each event in
turn: the same actions and the same state, whatever the mix (hellos that rename, restart or
adopt, skewed clocks, events before the first sample, configured pids, dead processes)."""
from __future__ import annotations

import random

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.config import Config, PolicyConfig
from torch_watchdog.sidecar.core.step import Host, fold_events, step
from torch_watchdog.sidecar.core.observations import DeviceSample, ProcessSample, Sample

CFG = Config(policy=PolicyConfig(warmup_s=0, hold_polls=1, cooldown_s=0))
GPU = "GPU-aaaa"


def _stream(rng: random.Random, n: int, stay: float = 0.0) -> list:
    """Events and samples in time order; a sample every few events. `stay`: how often an
    event comes from the previous event's process (an agent's datagram: runs of one pid)."""
    out, t, pids = [], 1000.0, [101, 102, 201, 301]
    pid = pids[0]
    alive = dict.fromkeys(pids, True)
    used = 10 << 30
    for i in range(n):
        t += rng.uniform(0.0, 0.05)
        pid = pid if rng.random() < stay else rng.choice(pids)
        r = rng.random()
        if r < 0.08:  # a sample: memory that grows with recordings, a process that may die
            if rng.random() < 0.05:
                alive[rng.choice(pids)] = rng.random() < 0.5
            used += rng.choice([0, 0, 50 << 20, 400 << 20])
            out.append(Sample(t=t, devices=(DeviceSample(GPU, used, 80 << 30, (80 << 30) - used),),
                              processes=tuple(ProcessSample(p, alive[p], 1 << 30,
                                                            {GPU: used // 4})
                                              for p in pids),
                              servers={"configured": (301,)} if i > n // 2 else {}))
            continue
        et = t + (rng.choice([-1e9, 1e9]) if rng.random() < 0.02 else 0.0)  # a broken clock
        kind = rng.random()
        if kind < 0.06:
            e = events.Hello(t=et, pid=pid, torch="2.13", agent="t", devices=[GPU], config={
                "recompile_limit": 3}, capabilities={}, watched=["m"], argv="serve",
                server=rng.choice([None, "a", "b", "configured", f"pgid:{pid}"]),
                ppid=rng.choice([None, 1, 50]))
        elif kind < 0.35:
            e = events.Heartbeat(t=et, pid=pid, seq=i, uptime_s=1.0, queue_depth=0, errors=0)
        elif kind < 0.6:
            e = events.NewShape(t=et, pid=pid, name=rng.choice(["m", "n"]),
                                shape=[[1, rng.randrange(40)]], seconds=0.05,
                                distinct=rng.randrange(60))
        elif kind < 0.85:
            e = events.CudagraphRecord(t=et, pid=pid, phase=rng.choice(["record", "warmup"]),
                                       compile_id="0/1", key=[i], shape=[[1, i]], seconds=0.01)
        elif kind < 0.93:
            e = events.Recompile(t=et, pid=pid, compile_id=f"{rng.randrange(3)}/1", function="f",
                                 seconds=0.5, reason="size")
        else:
            e = events.Calls(t=et, pid=pid, name="m", calls=10, seconds=0.01, stall_calls=1,
                             stall_seconds=0.005, distinct_shapes=3, window_s=1.0)
        out.append(e)
    return out


def _seen(host: Host) -> dict:
    """What a user sees of the host: each server's numbers, causes, pids, and who owns what."""
    return {"servers": {name: (sorted(s.pids.items()), s.state.estimates(CFG.correlate),
                               [f.as_dict() for f in s.state.findings], s.state.now,
                               s.state.first_t, sorted(s.state.pids), s.firing,
                               s.forecast.as_dict())
                        for name, s in host.servers.items()},
            "owner": dict(host.owner), "agents": dict(host.agents),
            "skewed": host.skewed_events}


@pytest.mark.parametrize("stay", [0.0, 0.9])
@pytest.mark.parametrize("seed", range(8))
def test_a_batch_of_events_folds_as_one_step_each(seed, stay):
    stream = _stream(random.Random(seed), 1500, stay)
    one, batched = Host(), Host()
    one_actions, batched_actions, pending = [], [], []
    for obs in stream:
        one_actions += step(one, obs, CFG).actions
        if isinstance(obs, Sample):
            batched_actions += fold_events(batched, pending, CFG)
            pending = []
            batched_actions += step(batched, obs, CFG).actions
        else:
            pending.append(obs)
    batched_actions += fold_events(batched, pending, CFG)
    assert batched_actions == one_actions
    assert _seen(batched) == _seen(one)
    assert len(one.servers) >= 2 and one.skewed_events > 0  # the mix did what it is for
