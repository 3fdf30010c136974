"""Record the judgment corpus on a GPU machine: every scenario of benchmarks/corpus/server.py at
once, each with its own real sidecar (dry run: it decides, does nothing, and the server runs on
into its OOM, which is the label) writing the sample log that `benchmarks/judgment.py` replays.

    python3 benchmarks/record_corpus.py --out DIR [--only NAME ...] [--seconds 240]
    python3 benchmarks/record_corpus.py --out DIR --real-oom 400 --only NAME ... [--suffix S]

`--real-oom FREE_MIB`: real device OOMs, no emulated GPU: the scenarios run one at a time, each
server's ballast leaving FREE_MIB of the device free once warm (server.py --ballast-free-mib),
and its sidecar is told no budget (it reads the device's own). `--suffix` names the runs
(`leak-medium-expandable` with `--alloc-conf expandable_segments:True`).

Per scenario, DIR/<name>/ gets samples.jsonl.gz (the fixture), progress.jsonl (the truth: the
budget, when growth began, the crash) and sidecar.log.gz. A first pass compiles each model once
into a shared Inductor cache, so that the scenarios start alike.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, "benchmarks", "corpus", "server.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "corpus"))

# sidecar -> the servers it watches (named when more than one); the rest watch one each
SHARED = {"shared-gpu": ["shared-grows", "shared-flat"],
          "two-tenants": ["tenant-llama", "tenant-bert"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


class Run:
    """One sidecar and its server(s)."""

    def __init__(self, name: str, servers: list[str], base: str, env: dict, seconds: float,
                 server_args: tuple = ()):
        self.name, self.servers, self.server_args = name, servers, server_args
        self.dir = os.path.join(base, name)
        os.makedirs(os.path.join(self.dir, "state"))
        self.sock = os.path.join(self.dir, "ev.sock")
        self.cfg = os.path.join(self.dir, "watchdog.yaml")
        self.port = free_port()
        self.budgets: dict[str, int] = {}   # server -> its emulated GPU's bytes, once taken
        self.real = False                    # the device's own budget: nothing to tell
        self.write_config()
        self.log = open(os.path.join(self.dir, "sidecar.log"), "w")
        self.sidecar = subprocess.Popen([sys.executable, "-m", "torch_watchdog.cli", "sidecar",
                                         "--config", self.cfg], cwd=ROOT, env=env,
                                        stderr=self.log)
        self.procs: dict[str, subprocess.Popen] = {}
        self.env, self.seconds = env, seconds
        self.ended_at: float | None = None

    def start_servers(self) -> None:
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        env, seconds, servers = self.env, self.seconds, self.servers
        for server in servers:
            extra = {"TORCH_WATCHDOG_SERVER": server} if len(servers) > 1 else {}
            self.procs[server] = subprocess.Popen(
                [sys.executable, SERVER, "--scenario", server, "--socket", self.sock,
                 "--progress", self.progress_path(server), "--event-log",
                 os.path.join(self.dir, f"events-{server}.jsonl"), "--seconds", str(seconds),
                 *self.server_args],
                cwd=ROOT, env={**env, **extra}, stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.dir, f"server-{server}.err"), "w"))

    def progress_path(self, server: str) -> str:
        return os.path.join(self.dir, f"progress-{server}.jsonl")

    def write_config(self) -> None:
        """One server: its budget as forecast.process_budget_bytes; several on one GPU (each
        its own emulated GPU): each its own (servers[].budget_bytes)."""
        budget = ""
        if len(self.servers) == 1 and self.budgets:
            budget = f"forecast: {{process_budget_bytes: {self.budgets[self.servers[0]]}}}\n"
        elif self.budgets:
            budget = "servers: [" + ", ".join(
                f"{{name: {n}, budget_bytes: {b}}}" for n, b in self.budgets.items()) + "]\n"
        with open(self.cfg + ".tmp", "w") as fh:
            fh.write(f"""metrics_port: {self.port}
