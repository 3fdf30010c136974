"""Process source against this process, pidfiles, a fake systemctl, recorded smaps_rollup
reads and a fake clock. Against child processes started for it:
tests/integration/test_process_real.py."""
from __future__ import annotations

import os
import subprocess

from tests.fakes import Clock
from torch_watchdog.sidecar.sources.process import read_pidfile, read_processes, unit_main_pid


def test_own_process_is_alive_with_rss_and_gpu_bytes_attached():
    me = os.getpid()
    (sample,) = read_processes({me}, {me: {"GPU-0": 5}, 1: {"GPU-0": 7}})
    assert sample.pid == me and sample.alive
    assert sample.rss_bytes is not None and sample.rss_bytes > 1 << 20
    assert sample.gpu_bytes == {"GPU-0": 5}


def test_nonsense_pids_are_dead_not_errors():
    assert [(s.pid, s.alive) for s in read_processes({0, -5})] == [(-5, False), (0, False)]


def test_pidfile_with_garbage_missing_or_zero_is_none(tmp_path):
    garbage = tmp_path / "garbage.pid"
    garbage.write_bytes(b"\xff\xfenot a pid\n")
    words = tmp_path / "words.pid"
    words.write_text("server running\n")
    zero = tmp_path / "zero.pid"
    zero.write_text("0\n")
    for path in (garbage, words, zero, tmp_path / "missing.pid", tmp_path):
        assert read_pidfile(str(path)) is None


def test_pidfile_with_a_valid_pid(tmp_path):
    path = tmp_path / "server.pid"
    path.write_text(f"{os.getpid()}\n")
    assert read_pidfile(str(path)) == os.getpid()


def fake_run(stdout="", returncode=0, raises=None):
    seen = []

    def run(args, **kwargs):
        seen.append((args, kwargs))
        if raises is not None:
            raise raises
        return subprocess.CompletedProcess(args, returncode, stdout=stdout, stderr="")

    return run, seen


def test_unit_main_pid_reads_systemctl():
    run, seen = fake_run("1234\n")
    assert unit_main_pid("inference.service", run=run) == 1234
    args, kwargs = seen[0]
    assert args == ["systemctl", "show", "-p", "MainPID", "--value", "inference.service"]
    assert kwargs["timeout"] == 5


def test_unit_main_pid_is_none_when_inactive_failed_or_missing():
    cases = [fake_run("0\n"), fake_run("", returncode=1), fake_run("garbage\n"),
             fake_run(raises=FileNotFoundError("systemctl")),
             fake_run(raises=subprocess.TimeoutExpired("systemctl", 5))]
    for run, _ in cases:
        assert unit_main_pid("inference.service", run=run) is None


def test_host_memory_matches_psutil():
    import psutil

    from torch_watchdog.sidecar.sources.process import read_host_memory
    total, available = read_host_memory()
    vm = psutil.virtual_memory()
    assert total == vm.total
    assert abs(available - vm.available) < 256 << 20  # read a moment apart


def test_host_memory_without_meminfo_falls_back_to_psutil(tmp_path):
    import psutil

    from torch_watchdog.sidecar.sources.process import read_host_memory
    assert read_host_memory(str(tmp_path / "absent"))[0] == psutil.virtual_memory().total


def test_a_units_processes_are_its_cgroups(tmp_path):
    from torch_watchdog.sidecar.sources.process import unit_pids
    unit = tmp_path / "system.slice" / "inference.service"
    (unit / "worker").mkdir(parents=True)  # Delegate=yes: a sub-cgroup of the unit's own
    (unit / "cgroup.procs").write_text("100\n101\n")
    (unit / "worker" / "cgroup.procs").write_text("205\n")
    run, seen = fake_run("/system.slice/inference.service\n")
    assert unit_pids("inference.service", run=run, roots=(str(tmp_path),)) == (100, 101, 205)
    assert seen[0][0] == ["systemctl", "show", "-p", "ControlGroup", "--value",
                          "inference.service"]
    # no cgroup tree here, an inactive unit, a path out of the tree, no systemctl: fall back
    for run, _ in (fake_run("/system.slice/other.service\n"), fake_run("\n"),
                   fake_run("/system.slice/../../etc\n"), fake_run(raises=FileNotFoundError())):
        assert unit_pids("inference.service", run=run, roots=(str(tmp_path),)) is None


