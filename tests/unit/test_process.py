"""Process source against real processes, real pidfiles and a fake systemctl."""
from __future__ import annotations

import os
import subprocess
import sys

from torch_watchdog.sidecar.sources.process import read_pidfile, read_processes, unit_main_pid


def test_own_process_is_alive_with_rss_and_gpu_bytes_attached():
    me = os.getpid()
    (sample,) = read_processes({me}, {me: {"GPU-0": 5}, 1: {"GPU-0": 7}})
    assert sample.pid == me and sample.alive
    assert sample.rss_bytes is not None and sample.rss_bytes > 1 << 20
    assert sample.gpu_bytes == {"GPU-0": 5}


def test_killed_and_reaped_child_is_dead_without_rss():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.kill()
    child.wait(10)
    me = os.getpid()
    samples = read_processes({child.pid, me})
    assert [s.pid for s in samples] == sorted([child.pid, me])
    dead = next(s for s in samples if s.pid == child.pid)
    assert not dead.alive and dead.rss_bytes is None and dead.gpu_bytes == {}


def test_unreaped_child_zombie_counts_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left a zombie
        (sample,) = read_processes({child.pid})
        assert not sample.alive and sample.rss_bytes is None
    finally:
        child.wait(10)


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


def test_pss_is_read_now_and_then_and_carried_by_rss():
    from torch_watchdog.sidecar.sources.process import PssMeter, read_pss
    from torch_watchdog.sidecar.core.observations import ProcessSample
    now, reads = [0.0], []

    def read(pid):
        reads.append(pid)
        return {11: 300, 12: 200}.get(pid)

    meter = PssMeter(every_s=10.0, read=read, clock=lambda: now[0])
    out = meter.apply((ProcessSample(11, True, 1000), ProcessSample(12, True, 900),
                       ProcessSample(13, True, 500), ProcessSample(14, False, None)))
    assert [p.host_bytes for p in out] == [300, 200, 500, None]  # 13: no PSS, its RSS
    now[0] = 5.0  # 11 grew 50 bytes: its PSS grows as much, no new read (13's failed: again)
    out = meter.apply((ProcessSample(11, True, 1050), ProcessSample(12, True, 900),
                       ProcessSample(13, True, 500)))
    assert [p.pss_bytes for p in out] == [350, 200, None] and reads == [11, 12, 13, 13]
    now[0] = 10.0
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
    now, pss, reads = [0.0], {1: 900}, []

    def read(pid):
        reads.append(pid)
        return pss[pid]

    meter = PssMeter(every_s=10.0, read=read, clock=lambda: now[0])
    master = ProcessSample(1, True, 1000)
    assert meter.apply((master,))[0].pss_bytes == 900
    now[0], pss[1], pss[2], pss[3] = 1.0, 300, 310, 320  # two workers forked
    out = meter.apply((master, ProcessSample(2, True, 1000), ProcessSample(3, True, 1000)))
    assert [p.pss_bytes for p in out] == [300, 310, 320] and reads == [1, 1, 2, 3]
    now[0], pss[1], pss[2] = 2.0, 450, 460  # a worker exited: the others' shares grow
    out = meter.apply((master, ProcessSample(2, True, 1000)))
    assert [p.pss_bytes for p in out] == [450, 460] and reads[4:] == [1, 2]
    now[0] = 3.0  # the same processes: carried, not read
    assert meter.apply((master, ProcessSample(2, True, 1000)))[1].pss_bytes == 460
    assert len(reads) == 6


def test_pss_of_the_same_processes_is_the_same_answer_until_a_read_is_due():
    from torch_watchdog.sidecar.sources.process import PssMeter
    from torch_watchdog.sidecar.core.observations import ProcessSample
    now, reads, pss = [0.0], [], {11: 300, 12: None}

    def read(pid):
        reads.append(pid)
        return pss[pid]

    meter = PssMeter(every_s=10.0, read=read, clock=lambda: now[0])
    procs = (ProcessSample(11, True, 1000), ProcessSample(13, False, None))
    first = meter.apply(procs)
    now[0] = 9.9
    assert meter.apply(procs) is first and reads == [11]  # the reader's same tuple: kept
    assert meter.apply((ProcessSample(11, True, 1100),))[0].pss_bytes == 400  # others: new
    kept = meter.apply(procs)
    assert kept == first and kept is not first and reads == [11]
    assert meter.apply(procs) is kept
    now[0] = 10.0  # a read is due: the same tuple is read again
    pss[11] = 500
    again = meter.apply(procs)
    assert reads == [11, 11] and again[0].pss_bytes == 500
    # a failed read is tried again at the next call, same processes or not
    failing = (ProcessSample(12, True, 700),)
    assert meter.apply(failing)[0].pss_bytes is None and reads[-1] == 12
    pss[12] = 650
    assert meter.apply(failing)[0].pss_bytes == 650 and reads == [11, 11, 12, 12]


