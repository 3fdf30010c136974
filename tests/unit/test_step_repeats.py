"""A poll that repeats the last one (no event, the same GPU numbers and processes) is folded
cheaply (core/step.py `_Poll`): it must decide and report exactly what a full poll does."""
from __future__ import annotations

import dataclasses
import os
import random

import pytest

from torch_watchdog import events
from torch_watchdog.sidecar.config import Config
from torch_watchdog.sidecar.core import correlate
from torch_watchdog.sidecar.core.step import Host, step
from torch_watchdog.sidecar.offline.traces import Reader, read_all
from torch_watchdog.sidecar.core.observations import (ConfigChange, DeviceSample, ProcessSample,
    Sample)
from tests.unit.test_step import CFG, GB, MB, calls, compile_event, hello

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


@pytest.fixture
def repeats(monkeypatch):
    """How many polls took the repeat path, and how many of them were still (no cause, policy
    or alert computed: before `_Poll.until`)."""
    seen = [0, 0]
    fold_repeat = correlate.fold_repeat

    def counted(*args, **kwargs):
        seen[0] += 1
        seen[1] += kwargs.get("causes") is False
        return fold_repeat(*args, **kwargs)

    monkeypatch.setattr(correlate, "fold_repeat", counted)
    return seen


def observe(host: Host, observations, cfg: Config) -> list:
    """Everything a user sees, after every observation: actions, and each server's forecast,
    estimates, alerts and policy state."""
    out = []
    for obs in observations:
        if isinstance(obs, ConfigChange):
            cfg = obs.config
            continue
        out.append([a.as_dict() for a in step(host, obs, cfg).actions])
        if isinstance(obs, Sample):
            out.append({name: (s.forecast, s.state.estimates(cfg.correlate), s.firing,
                               s.policy, [f.as_dict() for f in s.state.findings])
                        for name, s in host.servers.items()})
    return out