def test_a_cgroup_memory_limit_is_the_lowest_of_its_and_its_ancestors(tmp_path):
    from torch_watchdog.sidecar.sources.process import read_cgroup_limit
    with open("/proc/self/cgroup") as fh:
        fields = [ln.split(":", 2) for ln in fh.read().splitlines() if ln.count(":") >= 2]
    v1 = next((f[2] for f in fields if "memory" in f[1].split(",")), None)
    path, name, base = (v1, "memory.limit_in_bytes", tmp_path / "memory") if v1 is not None \
        else (next(f[2] for f in fields if f[0] == "0"), "memory.max", tmp_path)
    unlimited = "9223372036854771712" if v1 is not None else "max"
    here = base.joinpath(*[p for p in path.split("/") if p])
    here.mkdir(parents=True, exist_ok=True)
    assert read_cgroup_limit(os.getpid(), str(tmp_path)) is None  # no file: no limit
    (here / name).write_text(unlimited + "\n")
    assert read_cgroup_limit(os.getpid(), str(tmp_path)) is None
    if here != base:  # an ancestor's limit holds the process too (a container's)
        (base / name).write_text(f"{3 << 30}\n")
        assert read_cgroup_limit(os.getpid(), str(tmp_path)) == 3 << 30
    (here / name).write_text(f"{1 << 30}\n")
    assert read_cgroup_limit(os.getpid(), str(tmp_path)) == 1 << 30
    assert read_cgroup_limit(2 ** 22 + 12345, str(tmp_path)) is None  # no such process


def _anon(pss):
    """A smaps_rollup read whose PSS is all anonymous pages (taken as read); None: unreadable."""
    from torch_watchdog.sidecar.sources.process import PssParts
    return None if pss is None else PssParts(anon=pss, mapped=0, resident=0)


def test_pss_is_read_now_and_then_and_carried_by_rss():
    from torch_watchdog.sidecar.sources.process import PssMeter, read_pss
    from torch_watchdog.sidecar.core.observations import ProcessSample
    clock, reads = Clock(0.0), []

    def read(pid):
        reads.append(pid)
        return _anon({11: 300, 12: 200}.get(pid))

    meter = PssMeter(every_s=10.0, read=read, clock=clock)
    out = meter.apply((ProcessSample(11, True, 1000), ProcessSample(12, True, 900),
                       ProcessSample(13, True, 500), ProcessSample(14, False, None)))
    assert [p.host_bytes for p in out] == [300, 200, 500, None]  # 13: no PSS, its RSS
    clock.t = 5.0  # 11 grew 50 bytes: its PSS grows as much, no new read (13's failed: again)
    out = meter.apply((ProcessSample(11, True, 1050), ProcessSample(12, True, 900),
                       ProcessSample(13, True, 500)))
    assert [p.pss_bytes for p in out] == [350, 200, None] and reads == [11, 12, 13, 13]
    clock.t = 10.0
    meter.apply((ProcessSample(11, True, 1050),))
    assert reads[-1] == 11 and 12 not in meter.last  # 12 is gone: forgotten
    # this process's own: a real smaps_rollup, below its RSS or equal
    import os

    import psutil
    pss = read_pss(os.getpid())
    assert pss is None or 0 < pss <= psutil.Process().memory_info().rss * 1.01


def test_every_pss_is_read_again_when_a_process_comes_or_goes():
    """A fork shares its parent's pages: the parent's PSS falls at once (a preloaded master
    and 2 workers: carried, the server read high until the master's next read)."""
    from torch_watchdog.sidecar.sources.process import PssMeter
    from torch_watchdog.sidecar.core.observations import ProcessSample
    clock, pss, reads = Clock(0.0), {1: 900}, []

    def read(pid):
        reads.append(pid)
        return _anon(pss[pid])

    meter = PssMeter(every_s=10.0, read=read, clock=clock)
    master = ProcessSample(1, True, 1000)
    assert meter.apply((master,))[0].pss_bytes == 900
    clock.t, pss[1], pss[2], pss[3] = 1.0, 300, 310, 320  # two workers forked
    out = meter.apply((master, ProcessSample(2, True, 1000), ProcessSample(3, True, 1000)))
    assert [p.pss_bytes for p in out] == [300, 310, 320] and reads == [1, 1, 2, 3]
    clock.t, pss[1], pss[2] = 2.0, 450, 460  # a worker exited: the others' shares grow
    out = meter.apply((master, ProcessSample(2, True, 1000)))
    assert [p.pss_bytes for p in out] == [450, 460] and reads[4:] == [1, 2]
    clock.t = 3.0  # the same processes: carried, not read
    assert meter.apply((master, ProcessSample(2, True, 1000)))[1].pss_bytes == 460
    assert len(reads) == 6


