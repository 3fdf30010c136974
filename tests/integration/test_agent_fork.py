"""The agent across fork: installed in a master before it forks workers (a multiprocessing pool,
gunicorn --preload), every worker reports as itself — hello with its pid, its master's pid and
the master's server — and keeps its own event log. Real processes, a real socket receiver."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Optional

import pytest

from tests.conftest import free_port, with_root
from torch_watchdog import events

POOL_MASTER = r"""
import json, multiprocessing as mp, os, sys, time
import torch, torch_watchdog.agent as agent

# heartbeat_s=60: a worker's `calls` event can only come from the flush when the worker exits
a = agent.install(socket_path=sys.argv[1], event_log=sys.argv[2], heartbeat_s=60)
square = agent.watch(lambda x: x * x, name="square")
ctx = mp.get_context("fork")
barrier = ctx.Barrier(2)

def task(n):
    barrier.wait(10)  # one task per worker: neither worker takes both
    me = agent.current()
    deadline = time.monotonic() + 10
    while me._seq < 1 and time.monotonic() < deadline:  # the worker's first heartbeat is out:
        time.sleep(0.01)                                 # the next is a minute away
    square(torch.zeros(n, 3))
    square(torch.zeros(n, 3))
    return os.getpid()

with ctx.Pool(2) as pool:
    workers = pool.map(task, [2, 5])
    pool.close()
    pool.join()
print(json.dumps({"master": os.getpid(), "server": a.server, "workers": workers}))
"""


def run_script(code: str, *args: str, env: Optional[dict] = None, timeout: float = 90
               ) -> subprocess.CompletedProcess:
    """A fresh interpreter in its own session, killed with everything it forked on timeout."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_WATCHDOG_")}
    full_env.update(env or {}, PYTHONPATH=with_root())
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_log(path: str) -> list[events.Event]:
    with open(path) as fh:
        return [events.decode(line) for line in fh]


def test_pool_workers_forked_after_install_report_as_themselves(short_tmp, collector):
    log = os.path.join(short_tmp, "events-{pid}.jsonl")
    done = run_script(POOL_MASTER, collector.path, log)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout.strip().splitlines()[-1])
    master, server, workers = info["master"], info["server"], info["workers"]
    assert len(set(workers)) == 2 and master not in workers

    def by(pid: int, kind: str) -> list:
        return [e for e in collector.of(kind) if e.pid == pid]

    # the pool's workers exit through os._exit(): their last `calls` comes from the exit flush
    assert collector.wait(lambda c: all(by(w, "calls") for w in workers), 10), collector.events
    hello = by(master, "hello")[0]
    assert hello.server == server and hello.ppid == os.getpid()  # this test started it
    for worker, n in zip(workers, (2, 5)):
        hellos = by(worker, "hello")
        assert hellos and all(h.ppid == master and h.server == server for h in hellos)
        assert [s.shape for s in by(worker, "new_shape")] == [[[n, 3]]]  # its own, once
        assert sum(c.calls for c in by(worker, "calls")) == 2
    # nothing the master queued before the fork is sent again under a worker's name
    assert len(by(master, "hello")) == 1

    # one event log per process, each with that process's events only
    files = sorted(os.listdir(short_tmp))
    assert files == sorted(["events.sock"] + [f"events-{p}.jsonl" for p in [master, *workers]])
    for pid in (master, *workers):
        logged = read_log(os.path.join(short_tmp, f"events-{pid}.jsonl"))
        assert logged[0].kind == "hello" and {e.pid for e in logged} == {pid}
    for worker in workers:
        kinds = [e.kind for e in read_log(os.path.join(short_tmp, f"events-{worker}.jsonl"))]
        assert "new_shape" in kinds and "calls" in kinds


LOCKED_FORK = r"""
import os, sys, threading, time
import torch_watchdog.agent as agent

a = agent.install(socket_path=sys.argv[1], heartbeat_s=0.2)
reset_ran = []
agent._AFTER_FORK.append(lambda: 1 / 0)           # a broken reset must not stop the others
agent._AFTER_FORK.append(lambda: reset_ran.append(os.getpid()))

holding, release = threading.Event(), threading.Event()
emitter, tick = a.emitter, a.tick

def tick_holding_locks():                          # on the sender thread
    if not release.is_set():
        with agent._lock, emitter._wake._cond:     # the agent's lock and the emitter's wake-up
            holding.set()
            release.wait(10)
    tick()

emitter._on_tick = tick_holding_locks
assert holding.wait(10)
pid = os.fork()
if pid == 0:                                       # the sender thread held both locks at fork
    code = 1
    try:
        a.emitter.emit(agent.events.Mitigation(t=time.time(), pid=os.getpid(), name="child",
                                               action="engaged", detail="after fork"))
        agent.uninstall()                          # takes the agent's lock, wakes the sender
        code = 0 if reset_ran == [os.getpid()] else 2
    finally:
        os._exit(code)
release.set()
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.02)
else:
    os.kill(pid, 9)
    print("child deadlocked", flush=True)
    sys.exit(3)
print(os.getpid(), pid, os.waitstatus_to_exitcode(status), flush=True)
agent.uninstall()
"""


