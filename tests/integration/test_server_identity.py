"""Which server a process joins by default, with real processes on one host and one sidecar.

Real processes, each with the agent and a compiled model, none named (no
`TORCH_WATCHDOG_SERVER`, no `servers:`): 4 replicas started by one supervisor script (background
jobs of one shell, one process group), each with its own `CUDA_VISIBLE_DEVICES`; a 2-rank
`torch.distributed` (gloo) job under `torchrun --standalone` (each rank in a session of its
own); `uvicorn --workers 2`. The sidecar is the real daemon with the real socket and a
simulated NVML that puts each replica on its GPU and the ranks on two more. Asserted: 4
replica servers, 1 job of 2 ranks, 1 uvicorn server of 2 workers, each named on the status
page, in `torch-watchdog status` and in the metrics' `server` label; a growing replica is
reloaded alone (its pid SIGTERMed, every other process untouched) and comes back; a growing
job takes both ranks, and torchrun starts them again; the sidecar's sample log replayed
takes the same actions. `IDENTITY_DEBUG=1` prints the table (case, names, what each reload
signalled).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

import psutil
import pytest
import structlog

from tests.conftest import ROOT, free_port, with_root
from tests.fakes import Clock
from tests.fakes import FakeNvml
from torch_watchdog.sidecar.config import (AgentSocketConfig, Config, ForecastConfig,
                                           PolicyConfig, ReloadConfig)
from torch_watchdog.sidecar.daemon import Daemon
from torch_watchdog.sidecar.offline.replay import replay
from torch_watchdog.sidecar.present.metrics import render
from torch_watchdog.sidecar.present.page import render_page
from torch_watchdog.sidecar.present.status import build_status, format_terminal
from torch_watchdog.sidecar.sources.nvml import NvmlSource

pytest.importorskip("uvicorn")

GB = 1 << 30
MB = 1 << 20
GPUS = [f"GPU-{i}" for i in range(6)]  # the replicas' 0-3, the ranks' 4 and 5
SERVER = os.path.join(ROOT, "tests", "integration", "identity_server.py")
# one supervisor, no setsid: every replica in its process group, a GPU each, restarted when
# it exits (the supervisor a reload by signal relies on)
SUPERVISOR = """
run() { while true; do CUDA_VISIBLE_DEVICES=$1 "$PY" "$SERVER"; sleep 0.2; done; }
for i in 0 1 2 3; do run $i & done
wait
"""
DEBUG = os.environ.get("IDENTITY_DEBUG") == "1"


def env_for(sock: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "TORCH_WATCHDOG_SERVER", "WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return dict(env, PYTHONPATH=with_root(), TORCH_WATCHDOG_SOCKET=sock, PY=sys.executable,
                SERVER=SERVER, OMP_NUM_THREADS="1")


def stop(proc: subprocess.Popen) -> None:
    """The process, its group and every descendant: torchrun's ranks are in sessions of
    their own, and outlive a killed torchrun."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(family, timeout=10)