def test_pss_of_the_same_processes_is_the_same_answer_until_a_read_is_due():
    from torch_watchdog.sidecar.sources.process import PssMeter
    from torch_watchdog.sidecar.core.observations import ProcessSample
    clock, reads, pss = Clock(0.0), [], {11: 300, 12: None}

    def read(pid):
        reads.append(pid)
        return _anon(pss[pid])

    meter = PssMeter(every_s=10.0, read=read, clock=clock)
    procs = (ProcessSample(11, True, 1000), ProcessSample(13, False, None))
    first = meter.apply(procs)
    clock.t = 9.9
    assert meter.apply(procs) is first and reads == [11]  # the reader's same tuple: kept
    assert meter.apply((ProcessSample(11, True, 1100),))[0].pss_bytes == 400  # others: new
    kept = meter.apply(procs)
    assert kept == first and kept is not first and reads == [11]
    assert meter.apply(procs) is kept
    clock.t = 10.0  # a read is due: the same tuple is read again
    pss[11] = 500
    again = meter.apply(procs)
    assert reads == [11, 11] and again[0].pss_bytes == 500
    # a failed read is tried again at the next call, same processes or not
    failing = (ProcessSample(12, True, 700),)
    assert meter.apply(failing)[0].pss_bytes is None and reads[-1] == 12
    pss[12] = 650
    assert meter.apply(failing)[0].pss_bytes == 650 and reads == [11, 11, 12, 12]


def test_a_mapped_share_that_grows_is_held_one_that_falls_is_taken():
    """Anonymous pages' share is taken as read; file and shared-memory pages' is held where it
    grew with the same pages mapped (the host's other processes exited), and taken where it
    fell; pages mapped since count whole, pages dropped at their held share."""
    from torch_watchdog.sidecar.core.observations import ProcessSample
    from torch_watchdog.sidecar.sources.process import PssMeter, PssParts
    clock, parts = Clock(0.0), {1: PssParts(anon=500, mapped=100, resident=400, started=7)}
    meter = PssMeter(every_s=10.0, read=parts.get, clock=clock)

    def reading(rss=1000, pids=(1,)):
        clock.advance(10.0)  # a read is due
        return [p.pss_bytes for p in meter.apply(tuple(ProcessSample(pid, True, rss)
                                                       for pid in pids))]

    assert reading() == [600]
    parts[1] = PssParts(500, 200, 400, 7)  # the same pages, a larger share: neighbours exited
    assert reading() == [600]
    parts[1] = PssParts(800, 200, 400, 7)  # its own anonymous memory grew: counted
    assert reading(rss=1300) == [900]
    parts[1] = PssParts(800, 50, 400, 7)   # another process maps its files: the share falls
    assert reading(rss=1300) == [850]
    parts[1] = PssParts(800, 250, 600, 7)  # 200 mapped since (weights): whole, as read less
    assert reading(rss=1500) == [1050]     # (50 + 200, the read says 250)
    parts[1] = PssParts(800, 180, 300, 7)  # half its mapped pages dropped: half its share
    assert reading(rss=1200) == [925]
    parts[1] = PssParts(800, 900, 300, 8)  # the pid is another process's now: as read
    assert reading(rss=1200) == [1700]
    parts[2] = PssParts(10, 20, 30, 1)     # a process came: every one read again, held too
    parts[1] = PssParts(800, 950, 300, 8)
    assert reading(pids=(1, 2)) == [1700, 30]


def _recorded_neighbours():
    """benchmarks/pss_neighbours.py --record: an idle server's 3 processes (a master that
    imported torch and 2 forked workers), per step, as 3 neighbour servers stop, then the
    master allocates 200 MiB: [(step, [(rss, smaps_rollup text) per process])]."""
    import json
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "fixtures" / "smaps_rollup_neighbours.json"
    return [(step, [(p["rss"], p["smaps_rollup"].encode()) for p in procs])
            for step, procs in json.loads(path.read_text()).items()]


def _meter_recorded(meter_every_s=10.0, poll_s=1.0, polls_per_step=60, plain=False):
    """Each recorded step held for `polls_per_step` polls of the server's processes through a
    PssMeter reading the recorded texts: [(t, the server's metered bytes)]. `plain`: the
    meter before issue 50 (the whole PSS taken as read)."""
    from torch_watchdog.sidecar.core.observations import ProcessSample
    from torch_watchdog.sidecar.sources.process import PssMeter, PssParts, parse_smaps_rollup
    clock, texts = Clock(0.0), {}

    def read(pid):
        parts = parse_smaps_rollup(texts[pid])
        return PssParts(parts.anon + parts.mapped, 0, 0) if plain and parts else parts

    meter, out = PssMeter(every_s=meter_every_s, read=read, clock=clock), []
    for _, procs in _recorded_neighbours():
        texts = {pid: text for pid, (_, text) in enumerate(procs, start=100)}
        samples = tuple(ProcessSample(pid, True, rss)
                        for pid, (rss, _) in enumerate(procs, start=100))
        for _ in range(polls_per_step):
            out.append((clock(), sum(p.host_bytes for p in meter.apply(samples))))
            clock.advance(poll_s)
    return out


