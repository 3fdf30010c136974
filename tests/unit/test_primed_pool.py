"""torch 2.15's primed graph pool (`cudagraph_initial_mempool_allocation_gb`): NVML jumps by the
whole block at the first recording and then stays flat while graphs fill it. The agent's
heartbeats carry the private pools' reserved and in-use bytes (agent/pools.py); the sidecar
takes the block's unused bytes off the process's NVML memory, so the forecast sees the growth
it would see unprimed."""
from __future__ import annotations

from tests.unit.test_step import CFG, GB, MB, Host2
from torch_watchdog import events
from torch_watchdog.agent.pools import pool_bytes

BLOCK = 2 * GB
STEP = 4 * MB          # a graph per poll, 4 MB each


def heartbeat(t, pid, reserved=None, active=None):
    return events.Heartbeat(t=t, pid=pid, seq=1, uptime_s=t, queue_depth=0, errors=0, lost=0,
                            pool_reserved_bytes=reserved, pool_active_bytes=active)


def run(primed: bool, told: bool = True, polls: int = 2000):
    """(the first reload decision's t, the forecast's seconds at each poll) of a server
    recording a graph a poll; heartbeats every 2 s (8 polls), as the agent sends them."""
    h = Host2(CFG)
    for _ in range(10):
        h.poll()
    used = 0
    seconds = {}
    for i in range(polls):
        used += STEP
        h.feed(events.CudagraphRecord(t=h.t, pid=101, phase="record", compile_id="0/1",
                                      key=[i], shape=None, seconds=0.01))
        if primed:
            h.mine[101] = 2 * GB + max(BLOCK, used)     # NVML: the block, once it is taken
            if i % 8 == 0:
                h.feed(heartbeat(h.t, 101, *((BLOCK if used <= BLOCK else used, used)
                                             if told else (None, None))))
            h.poll()
        else:
            h.poll(grow_a=STEP)
        seconds[round(h.t, 2)] = h.host.servers["replica-a"].forecast.seconds
        if h.of("reload"):
            return h.of("reload")[0].t, seconds
    return None, seconds


def test_a_primed_pool_is_forecast_as_the_same_growth_unprimed():
    plain_t, plain = run(primed=False)
    primed_t, primed = run(primed=True)
    assert plain_t is not None and primed_t is not None
    assert abs(primed_t - plain_t) <= 3.0, (plain_t, primed_t)   # the heartbeats' 2 s apart
    t = plain_t - 30.0   # half a minute before: the shown numbers within 25 % of each other
    assert abs(primed[t] / plain[t] - 1) < 0.25, (primed[t], plain[t])


def test_without_the_pools_bytes_nvml_alone_is_blind_to_the_growth_inside_the_block():
    decided, seconds = run(primed=True, told=False, polls=400)   # 1.6 GB of the 2 GB block
    assert decided is None and min(seconds.values()) > 600


def test_pool_bytes_sum_the_private_pools_segments_and_their_blocks_in_use():
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 100, "blocks": [
            {"size": 100, "state": "active_allocated"}]},
        {"segment_pool_id": (1, 3), "total_size": BLOCK, "blocks": [
            {"size": 64 * MB, "state": "active_allocated"},
            {"size": 32 * MB, "state": "inactive"},
            {"size": BLOCK - 96 * MB, "state": "inactive"}]},
        {"segment_pool_id": [1, 4], "total_size": 20 * MB, "blocks": [
            {"size": 20 * MB, "state": "active_allocated"}]},
    ]
    assert pool_bytes(segments) == (BLOCK + 20 * MB, 84 * MB)
    assert pool_bytes(segments[:1]) == (None, None)   # no private pool: nothing said


def test_a_stale_or_malformed_pool_report_changes_nothing():
    h = Host2(CFG)
    h.mine[101] = 2 * GB + BLOCK
    h.feed(heartbeat(h.t, 101, 10 * MB, 20 * MB))    # in use above reserved: ignored
    h.poll()
    server = h.host.servers["replica-a"]
    assert not server.state.pool_slack

    def memory():
        return server.state.estimates(CFG.correlate)["memory_bytes"]

    level = memory()
    h.feed(heartbeat(h.t, 101, BLOCK, 0))
    h.poll()
    assert memory() == level - BLOCK   # the block's unused bytes taken off
    for _ in range(45):                # 11.25 s: past POOL_SLACK_S
        h.poll()
    assert memory() == level


def test_the_agent_reads_the_pool_only_where_it_is_primed_and_cuda_is_up():
    from types import SimpleNamespace as NS

    from torch_watchdog.agent.pools import primed_pool_bytes

    asked = []

    def fake(gb, up, snapshot=lambda: asked.append(1) or []):
        triton = NS(cudagraph_initial_mempool_allocation_gb=gb)
        return NS(_inductor=NS(config=NS(triton=triton)),
                  cuda=NS(is_initialized=lambda: up, memory_snapshot=snapshot))

    assert primed_pool_bytes(fake(None, True)) == (None, None) and not asked   # not primed
    assert primed_pool_bytes(fake(8.0, False)) == (None, None) and not asked   # no CUDA yet
    assert primed_pool_bytes(fake(8.0, True)) == (None, None) and asked == [1]

    def broken():
        raise RuntimeError("snapshot failed")

    assert primed_pool_bytes(fake(8.0, True, broken)) == (None, None)   # never raises
    assert primed_pool_bytes(NS()) == (None, None)


def test_pool_reports_of_many_short_lived_workers_stay_bounded():
    from torch_watchdog.sidecar.core.correlate import MAX_POOL_PIDS, State, apply

    state = State()
    for pid in range(10 * MAX_POOL_PIDS):
        apply(state, heartbeat(float(pid), pid, BLOCK, 0), CFG.correlate)
    assert len(state.pool_slack) <= MAX_POOL_PIDS
    assert 10 * MAX_POOL_PIDS - 1 in state.pool_slack      # the latest kept
