"""Three servers on one host, as the host view is checked against them: a real sidecar (a
subprocess, host-memory mode: no GPU needed) and three small server processes that speak to it
as the agent does, each under its own name:

- `growing` keeps 5 MiB more per new input size (a CUDA graph's stand-in) until it is well
  over its budget; the sidecar reloads it by SIGTERM and this module starts it again, as
  systemd's Restart= would; the new process grows again, and the cooldown holds the next
  reload back;
- `storm` recompiles every half second and hits the recompile limit;
- `idle` compiled once and waits.

`python -m tests.integration.host_servers WORKDIR PORT` runs it until Ctrl-C (for a browser or
`torch-watchdog status`); tests use `HostScenario` as a context manager.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from torch_watchdog import events
from torch_watchdog.agent.emitter import Emitter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
BUDGET = 400 * MIB        # every server's own memory budget (forecast.process_budget_bytes)
STEP = 5 * MIB            # the growing server's memory per new size
CEILING = 560 * MIB       # where it stops growing: over its budget, and this host's RAM spared
FUNCTION = "forward"


def config(workdir: str, port: int, sock: str, cooldown_s: float = 600.0) -> str:
    return f"""poll_interval_s: 0.1
metrics_address: "127.0.0.1"
metrics_port: {port}
state_dir: "{workdir}/state"
sample_log: "{workdir}/samples.jsonl"
server: {{trust_agent_pids: true}}
agent: {{socket_path: "{sock}", allowed_uids: [{os.getuid()}]}}
correlate: {{storm_recompiles: 3, storm_window_s: 60.0}}
forecast: {{process_budget_bytes: {BUDGET}, window_s: 3}}
policy: {{reload_lead_s: 6, alert_lead_s: 30, hold_polls: 3, warmup_s: 1,
         cooldown_s: {cooldown_s}, max_reloads_per_hour: 3}}
reload: {{method: signal, grace_s: 5, hello_timeout_s: 10}}
"""


# -- the servers (each a process of its own) ---------------------------------------------------
def serve(sock: str, name: str, kind: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a graceful stop
    pid = os.getpid()
    em = Emitter(sock, None)
    em.emit(events.Hello(t=time.time(), pid=pid, torch="", agent="host_servers", devices=[],
                         config={"recompile_limit": 8}, capabilities={}, watched=[FUNCTION],
                         argv=f"host_servers {kind}", server=name, ppid=os.getppid()))
    em.emit(events.Compile(t=time.time(), pid=pid, compile_id="0/0", function=FUNCTION,
                           seconds=1.0))
    hoard: list[bytearray] = []
    i = 0
    while True:
        t = time.time()
        if kind == "growing" and len(hoard) * STEP < CEILING:
            hoard.append(bytearray(STEP))  # written: it counts in RSS
            em.emit(events.NewShape(t=t, pid=pid, name=FUNCTION, shape=[[1, 16 + i]],
                                    seconds=0.05, distinct=i + 1))
            for phase in ("warmup", "record"):
                em.emit(events.CudagraphRecord(t=t, pid=pid, phase=phase, compile_id="0/0",
                                               key=[i], shape=[[1, 16 + i]], seconds=0.01))
        if kind == "storm" and i % 5 == 0 and i // 5 < 8:
            n = i // 5 + 1
            em.emit(events.Recompile(t=t, pid=pid, compile_id=f"0/{n}", function=FUNCTION,
                                     seconds=0.8, reason=f"tensor 'x' size mismatch at index 1."
                                     f" expected {n}, actual {n + 1}"))
            if n == 8:
                em.emit(events.RecompileLimit(t=t, pid=pid, function=FUNCTION, limit=8,
                                              reason="size mismatch", compile_id="0/8"))
        if i % 10 == 0:
            em.emit(events.Heartbeat(t=t, pid=pid, seq=i, uptime_s=i / 10, queue_depth=0,
                                     errors=0))
        em.drain()
        i += 1
        time.sleep(0.1)


# -- the host --------------------------------------------------------------------------------
class HostScenario:
    """The sidecar and the three servers; `growing` is started again each time it exits."""

    def __init__(self, workdir: str, port: int, cooldown_s: float = 600.0):
        self.workdir, self.port = workdir, port
        self.sock = os.path.join(workdir, "ev.sock")
        self.config_path = os.path.join(workdir, "watchdog.yaml")
        self.env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get(
            "PYTHONPATH", ""))
        self.env.pop("NOTIFY_SOCKET", None)
        self.servers: dict[str, subprocess.Popen] = {}
        self.starts = {"growing": 0}
        self.sidecar: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(workdir, "sidecar.log")
        self._stop = threading.Event()
        os.makedirs(os.path.join(workdir, "state"), exist_ok=True)
        with open(self.config_path, "w") as fh:
            fh.write(config(workdir, port, self.sock, cooldown_s))

    def __enter__(self) -> "HostScenario":
        log = open(self.log_path, "w")
        self.sidecar = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                         "--config", self.config_path], cwd=ROOT, env=self.env,
                                        stderr=log, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock):
            if self.sidecar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not start: {open(self.log_path).read()}")
            time.sleep(0.05)
        for name in ("growing", "storm", "idle"):
            self.start(name)
        threading.Thread(target=self._supervise, daemon=True).start()
        return self

    def start(self, name: str) -> None:
        self.servers[name] = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.host_servers", "--serve", self.sock, name,
             name], cwd=ROOT, env=self.env)
        if name == "growing":
            self.starts["growing"] += 1

    def _supervise(self) -> None:
        """`growing` started again when it exits (the reload's SIGTERM), as systemd would."""
        while not self._stop.wait(0.2):
            proc = self.servers["growing"]
            if proc.poll() is not None:
                self.start("growing")

    def stop(self, name: str) -> None:
        proc = self.servers.pop(name)
        proc.terminate()
        proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for proc in self.servers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if self.sidecar is not None:
            self.sidecar.terminate()
            try:
                self.sidecar.wait(15)
            except subprocess.TimeoutExpired:
                self.sidecar.kill()
                self.sidecar.wait(10)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(*sys.argv[2:5])
    else:
        # Ctrl-C, or SIGTERM (a background job ignores SIGINT): everything it started stops
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with HostScenario(os.path.abspath(sys.argv[1]), int(sys.argv[2])) as host:
            print(f"http://127.0.0.1:{host.port}/  (Ctrl-C stops it)", flush=True)
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