def test_recorded_smaps_rollup_is_split_into_anonymous_and_mapped_pages():
    from torch_watchdog.sidecar.sources.process import PssParts, parse_smaps_rollup
    (_, procs), *_ = _recorded_neighbours()
    master = parse_smaps_rollup(procs[0][1], started=7)
    # Pss_Anon 50209 kB; Pss_File 17667 + Pss_Shmem 0; Rss 228488 - Anonymous 148232
    assert master == PssParts(50209 * 1024, 17667 * 1024, (228488 - 148232) * 1024, 7)
    old_kernel = b"0-1 ---p 00000000 00:00 0 [rollup]\nRss:  2000 kB\nPss:   900 kB\n"
    assert parse_smaps_rollup(old_kernel) == PssParts(0, 900 * 1024, 2000 * 1024)  # all held
    assert parse_smaps_rollup(b"0-1 [rollup]\nRss: 5 kB\n") is None


def test_an_idle_servers_reading_does_not_move_as_its_neighbours_exit_and_its_growth_does():
    """Recorded: the server's PSS went 164.9 -> 170.6 -> 181.9 -> 215.7 MiB as 3 neighbours
    (each importing torch) stopped, its RSS the same: their share of torch's library pages
    became its. Its reading stays; the 200 MiB it then allocates show in full."""
    mib = 2 ** 20
    steps = [seen for _, seen in _meter_recorded(poll_s=10.0, polls_per_step=1)]
    plain = [seen for _, seen in _meter_recorded(poll_s=10.0, polls_per_step=1, plain=True)]
    assert plain[3] - plain[0] > 50 * mib  # the symptom, as read
    assert steps[:4] == [plain[0]] * 4  # the reading: flat, what was read first
    assert 199 * mib < steps[4] - steps[3] < 201 * mib
    assert steps[4] <= plain[4]  # never above the PSS read


def test_an_idle_server_next_to_exiting_neighbours_is_never_forecast():
    """The recorded idle steps 5 minutes each at one poll a second, against a 400 MiB budget:
    as PSS was read, the trend saw growth (OOM in ~49 min); the server's own memory is flat."""
    from tests.folding import fold
    from torch_watchdog.sidecar.config import CorrelateConfig, ForecastConfig
    from torch_watchdog.sidecar.core.correlate import State
    from torch_watchdog.sidecar.core.forecast import FOREVER, forecast
    from torch_watchdog.sidecar.core.observations import ProcessSample, Sample

    def forecast_of(plain):
        idle = _meter_recorded(polls_per_step=300, plain=plain)[:4 * 300]  # not the growth
        obs = [Sample(t=1000.0 + t, processes=(ProcessSample(11, True, level, pss_bytes=level),),
                      host_total_bytes=16 << 30, host_available_bytes=8 << 30)
               for t, level in idle]
        return forecast(fold(State(), obs, CorrelateConfig()),
                        ForecastConfig(process_budget_bytes=400 * 2 ** 20, headroom_bytes=0))

    assert forecast_of(plain=True).seconds < 3600  # before: an idle server forecast to OOM
    assert forecast_of(plain=False).seconds == FOREVER


def test_reader_without_proc_falls_back_to_psutil(tmp_path):
    from torch_watchdog.sidecar.sources.process import ProcessReader
    reader = ProcessReader(proc=str(tmp_path))  # an empty "/proc": nothing to open there
    try:
        (sample,) = reader.read({os.getpid()})
        assert sample.alive and sample.rss_bytes > 1 << 20
        assert reader.host_memory()[0] > 0
        assert [(s.pid, s.alive) for s in reader.read({0, -5})] == [(-5, False), (0, False)]
    finally:
        reader.close()


def test_stat_line_with_parentheses_and_spaces_in_the_name():
    from torch_watchdog.sidecar.sources.process import ProcessReader
    reader = ProcessReader()
    fields = " ".join(["S"] + ["0"] * 20 + ["250"] + ["0"] * 20)
    assert reader._parse(f"42 (a) b (c) {fields}".encode(), -1) == (True, 250 * reader._page)
    assert reader._parse(f"42 (x y) {fields.replace('S', 'Z', 1)}".encode(), -1) == (False, None)


def test_a_process_is_in_a_cgroup_by_the_kernels_word(tmp_path):
    from torch_watchdog.sidecar.sources.process import in_cgroup
    for pid, text in ((10, "0::/system.slice/llm.service\n"),  # cgroup v2
                      (11, "1:name=systemd:/system.slice/llm.service/worker\n0::/\n"),  # v1
                      (12, "0::/system.slice/llm.service-other.service\n"),
                      (13, "0::/system.slice/tw-impostor.service\n")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    found = [pid for pid in (10, 11, 12, 13, 14)
             if in_cgroup(pid, "/system.slice/llm.service", proc=str(tmp_path))]
    assert found == [10, 11]  # 14: gone
