"""Process source against real child processes: dead, zombies, kept descriptors, pidfds, a
GPU-metered process's RSS interval, and a server whose neighbours share its mapped pages.
Without processes of its own: tests/unit/test_process.py."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.fakes import Clock
from torch_watchdog.sidecar.sources.process import read_processes


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
    clock = Clock(0.0)
    reader = ProcessReader(rss_every_s=1.0, clock=clock)
    pages = []
    reader._parse = lambda data, pidfd, parse=reader._parse: pages.append(1) or \
        parse(data, pidfd)
    try:
        assert child.stdout.readline() == b"up\n"
        gpu = {child.pid: {"GPU-0": 5 << 30}}
        (first,) = reader.read({child.pid}, gpu)
        assert first.alive and first.rss_bytes > 1 << 20 and len(pages) == 1
        clock.t = 1.0  # the first interval is spread over (0, 1] s by pid: due
        (first,) = reader.read({child.pid}, gpu)
        assert len(pages) == 2
        for _ in range(5):  # within the interval: alive by its pidfd, RSS as read
            clock.advance(0.1)
            again = reader.read({child.pid}, gpu)
            assert again[0] is first
        assert len(pages) == 2
        clock.t = 2.0
        reader.read({child.pid}, gpu)
        assert len(pages) == 3  # due: read again
        reader.read({child.pid})  # no GPU memory: RSS is its meter, read every poll
        reader.read({child.pid})
        assert len(pages) == 5
        child.stdin.close()  # it exits within the RSS interval: dead at the next read
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        clock.advance(0.1)
        (dead,) = reader.read({child.pid}, gpu)
        assert not dead.alive and dead.rss_bytes is None
    finally:
        reader.close()
        child.stdin.close()
        child.wait(10)


# A process mapping a file and touching its pages (one of a server's, or a neighbour): with
# `workers`, it forks them after allocating `hoard` MiB, and each touches the file too. It
# prints its pids, then on a "grow N" line allocates and touches N MiB more ("map PATH": maps
# and touches another file), and answers "ok".
MAPPER = r"""
import mmap, os, signal, sys
path, workers, hoard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def touch(path):
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sum(m[i] for i in range(0, len(m), 4096))
    return m
def allocate(mib):
    b = bytearray(mib << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    return b
kept = [touch(path), allocate(hoard)]
r, w = os.pipe()
kids = []
for _ in range(workers):
    pid = os.fork()
    if pid == 0:
        kept.append(touch(path))
        os.write(w, b"x")
        while True:
            signal.pause()
    kids.append(pid)
told = b""
while len(told) < workers:
    told += os.read(r, workers)
print(" ".join(map(str, [os.getpid(), *kids])), flush=True)
for line in sys.stdin:
    what, arg = line.split()
    kept.append(allocate(int(arg)) if what == "grow" else touch(arg))
    print("ok", flush=True)
"""


MIB = 2 ** 20


def _mapper(path, workers=0, hoard=0):
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(path), str(workers), str(hoard)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, [int(p) for p in proc.stdout.readline().split()]


def _stop(proc):
    import signal
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _file(path, mib):
    with open(path, "wb") as f:
        for i in range(mib):
            f.write(bytes([i % 251 + 1]) * MIB)
    return path


def test_an_idle_server_reads_the_same_as_its_neighbours_exit_and_its_growth_at_once(tmp_path):
    """Real processes: a server (a master holding 64 MiB, 2 forked workers) and 3 neighbours
    map the same 96 MiB file. PSS shares its pages among all 6: as the neighbours exit, the
    server's PSS grows though it maps nothing new (an idle server forecast to OOM); its
    reading stays. Its forked workers' pages count once, and 200 MiB it allocates, or a file
    it maps, show at once (carried by RSS, before any read is due, and as read)."""
    from torch_watchdog.sidecar.sources.process import ProcessReader, PssMeter, read_pss
    data = _file(tmp_path / "lib.bin", 96)
    server, mine = _mapper(data, workers=2, hoard=64)
    neighbours = [_mapper(data) for _ in range(3)]
    reader = ProcessReader()
    every_poll, daemons = PssMeter(every_s=0.0), PssMeter()  # read each poll; every 10 s

    def readings():
        pids = set(mine) | {p for proc, ps in neighbours if proc.poll() is None for p in ps}
        samples = reader.read(pids)
        return [sum(p.host_bytes for p in meter.apply(samples) if p.pid in mine) / MIB
                for meter in (every_poll, daemons)]

    try:
        start = readings()
        pss_start = sum(read_pss(p) for p in mine) / MIB
        rss = sum(p.rss_bytes for p in reader.read(set(mine))) / MIB
        assert abs(start[0] - pss_start) < 2 and abs(start[1] - start[0]) < 2, (start, pss_start)
        assert rss - start[0] > 2 * 64 * 0.9  # the master's 64 MiB once, not 3 times
        seen = []
        for proc, _ in neighbours:
            _stop(proc)
            seen.append(readings())
        pss_end = sum(read_pss(p) for p in mine) / MIB
        assert pss_end - pss_start > 30, (pss_start, pss_end)  # PSS: the server "grew"
        for now in seen:  # its reading did not
            assert all(-3 < b - a < 1 for a, b in zip(start, now)), (start, seen)
        for what, mib in (("grow 200", 200), (f"map {_file(tmp_path / 'w.bin', 64)}", 64)):
            before = readings()
            server.stdin.write(what + "\n")
            server.stdin.flush()
            assert server.stdout.readline() == "ok\n"
            after = readings()
            assert all(mib - 2 < b - a < mib + 3 for a, b in zip(before, after)), \
                (what, before, after)
    finally:
        reader.close()
        for proc in [server] + [p for p, _ in neighbours]:
            _stop(proc)
