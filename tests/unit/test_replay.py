"""Acceptance of the pipeline on real recorded traces (tests/fixtures, copied from GPU runs).
`torch-watchdog replay` as a process: tests/integration/test_replay_cli.py."""
import gzip
import json
import os

import pytest

from torch_watchdog.sidecar.config import Config, PolicyConfig
from torch_watchdog.sidecar.offline.replay import replay

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
ROOT = os.path.dirname(os.path.dirname(FIX))


def fixture(name: str) -> str:
    return os.path.join(FIX, name)


@pytest.fixture(scope="module")
def seq_default():
    return replay([fixture("h200-torch2.11-seq-default.jsonl.gz")], Config())


def test_seq_default_finds_cudagraph_per_shape_at_the_measured_cost(seq_default):
    causes = [f["cause"] for f in seq_default["findings"]]
    assert "cudagraph_per_shape" in causes
    est = seq_default["estimates"]
    assert est["mb_per_graph"] == pytest.approx(0.468, rel=0.10)  # measured on this model
    assert est["mb_per_graph_confidence"] >= 0.8
    assert est["recordings"] == 939 and est["distinct_shapes"] == 1604
    # seq_len is uniform in 32..2048: 2,017 sizes; the plateau is far below an H200
    assert est["shape_space_estimate"] == pytest.approx(2017, rel=0.1)
    assert est["will_oom"] is False
    assert not [a for a in seq_default["actions"] if a["action"] == "reload"]


def test_seq_static_finds_the_eager_fallback_after_eight_compiles():
    r = replay([fixture("h200-torch2.11-seq-static.jsonl.gz")], Config())
    (fallback,) = [f for f in r["findings"] if f["cause"] == "recompile_limit_eager_fallback"]
    assert fallback["limit"] == 8 and r["estimates"]["compiles"] + r["estimates"]["recompiles"] == 8
    assert 80.2 < fallback["t"] < 82  # the 8th compile ended at 80.25 s; new shapes then ran eager
    assert "recompile_storm" in [f["cause"] for f in r["findings"]]
    assert "cudagraph_per_shape" not in [f["cause"] for f in r["findings"]]
    assert not [a for a in r["actions"] if a["action"] == "reload"]


def test_bucketed_control_finds_nothing_and_decides_nothing():
    r = replay([fixture("h200-bucketed.jsonl.gz")], Config())
    assert r["findings"] == [] and r["actions"] == []
    assert r["estimates"]["recordings"] == 9


def test_oom_trace_reloads_well_before_the_crash():
    r = replay([fixture("h200-oom300.jsonl.gz")], Config())
    crash = 123.02  # the process died here with cudaErrorMemoryAllocation (fixtures/README.md)
    reloads = [a for a in r["actions"] if a["action"] == "reload"]
    assert reloads, r["actions"]
    assert 20 <= crash - reloads[0]["t"] <= 90
    # decided while warming up: an OOM due before the warm-up's end plus the lead
    policy = Config().policy
    assert reloads[0]["seconds_to_oom"] <= policy.reload_lead_s + policy.warmup_s
    assert r["estimates"]["will_oom"] is True
    assert "cudagraph_per_shape" in [f["cause"] for f in r["findings"]]


def test_the_sidecars_own_log_of_a_real_oom_reloads_well_before_the_crash():
    """The sidecar's sample log of the GPU seed scenario (dry run: it decided, the server ran
    on into the OOM). Replayed with the default config, the reload comes >= 10 s early."""
    result = replay([fixture("h200-seed-oom-samples.jsonl.gz")], Config())
    (reload,) = [a for a in result["actions"] if a["action"] == "reload"]
    ooms = [json.loads(line) for line in _lines("h200-seed-oom-samples.jsonl.gz")
            if '"kind":"oom"' in line]
    crash = ooms[0]["t"]
    assert crash - reload["t"] >= 50  # 58.3 s measured live
    assert "cudagraph_per_shape" in [f["cause"] for f in result["findings"]]
    assert result["estimates"]["ooms"] == 1


def test_the_sidecars_own_log_of_bucketed_traffic_decides_nothing():
    result = replay([fixture("h200-seed-bucketed-samples.jsonl.gz")], Config())
    assert result["findings"] == [] and result["actions"] == []
    # its process is gone by the log's end: a dead server has no forecast
    assert result["estimates"]["will_oom"] is None and result["estimates"]["recordings"] == 9


def _lines(name: str) -> list[str]:
    with gzip.open(fixture(name), "rt") as fh:
        return list(fh)


def test_a_warm_up_longer_than_the_run_does_not_hold_back_the_reload():
    # the OOM comes before the warm-up's end: waiting for it would crash the server, so the
    # reload is decided no later than with the default warm-up
    def first_reload(cfg: Config) -> float:
        r = replay([fixture("h200-oom300.jsonl.gz")], cfg)
        return next(a["t"] for a in r["actions"] if a["action"] == "reload")

    assert first_reload(Config(policy=PolicyConfig(warmup_s=500))) <= first_reload(Config())