state_dir: {self.dir}/state
sample_log: {self.dir}/samples.jsonl
agent: {{socket_path: {self.sock}, allowed_uids: [{os.getuid()}]}}
policy: {{dry_run: true}}
{budget}""")
        os.replace(self.cfg + ".tmp", self.cfg)

    def check(self) -> bool:
        """Hand a new budget to the sidecar; True once every server has exited a while ago."""
        for server in [s for s in self.servers if s not in self.budgets and not self.real]:
            got = next((p for p in progress(self.progress_path(server))
                        if p["kind"] == "budget"), None)
            if got is not None and got.get("real"):
                self.real = True
            elif got is not None:
                self.budgets[server] = got["bytes"]
                self.write_config()
                self.sidecar.send_signal(signal.SIGHUP)
        if self.ended_at is None and all(p.poll() is not None for p in self.procs.values()):
            self.ended_at = time.monotonic()
        return self.ended_at is not None and time.monotonic() - self.ended_at > 3.0

    def finish(self, out: str) -> dict:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.sidecar.send_signal(signal.SIGTERM)
        try:
            self.sidecar.wait(30)
        except subprocess.TimeoutExpired:
            self.sidecar.kill()
        self.log.close()
        dest = os.path.join(out, self.name)
        os.makedirs(dest, exist_ok=True)
        for f in ("samples.jsonl", "sidecar.log"):
            src = os.path.join(self.dir, f)
            if os.path.exists(src):
                with open(src, "rb") as s, gzip.open(os.path.join(dest, f + ".gz"), "wb") as d:
                    shutil.copyfileobj(s, d)
        summary = {}
        for server in self.servers:
            shutil.copy(self.progress_path(server), dest)
            err = os.path.join(self.dir, f"server-{server}.err")
            shutil.copy(err, dest)
            runs = progress(self.progress_path(server))
            summary[server] = {p["kind"]: p.get("t") for p in runs if p["kind"] != "served"}
            summary[server]["exit"] = self.procs[server].returncode
            summary[server]["error"] = next((p["error"] for p in runs if p["kind"] == "crash"),
                                            None)
        return summary


def prewarm(scenarios: list[str], base: str, env: dict) -> None:
    """One prewarm per model the runs use (its variable-size scenario where it has one),
    compiling into the shared Inductor cache, so that the runs start alike."""
    from server import SCENARIOS

    models = {SCENARIOS[s]["model"] for s in scenarios}
    chosen = tuple(
        next((s for s, sc in SCENARIOS.items() if sc["model"] == m and sc.get("traffic")),
             next(s for s, sc in SCENARIOS.items() if sc["model"] == m)) for m in sorted(models))
    warm = [subprocess.Popen([sys.executable, SERVER, "--scenario", s, "--prewarm", "--socket",
                              os.path.join(base, "none.sock"), "--progress",
                              os.path.join(base, f"prewarm-{s}.jsonl"), "--event-log",
                              os.path.join(base, f"prewarm-{s}.events")], cwd=ROOT, env=env)
            for s in chosen]
    for w in warm:
        w.wait()


def main() -> int:
    from server import SCENARIOS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*")
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--limit", type=float, default=480.0, help="stop everything after this")
    p.add_argument("--real-oom", type=int, metavar="FREE_MIB",
                   help="real device OOMs, one run at a time, a ballast leaving FREE_MIB free")
    p.add_argument("--suffix", default="", help="appended to each run's name")
    p.add_argument("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF for the servers")
    a = p.parse_args()
    base = tempfile.mkdtemp(prefix="tw-corpus-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(base, "inductor"),
               TORCHINDUCTOR_COMPILE_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if a.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf
    started = time.monotonic()
    grouped = {name: servers for name, servers in SHARED.items()}
    in_group = {s for servers in SHARED.values() for s in servers}
    grouped.update({s: [s] for s in SCENARIOS if s not in in_group})
    if a.only:
        grouped = {k: v for k, v in grouped.items() if k in a.only}
    if a.real_oom is None:
        prewarm([s for servers in grouped.values() for s in servers], base, env)
    print(f"prewarm {time.monotonic() - started:.0f} s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    if a.real_oom is not None:
        summary = {}
        for name, servers in grouped.items():
            run = Run(name + a.suffix, servers, base, env, a.seconds,
                      ("--ballast-free-mib", str(a.real_oom)))
            run.start_servers()
            deadline = time.monotonic() + a.limit
            while not run.check() and time.monotonic() < deadline:
                time.sleep(0.5)
            summary[run.name] = run.finish(a.out)
            print(run.name, json.dumps(summary[run.name]), flush=True)
        with open(os.path.join(a.out, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        print(f"total {time.monotonic() - started:.0f} s")
        return 0
    runs = [Run(name, servers, base, env, a.seconds) for name, servers in grouped.items()]
    for r in runs:
        r.start_servers()
    deadline = time.monotonic() + a.limit
    summary, pending = {}, list(runs)
    while pending and time.monotonic() < deadline:
        for r in [r for r in pending if r.check()]:
            summary[r.name] = r.finish(a.out)  # its sample log ends a few polls after the exit
            pending.remove(r)
        time.sleep(0.5)
    for r in pending:
        summary[r.name] = r.finish(a.out)
    with open(os.path.join(a.out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