def host_trace() -> list:
    """Two replicas on two GPUs: long idle stretches (repeats; their RSS moves every poll, as
    a live server's does), a warm-up, recordings, steady growth on one and a leak on the
    other, a per-process reading NVML stops giving, NVML down for a while, the host's memory
    moving now and then, and a restart."""
    out, t, used = [], 1000.0, {"GPU-a": 20 * GB, "GPU-b": 78 * GB}
    out += [hello(t, 11, "a", ["GPU-a"]), hello(t, 22, "b", ["GPU-b"])]
    for k in range(3000):
        t += 0.1
        if k == 50:
            out.append(compile_event(t, 11))
        if 400 <= k < 900 and k % 5 == 0:       # a: recordings that cost memory
            out.append(events.CudagraphRecord(t=t, pid=11, phase="record", compile_id="0/1",
                                              key=[k], shape=[[1, k]], seconds=0.01))
            used["GPU-a"] += 40 * MB
        if k % 10 == 0 and k < 2480:
            out.append(calls(t, 11, 50, min(k // 10, 80)))
        if 1200 <= k < 1900 and k % 2 == 0:     # b: a leak toward its GPU's end
            used["GPU-b"] += 4 * MB
        if k == 2500:                           # a restarts
            out.append(hello(t, 33, "a", ["GPU-a"]))
        pids = {11: k < 2490, 22: True, 33: k >= 2500}
        gone_gpu = 1700 <= k < 1720             # NVML stops listing b's process
        nvml_up = not 1800 <= k < 1810
        devices = tuple(DeviceSample(u, b, 80 * GB, 80 * GB - b) for u, b in used.items()) \
            if nvml_up else ()
        procs = tuple(ProcessSample(pid, alive, 2 * GB + k * 4096 if alive else None,
                                    {} if not alive else
                                    {("GPU-a" if pid != 22 else "GPU-b"):
                                     None if gone_gpu and pid == 22 else used["GPU-a"] - GB
                                     if pid != 22 else used["GPU-b"] - GB})
                      for pid, alive in sorted(pids.items()))
        host_available = 100 * GB - (k // 300) * GB  # moves now and then
        out.append(Sample(t=t, devices=devices, processes=procs, nvml_up=nvml_up,
                          host_total_bytes=128 * GB, host_available_bytes=host_available))
    return out


def assert_repeats_decide_alike(repeats, trace, least: int) -> list:
    """Every observation of `trace` with repeats (more than `least` repeated polls, more than
    `least` of them still) decides and reports what full polls do; the full polls' output."""
    full = observe(Host(repeats=False), trace, CFG)
    assert repeats[0] == 0
    fast = observe(Host(), trace, CFG)
    assert repeats[0] > least  # most polls repeat the last one
    assert repeats[1] > least  # … and most of them are still: nothing due
    assert fast == full
    return full


def test_repeated_polls_decide_and_report_what_full_polls_do(repeats):
    # most polls of both servers repeat the last one
    full = assert_repeats_decide_alike(repeats, host_trace(), 3000)
    decided = {a["action"] for x in full if isinstance(x, list) for a in x}
    assert {"restart", "alert", "reload", "execute"} <= decided


@pytest.mark.parametrize("name", ["h200x2-two-replicas-samples.jsonl.gz",
                                  "h200-leak-bucketed-samples.jsonl.gz"])
def test_recorded_traces_replay_the_same_with_repeats(name, repeats):
    def trace():
        return read_all([Reader(os.path.join(FIX, name))])

    full = observe(Host(repeats=False), trace(), Config())
    fast = observe(Host(), trace(), Config())
    assert repeats[0] > 500 and repeats[1] > 500
    assert fast == full


def eight_by_eight_trace() -> list:
    """A big host: 8 replicas on 8 GPUs. Half the GPUs' memory moves every poll (an
    allocator's 2 MiB wobble, and one random walk), one leaks toward its end, one loads a
    model mid-run, the rest stay still; request counts from half the servers, NVML down for
    a moment, and a replica that dies and comes back."""
    rng = random.Random(7)
    gpus = [f"GPU-{i}" for i in range(8)]
    out, t = [], 5000.0
    used = [10 * GB] * 8
    used[1] = 74 * GB
    out += [hello(t, 100 + i, f"replica-{i}", [gpus[i]]) for i in range(8)]
    for k in range(2500):
        t += 0.1
        for i in (0, 2, 4):                     # the wobble: 8 polls up, 8 down
            used[i] += 2 * MB if k % 16 < 8 else -2 * MB
        used[6] = max(GB, used[6] + rng.randint(-3, 3) * MB)  # a random walk
        if k >= 600:
            used[1] += 6 * MB                   # a leak: OOM forecast, reload
        if k == 300:
            used[5] += 2 * GB                   # a model load: one step, then still
        if k % 10 == 0 and k < 2400:
            out += [calls(t, 100 + i, 20, min(k // 10, 30)) for i in range(4)]
        if k % 10 == 0 and k < 2000:
            out.append(calls(t, 107, 5, 3))     # heard from until it dies
        if k == 2050:
            out.append(hello(t, 200, "replica-7", [gpus[7]]))
        nvml_up = not 1500 <= k < 1505
        devices = tuple(DeviceSample(g, u, 80 * GB, 80 * GB - u) for g, u in zip(gpus, used)) \
            if nvml_up else ()
        alive = {100 + i: True for i in range(8)}
        alive[107] = k < 2000
        if k >= 2050:
            alive[200] = True
        procs = tuple(ProcessSample(pid, up, 3 * GB + k * 4096 if up else None,
                                    {gpus[7 if pid == 200 else pid - 100]:
                                     used[7 if pid == 200 else pid - 100] - GB} if up else {})
                      for pid, up in sorted(alive.items()))
        out.append(Sample(t=t, devices=devices, processes=procs, nvml_up=nvml_up,
                          host_total_bytes=512 * GB, host_available_bytes=400 * GB - k))
    return out


def test_a_big_host_with_changing_memory_decides_the_same_with_repeats(repeats):
    # the still GPUs' servers repeat; the moving ones do not
    full = assert_repeats_decide_alike(repeats, eight_by_eight_trace(), 5000)
    decided = {(a["action"], a["server"]) for x in full if isinstance(x, list) for a in x}
    assert {("reload", "replica-1"), ("execute", "replica-1"),
            ("restart", "replica-7")} <= decided


def time_alone_trace() -> tuple[list, Config]:
    """Two servers whose memory stands still while what time alone changes comes due: the
    warm-up's end, a recompile storm leaving its window, a memory step no longer pending (now
    unexplained growth), the recordings' MB/graph gaining confidence with every still poll,
    the request rate's window emptying (b's discovery forecast: its sizes would fill its GPU
    at that rate), a wobble leaving the window, a pause in the polls."""
    cfg = dataclasses.replace(
        CFG, correlate=dataclasses.replace(CFG.correlate, storm_window_s=20.0,
                                           storm_recompiles=3),
        policy=dataclasses.replace(CFG.policy, warmup_s=15.0))
    out, t = [], 1000.0
    used = {"GPU-a": 20 * GB, "GPU-b": 80 * GB - 100 * MB}  # b: its recordings will fill it
    out += [hello(t, 11, "a", ["GPU-a"]), hello(t, 22, "b", ["GPU-b"])]
    for k in range(2200):
        t += 0.1
        if k == 5:
            out.append(compile_event(t, 11))    # the warm-up ends 15 s on, while still
        if k in (300, 301, 302):                # a storm, leaving its window while still
            out.append(events.Recompile(t=t, pid=11, compile_id="0/1", function="f",
                                        seconds=0.1, reason="size"))
        if k == 700:
            used["GPU-a"] += GB                 # a step: pending for 60 s, then unexplained
        if 100 <= k < 140:                      # b: noisy recordings, confidence below 0.5
            out.append(events.CudagraphRecord(t=t, pid=22, phase="record", compile_id="0/0",
                                              key=[k], shape=[[1, k]], seconds=0.01))
            used["GPU-b"] += 10 * MB if k % 2 else -6 * MB
        if k % 10 == 0 and k < 1000:            # requests, then none: the rate's window empties
            out.append(calls(t, 11, 40, 5))
            out.append(calls(t, 22, 1, 40))         # b's: its discovery forecast's rate
        if 100 <= k < 140:                      # b's sizes: most of them new, far from all seen
            out.append(events.NewShape(t=t, pid=22, name="m", shape=[[1, k]], seconds=0.01,
                                       distinct=k - 99))
        if k in (1400, 1405):                   # a wobble that returns: growth 0.0 over the
            used["GPU-a"] += 2 * MB if k == 1400 else -2 * MB  # window until it half leaves
        if k == 1600:
            t += 50.0                           # the sidecar paused: a thin window after
        devices = tuple(DeviceSample(u, b, 80 * GB, 80 * GB - b) for u, b in used.items())
        procs = (ProcessSample(11, True, 2 * GB, {"GPU-a": used["GPU-a"] - GB}),
                 ProcessSample(22, True, 2 * GB, {"GPU-b": used["GPU-b"] - GB}))
        out.append(Sample(t=t, devices=devices, processes=procs, host_total_bytes=128 * GB,
                          host_available_bytes=100 * GB))
    return out, cfg


def test_still_polls_see_what_time_alone_changes(repeats):
    trace, cfg = time_alone_trace()
    full = observe(Host(repeats=False), trace, cfg)
    fast = observe(Host(), trace, cfg)
    assert repeats[1] > 1500
    assert fast == full
    alerted = {(a["server"], a["reason"]) for x in full if isinstance(x, list) for a in x}
    assert {("a", "recompile_storm"), ("a", "memory_growth_unexplained"),
            ("b", "cudagraph_per_shape")} <= alerted
    storm = [x["a"][2] for x in full if isinstance(x, dict) and "a" in x]
    assert any("recompile_storm" in f for f in storm) and "recompile_storm" not in storm[-1]


@pytest.mark.parametrize("dry_run", [False, True])
def test_still_polls_start_holding_when_the_warm_up_ends(repeats, dry_run):
    """A server over its configured budget from the start, its memory still: the forecast
    (an OOM now) is the same every poll, and only the warm-up's end lets the policy alert,
    hold the condition for `hold_polls` polls and reload (dry run: and hold it again, each
    poll, through the cooldown)."""
    cfg = dataclasses.replace(
        CFG, policy=dataclasses.replace(CFG.policy, warmup_s=15.0, dry_run=dry_run),
        forecast=dataclasses.replace(CFG.forecast, process_budget_bytes=40 * GB))
    trace, t = [hello(1000.0, 33, "c", ["GPU-c"])], 1000.0
    for k in range(400):
        t += 0.1
        if k == 5:
            trace.append(compile_event(t, 33))
        trace.append(Sample(t=t, devices=(DeviceSample("GPU-c", 60 * GB, 80 * GB, 20 * GB),),
                            processes=(ProcessSample(33, True, GB, {"GPU-c": 50 * GB}),)))
    full = observe(Host(repeats=False), trace, cfg)
    fast = observe(Host(), trace, cfg)
    assert repeats[1] > 50  # still through the warm-up
    assert fast == full
    decided = [(a["action"], a["reason"]) for x in full if isinstance(x, list) for a in x]
    assert ("alert", "oom_forecast") in decided and ("reload", "oom_forecast") in decided