def test_replay_merges_the_agent_event_log_with_its_trace():
    r = replay([fixture("h200-oom300.jsonl.gz"), fixture("h200-oom300-events.jsonl.gz")],
               Config())
    est = r["estimates"]
    assert est["warmups"] == 1056  # only the agent's log has warm-ups
    assert r["replay"]["bad_lines"] == 0


def test_garbage_lines_are_counted_not_fatal(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"kind": "nvml", "used": 1, "total": 10, "proc": null, "t": 1.0}\n'
                    "not json\n{\"v\": 1, \"kind\": \"nope\"}\n[1]\n"
                    '{"kind": "req", "shape": "x", "ms": 1, "t": 2.0}\n')
    r = replay([str(path)], Config())
    assert r["replay"]["bad_lines"] == 4 and r["replay"]["observations"] == 1


def _text(capsys, *paths: str) -> dict[str, list[tuple[float, str, str]]]:
    """Server -> its rows (t, what, why) of `replay`'s readable output: its decisions (what:
    the action) and its alerts (what: "alert", why: the cause and its numbers)."""
    from torch_watchdog import cli

    assert cli.main(["replay", *paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# ") and "times in seconds from its start" in out[0]
    servers: dict[str, list[tuple[float, str, str]]] = {}
    section = ""
    for line in out[1:]:
        if line.startswith("server "):
            rows = servers[line[len("server "):]] = []
        elif not line.startswith("    "):
            section = line.split(":")[0].strip()
        elif line.startswith("    +"):
            t, rest = line.strip()[1:].split(" s  ", 1)
            what, why = rest.split(": ", 1) if section == "decided" else ("alert", rest)
            rows.append((float(t), what, why))
    return servers


def _text_rows(capsys, *paths: str) -> list[tuple[float, str, str]]:
    (rows,) = _text(capsys, *paths).values()
    return rows


def test_text_output_says_per_server_what_was_decided_when_and_why(capsys):
    """Two replicas on two GPUs: each server's block holds its own decisions and alerts (the
    growing one's reload, carried out, back), the other's says nothing was decided; --json
    keeps the machine form, with the same actions."""
    path = fixture("h200x2-two-replicas-samples.jsonl.gz")
    servers = _text(capsys, path)
    assert sorted(servers) == ["replica-a", "replica-b"]
    a = servers["replica-a"]
    assert [what for _, what, _ in a if what != "alert"] == ["reload", "execute", "reload_ok"]
    reload_why = next(why for _, what, why in a if what == "reload")
    assert reload_why.startswith("cause cudagraph_per_shape, OOM forecast in ")
    assert {why.split(":")[0] for _, what, why in a if what == "alert"} == {
        "oom_forecast", "cudagraph_per_shape"}
    assert servers["replica-b"] == []
    from torch_watchdog import cli

    assert cli.main(["replay", "--json", path]) == 0
    result = json.loads(capsys.readouterr().out)
    first = result["replay"]["first_t"]["epoch"]
    assert [(round(a["t"] - first, 1), a["action"]) for a in result["actions"]
            if a["action"] != "alert"] == [(t, what) for t, what, _ in servers["replica-a"]
                                           if what != "alert"]


def test_text_output_counts_from_the_start_of_the_trace(capsys):
    """The reload of h200-oom300 comes 59.1 s into the recording (the crash at 123.0 s), as
    --json and the report say; not +0.0 s (the time of the first finding, as it was)."""
    rows = _text_rows(capsys, fixture("h200-oom300.jsonl.gz"))
    (reload,) = [t for t, what, _ in rows if what == "reload"]
    assert 59 < reload < 60
    assert min(t for t, *_ in rows) > 40  # the first alert is no "+0.0s"
    result = replay([fixture("h200-oom300.jsonl.gz")], Config())
    assert reload == pytest.approx(
        next(a["t"] for a in result["actions"] if a["action"] == "reload"), abs=0.05)


def test_text_output_of_an_epoch_log_counts_from_its_first_line(capsys):
    """The sidecar's sample log has wall-clock times: counted from its first line."""
    rows = _text_rows(capsys, fixture("h200-seed-oom-samples.jsonl.gz"))
    (reload,) = [t for t, what, _ in rows if what == "reload"]
    first = json.loads(_lines("h200-seed-oom-samples.jsonl.gz")[0])["t"]
    result = replay([fixture("h200-seed-oom-samples.jsonl.gz")], Config())
    expected = next(a["t"] for a in result["actions"] if a["action"] == "reload") - first
    assert 30 < reload < 119 and reload == pytest.approx(expected, abs=0.05)


def test_a_file_of_nothing_usable_is_refused_naming_it(tmp_path):
    from torch_watchdog.jsonl import InputError

    path = tmp_path / "notes.jsonl"
    path.write_text("hello\n{\"a\": 1}\n")
    with pytest.raises(InputError, match="notes.jsonl: nothing usable.*line 1: not JSON"):
        replay([str(path)], Config())


def test_trace_kinds_replay_has_no_use_for_are_not_bad_lines():
    r = replay([fixture("h200-oom300.jsonl.gz")], Config())
    assert r["replay"]["bad_lines"] == 0  # its `ballast` line is known, not garbage


def test_two_replicas_on_two_gpus_replay_reloads_only_the_growing_one_as_live():
    """The sidecar's sample log of the two-GPU run (tests/gpu/test_gpu_host.py): replica-a
    (variable seq_len, GPU 0) was reloaded, replica-b (bucketed, GPU 1) never touched. The
    replay acts on the same server, pids and GPU; its forecast, reading the recent growth,
    decides 5.2 s before the live sidecar of its day did."""
    r = replay([fixture("h200x2-two-replicas-samples.jsonl.gz")], Config())
    gpu0 = "GPU-045eeb97-b7f7-321a-48ee-7b1f8855995a"
    acted = [(a["t"], a["action"]) for a in r["actions"] if a["action"] != "alert"]
    assert [what for _, what in acted] == ["reload", "execute", "reload_ok"]
    assert acted[0][0] <= 1796055006.342  # the live decision, to the poll
    assert acted[-1][0] == 1796055009.042  # the recorded outcome: back
    assert {(a["server"], tuple(a["pids"]), tuple(a["gpus"])) for a in r["actions"]} == {
        ("replica-a", (708,), (gpu0,))}
    assert sorted(r["servers"]) == ["replica-a", "replica-b"]
    assert r["servers"]["replica-b"]["seconds_to_oom"] is None


def test_a_leak_under_bucketed_traffic_replays_to_a_reload_75_s_before_the_oom():
    """The dry run of the leak (6 MiB/s kept alive by the server's code, 9 buckets): decided
    as memory_growth_unexplained; the server's OOM came 75 s later (the agent's oom event)."""
    r = replay([fixture("h200-leak-bucketed-samples.jsonl.gz")], Config())
    (decided,) = [a for a in r["actions"] if a["action"] == "reload"]
    assert decided["cause"] == "memory_growth_unexplained" and decided["dry_run"] is True
    oom = 1796055187.158  # the agent's `oom` event (allocator) in the same log
    assert 60 <= oom - decided["t"] <= 90
    assert list(r["servers"]) == [decided["server"]]  # no phantom server


def test_the_length_of_a_recording_counts_from_its_first_line_to_its_last():
    """Not from the focus server's last reset: a 215 s sample log is 215 s of recording."""
    path = os.path.join(ROOT, "tests", "fixtures", "corpus", "leak-medium.jsonl.gz")
    with gzip.open(path, "rt") as fh:
        times = [json.loads(line)["t"] for line in fh]
    r = replay([path], Config())
    assert r["replay"]["trace_seconds"] == pytest.approx(max(times) - min(times), abs=0.2)


def test_events_two_files_both_hold_are_counted_once(tmp_path):
    """A sample log keeps every event the sidecar received, and the agent's own log has them
    all: given both (or a copy twice), each event counts once."""
    import shutil

    agent_log = fixture("h200-oom300-events.jsonl.gz")
    twin = str(tmp_path / "twin.jsonl.gz")
    shutil.copy(agent_log, twin)
    once = replay([fixture("h200-oom300.jsonl.gz"), agent_log], Config())["estimates"]
    twice = replay([fixture("h200-oom300.jsonl.gz"), agent_log, twin], Config())["estimates"]
    assert once["warmups"] == 1056 and twice == once


def test_an_agent_log_cut_before_its_hello_is_that_agent_but_a_sidecar_log_is_as_received(
        tmp_path):
    """A rotated agent event log lacks the hello (in <event_log>.1): its pid's events are still
    that agent's server. In the sidecar's own log, events before a hello stay held, as live."""
    from torch_watchdog import events as ev
    from torch_watchdog.sidecar.offline.traces import Reader
    recompiles = [ev.Recompile(t=1.8e9 + i, pid=9, compile_id=f"0/{i}", function="forward",
                               seconds=6.0, reason="size mismatch") for i in range(1, 4)]
    lines = "".join(ev.encode(e).decode() + "\n" for e in recompiles)
    agent_log = tmp_path / "events.jsonl"
    agent_log.write_text(lines)
    seen = list(Reader(str(agent_log)))
    assert [type(o).__name__ for o in seen] == ["Hello", "Recompile", "Recompile", "Recompile"]
    assert seen[0].pid == 9 and seen[0].agent == "event log without a hello"
    sidecar_log = tmp_path / "samples.jsonl"
    sidecar_log.write_text('{"kind":"config","t":1.8e9,"config":{}}\n' + lines)
    assert [type(o).__name__ for o in Reader(str(sidecar_log))][1:] == ["Recompile"] * 3