def test_fork_while_the_sender_thread_holds_the_locks_does_not_deadlock_the_child(collector):
    done = run_script(LOCKED_FORK, collector.path, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    master, child, child_exit = map(int, done.stdout.split())
    assert child_exit == 0, done.stderr
    assert collector.wait(lambda c: any(e.pid == child for e in c.of("mitigation")), 10)
    hello = [e for e in collector.of("hello") if e.pid == child]
    assert hello and hello[0].ppid == master
    master_hello = [e for e in collector.of("hello") if e.pid == master][0]
    assert hello[0].server == master_hello.server


WSGI_APP = r"""
import os
import torch_watchdog.agent

torch_watchdog.agent.install()  # at import: with --preload, in the master before the fork

def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [str(os.getpid()).encode()]
"""


def test_gunicorn_preload_workers_each_say_hello(short_tmp, collector):
    pytest.importorskip("gunicorn")
    with open(os.path.join(short_tmp, "wsgi_app.py"), "w") as fh:
        fh.write(WSGI_APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_WATCHDOG_")}
    env.update(PYTHONPATH=os.pathsep.join([short_tmp, with_root()]),
               TORCH_WATCHDOG_SOCKET=collector.path, TORCH_WATCHDOG_SERVER="llm-a",
               TORCH_WATCHDOG_EVENT_LOG=os.path.join(short_tmp, "ev-{pid}.jsonl"))
    port = free_port()
    err = open(os.path.join(short_tmp, "gunicorn.err"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "--preload", "-w", "2",
                             "-b", f"127.0.0.1:{port}", "--graceful-timeout", "5",
                             "wsgi_app:app"], cwd=short_tmp, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=err)
    try:
        def workers(c) -> list:
            return [e for e in c.of("hello") if e.pid != proc.pid]

        ok = collector.wait(lambda c: len({e.pid for e in workers(c)}) >= 2, 60)
        with open(err.name) as fh:
            assert ok, ([(e.pid, e.ppid) for e in collector.of("hello")], fh.read()[-3000:])
        master = [e for e in collector.of("hello") if e.pid == proc.pid]
        assert master and master[0].server == "llm-a"
        assert all(e.ppid == proc.pid and e.server == "llm-a" for e in workers(collector))
        pids = {e.pid for e in workers(collector)}
        assert len(pids) == 2
        for pid in pids:
            assert os.path.exists(os.path.join(short_tmp, f"ev-{pid}.jsonl"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        err.close()


FORK_SHAPES = r"""
import json, os, sys
import torch, torch_watchdog.agent as agent

agent.install(socket_path=sys.argv[1], heartbeat_s=60)
plus = agent.watch(lambda x: x + 1, name="plus")
plus(torch.zeros(2, 3))                            # the master's warm-up shapes
plus(torch.zeros(4, 3))
pid = os.fork()
if pid == 0:
    code = 1
    try:
        plus(torch.zeros(2, 3))                    # the master saw it; this worker has not
        plus(torch.zeros(2, 3))
        plus(torch.zeros(7, 3))
        agent.uninstall()                          # flushes the worker's `calls`
        code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
plus(torch.zeros(7, 3))                            # the worker's shapes are not the master's
print(json.dumps({"master": os.getpid(), "worker": pid,
                  "worker_exit": os.waitstatus_to_exitcode(status)}))
agent.uninstall()
"""


def test_a_forked_worker_reports_the_shapes_it_meets_itself(collector):
    done = run_script(FORK_SHAPES, collector.path, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    info = json.loads(done.stdout.strip().splitlines()[-1])
    master, worker = info["master"], info["worker"]
    assert info["worker_exit"] == 0, done.stderr

    def by(pid: int, kind: str) -> list:
        return [e for e in collector.of(kind) if e.pid == pid]

    assert collector.wait(lambda c: by(worker, "calls") and by(master, "calls"), 10), \
        collector.events
    # the worker's own new shapes, counted from its own first one, the master's included
    assert [(s.shape, s.distinct) for s in by(worker, "new_shape")] == [([[2, 3]], 1),
                                                                          ([[7, 3]], 2)]
    calls = by(worker, "calls")
    assert sum(c.calls for c in calls) == 3 and calls[-1].distinct_shapes == 2
    # and the master's memory is its own: the worker's shapes did not go into it
    assert [(s.shape, s.distinct) for s in by(master, "new_shape")] == [
        ([[2, 3]], 1), ([[4, 3]], 2), ([[7, 3]], 3)]