class Rig:
    """The daemon ticked by hand on a clock 0.1 s a tick, NVML simulated: each server's
    processes on its GPUs with `level[pid]` bytes."""

    def __init__(self, tmp: str):
        self.log = os.path.join(tmp, "samples.jsonl")
        self.cfg = Config(
            agent=AgentSocketConfig(socket_path=os.path.join(tmp, "ev.sock"),
                                    allowed_uids=[os.getuid()]),
            state_dir=os.path.join(tmp, "state"), sample_log=self.log,
            forecast=ForecastConfig(window_s=2.0, headroom_bytes=0),
            policy=PolicyConfig(reload_lead_s=30, alert_lead_s=60, hold_polls=1, warmup_s=0,
                                cooldown_s=600),
            reload=ReloadConfig(method="signal", grace_s=10, hello_timeout_s=90))
        self.nvml = FakeNvml([{"uuid": u.encode(), "total": 4 * GB, "used": GB, "procs": []}
                              for u in GPUS])
        self.clock = Clock(time.time())
        self.daemon = Daemon(self.cfg, None, structlog.get_logger(),
                             nvml=NvmlSource(self.nvml), clock=self.clock, serve_metrics=False)
        self.live: list[dict] = []
        act = self.daemon._act
        self.daemon._act = lambda a: (self.live.append(a.as_dict()), act(a))
        self.gpu_of: dict[int, int] = {}   # pid -> index in GPUS
        self.level: dict[int, int] = {}    # pid -> its bytes on its GPU
        self.snap = None

    def tick(self) -> None:
        procs: dict[int, list] = {i: [] for i in range(len(GPUS))}
        for pid, i in self.gpu_of.items():
            if psutil.pid_exists(pid):
                procs[i].append((pid, self.level.setdefault(pid, 2 * GB)))
        for i, dev in enumerate(self.nvml.devices):
            dev["procs"] = procs[i]
            dev["used"] = GB // 2 + sum(b for _, b in procs[i])
        self.clock.t += 0.1
        self.snap = self.daemon.tick()
        time.sleep(0.02)

    def servers(self) -> dict[str, list[int]]:
        return {name: list(v.get("pids") or []) for name, v in self.snap.servers.items()}

    def until(self, cond: Callable[[], object], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.tick()
            if cond():
                return
        pytest.fail(f"{what} within {timeout:.0f} s; servers {self.servers()}; "
                    f"actions {[a['action'] for a in self.live]}")

    def acted(self, kind: str, server: str) -> Optional[dict]:
        return next((a for a in self.live if a["action"] == kind and a["server"] == server),
                    None)


def test_replicas_ranks_and_workers_are_told_apart_by_default(short_tmp):
    rig = Rig(short_tmp)
    rig.daemon.start()
    env = env_for(rig.cfg.agent.socket_path)
    port = free_port()
    torchrun_log = os.path.join(short_tmp, "torchrun.log")
    log_fh = open(torchrun_log, "w")
    procs: list[subprocess.Popen] = []
    try:
        sup = subprocess.Popen(["bash", "-c", SUPERVISOR], env=env, start_new_session=True)
        procs.append(sup)
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", "2", "--max-restarts", "1",
                                "--monitor-interval", "0.5", SERVER, "rank"],
                               env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=None if DEBUG else log_fh)
        procs.append(job)
        web = subprocess.Popen([sys.executable, "-m", "uvicorn", "--workers", "2", "--port",
                                str(port), "--log-level", "warning",
                                "tests.integration.identity_app:app"],
                               env=env, cwd=ROOT, start_new_session=True)
        procs.append(web)
        replicas = {f"pgid:{sup.pid}/cuda:{i}": i for i in range(4)}
        uvicorn = f"pgid:{web.pid}"

        def job_name() -> Optional[str]:
            return next((n for n in rig.servers() if n.startswith("dist:")), None)

        def everyone() -> bool:
            seen = rig.servers()
            return (all(len(seen.get(n, [])) == 1 for n in replicas)
                    and len(seen.get(uvicorn, [])) == 2
                    and (j := job_name()) is not None and len(seen[j]) == 2)

        rig.until(everyone, 180, "4 replicas, a job of 2 ranks and 2 uvicorn workers")
        seen = rig.servers()
        dist = job_name()
        assert dist is not None
        assert set(seen) == set(replicas) | {dist, uvicorn}, seen
        ranks = sorted(seen[dist])
        assert {psutil.Process(p).ppid() for p in ranks} == {job.pid}  # torchrun's own ranks
        assert len({os.getpgid(p) for p in ranks}) == 2  # in sessions of their own
        assert {psutil.Process(p).ppid() for p in seen[uvicorn]} == {web.pid}
        for name, i in replicas.items():
            rig.gpu_of[seen[name][0]] = i
        rig.gpu_of.update({ranks[0]: 4, ranks[1]: 5})
        want = {**{n: [GPUS[i]] for n, i in replicas.items()}, dist: GPUS[4:6]}

        def published() -> dict:
            status = build_status(rig.daemon.status, rig.clock.t)
            gpus = {v["server"]: v["gpus"] for v in status["servers"]}
            return status if all(gpus.get(n) == g for n, g in want.items()) else {}

        rig.until(published, 30, "every server on the status page with its own GPUs")
        # where a user sees which server a process joined
        status = published()
        text = format_terminal(status, "http://127.0.0.1:9464", rig.clock.t)
        page = render_page(status, rig.clock.t)
        metrics = render(rig.daemon.registry).decode()
        # the metrics' label: the program where the name changes with each start
        labels = {name: rig.daemon.host.servers[name].label for name in seen}
        for name, pids in seen.items():  # its row of the host table: name, state, pids
            (row,) = [line for line in text.splitlines() if line[9:].startswith(f"{name} ")]
            assert " up " in row and ",".join(map(str, sorted(pids))) in row, (name, text)
            assert name in page
            assert f'server="{labels[name]}"' in metrics
            assert not labels[name].startswith(("pgid:", "dist:")), labels
        assert len(set(labels.values())) == len(labels), labels

        # a growing replica: reloaded alone, back under the same name
        grower = f"pgid:{sup.pid}/cuda:2"
        old = seen[grower][0]
        others = [p for n, ps in seen.items() if n != grower for p in ps]
        rig.until(lambda: rig.level.__setitem__(old, rig.level[old] + 5 * MB) or
                  rig.acted("execute", grower), 60, "the growing replica's reload decided")
        rig.until(lambda: rig.acted("reload_ok", grower) or rig.acted("reload_failed", grower),
                  120, "the replica's reload done")
        assert rig.acted("reload_ok", grower), rig.live
        assert rig.acted("execute", grower)["pids"] == [old]
        assert not psutil.pid_exists(old) or psutil.Process(old).status() == "zombie"
        assert all(psutil.pid_exists(p) for p in others), "a healthy process was signalled"
        rig.until(lambda: [p for n, ps in rig.servers().items() for p in ps
                           if p != old and rig.daemon.host.servers[n].label == labels[grower]],
                  30, "the new replica watched, under its label")
        assert not [a for a in rig.live if a["action"] == "execute" and a["server"] != grower]

        # a growing job: both ranks, torchrun starts them again
        for p in ranks:
            rig.level[p] = 2 * GB
        rig.until(lambda: [rig.level.__setitem__(p, rig.level[p] + 5 * MB) for p in ranks]
                  and rig.acted("execute", dist), 60, "the job's reload decided")
        rig.until(lambda: rig.acted("reload_ok", dist) or rig.acted("reload_failed", dist), 120,
                  "the job's reload done")
        assert rig.acted("reload_ok", dist), rig.live
        assert rig.acted("execute", dist)["pids"] == ranks
        try:
            rig.until(lambda: len([p for n, ps in rig.servers().items() if n.startswith("dist:")
                                   for p in ps if p not in ranks]) == 2, 60,
                      "both new ranks watched")
        except pytest.fail.Exception as e:  # say whether torchrun's restarted group died
            with open(torchrun_log) as fh:
                tail = fh.read()[-3000:]
            raise AssertionError(f"{e}; torchrun exit status {job.poll()}; its log:\n"
                                 f"{tail}") from None
        assert job.poll() is None  # torchrun restarted its ranks
        assert all(psutil.pid_exists(p) for p in seen[uvicorn])
        if DEBUG:
            print("\ncase -> server names seen -> what a reload signalled")
            print(f"4 replicas  -> {sorted(replicas)} -> {grower}: pid {old}")
            print(f"torchrun    -> {dist} (ranks {ranks}) -> pids {ranks}")
            print(f"uvicorn x2  -> {uvicorn} (workers {seen[uvicorn]}) -> none")
    finally:
        rig.daemon.halt()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        for p in procs:
            stop(p)
        log_fh.close()
    replayed = replay([rig.log], rig.cfg)
    assert replayed["replay"]["bad_lines"] == 0
    assert replayed["actions"] == rig.live