def test_reader_keeps_one_descriptor_per_watched_pid_and_closes_the_rest():
    from torch_watchdog.sidecar.sources.process import ProcessReader
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reader = ProcessReader()
    try:
        me = os.getpid()
        first = reader.read({me, child.pid})
        assert [s.alive for s in first] == [True, True]
        assert sorted(reader._fds) == sorted([me, child.pid])
        again = reader.read({me, child.pid})
        # unchanged numbers: the same frozen sample, nothing allocated for it
        assert any(a is b for a, b in zip(first, again))
        child.kill()
        child.wait(10)
        # read through the kept descriptor: the reaped process is dead, and its file closed
        dead = next(s for s in reader.read({me, child.pid}) if s.pid == child.pid)
        assert not dead.alive and dead.rss_bytes is None
        reader.read({me})
        assert list(reader._fds) == [me]
    finally:
        reader.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert reader._fds == {}


def test_reader_rss_matches_psutil_and_a_zombie_through_a_kept_descriptor_is_dead():
    import psutil

    from torch_watchdog.sidecar.sources.process import ProcessReader
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    reader = ProcessReader()
    try:
        assert child.stdout.readline() == b"up\n"  # started: its RSS is the interpreter's
        (sample,) = reader.read({child.pid})
        assert sample.alive
        assert abs(sample.rss_bytes - psutil.Process(child.pid).memory_info().rss) < 4 << 20
        child.stdin.close()  # it exits; unreaped, a zombie
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        (sample,) = reader.read({child.pid})
        assert not sample.alive and sample.rss_bytes is None
    finally:
        reader.close()
        child.stdin.close()
        child.wait(10)


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


def test_reader_without_pidfds_reads_stat_alone():
    from torch_watchdog.sidecar.sources.process import ProcessReader
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    reader = ProcessReader()
    reader._exits = None  # as on Linux < 5.3
    try:
        me = os.getpid()
        def alive():  # samples come sorted by pid, and the child's pid may be below ours
            return {s.pid: s.alive for s in reader.read({me, child.pid})}
        assert alive() == {me: True, child.pid: True}
        assert all(pidfd == -1 for pidfd, _ in reader._fds.values())
        child.stdin.close()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie
        assert alive() == {me: True, child.pid: False}
        child.wait(10)
        assert alive() == {me: True, child.pid: False}
    finally:
        reader.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_a_gpu_metered_process_has_its_rss_read_now_and_then_and_its_death_at_once():
    from torch_watchdog.sidecar.sources.process import ProcessReader
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    now = [0.0]
    reader = ProcessReader(rss_every_s=1.0, clock=lambda: now[0])
    pages = []
    reader._parse = lambda data, pidfd, parse=reader._parse: pages.append(1) or \
        parse(data, pidfd)
    try:
        assert child.stdout.readline() == b"up\n"
        gpu = {child.pid: {"GPU-0": 5 << 30}}
        (first,) = reader.read({child.pid}, gpu)
        assert first.alive and first.rss_bytes > 1 << 20 and len(pages) == 1
        now[0] = 1.0  # the first interval is spread over (0, 1] s by pid: due
        (first,) = reader.read({child.pid}, gpu)
        assert len(pages) == 2
        for _ in range(5):  # within the interval: alive by its pidfd, RSS as read
            now[0] += 0.1
            again = reader.read({child.pid}, gpu)
            assert again[0] is first
        assert len(pages) == 2
        now[0] = 2.0
        reader.read({child.pid}, gpu)
        assert len(pages) == 3  # due: read again
        reader.read({child.pid})  # no GPU memory: RSS is its meter, read every poll
        reader.read({child.pid})
        assert len(pages) == 5
        child.stdin.close()  # it exits within the RSS interval: dead at the next read
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        now[0] += 0.1
        (dead,) = reader.read({child.pid}, gpu)
        assert not dead.alive and dead.rss_bytes is None
    finally:
        reader.close()
        child.stdin.close()
        child.wait(10)


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
