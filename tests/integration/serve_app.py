"""A Ray Serve application for tests/integration/test_ray_serve.py: a local Ray cluster (2 CPUs,
a small object store, no dashboard) and 2 replicas of a `torch.compile`d model behind Serve's
HTTP proxy, each with the agent and the WatchdogReplica mixin (docs/deploy.md, "Ray Serve").

    python serve_app.py --port P --tmp DIR

GET /?n=N runs the model on N tokens and answers the replica's pid, its server name and its
Serve rank. The replica whose pid is in DIR/grow keeps 4 MB per distinct N (a leak of host
memory). Prints "ready" once both replicas answered; on SIGTERM, or its parent's death, shuts
Serve and Ray down.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import urllib.request

from ray import serve

from torch_watchdog.agent.serve import WatchdogReplica
from torch_watchdog.launcher import PR_SET_PDEATHSIG, _prctl

MB = 1 << 20


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0.5},
                  # a failed check every second, 3 in a row: unhealthy in ~3 s
                  health_check_period_s=1, health_check_timeout_s=10,
                  graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=10)
class Model(WatchdogReplica):
    def __init__(self, tmp: str):
        import torch

        import torch_watchdog.agent

        torch_watchdog.agent.install()  # TORCH_WATCHDOG_SOCKET, from the environment
        self.torch, self.grow_file = torch, os.path.join(tmp, "grow")
        model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)).eval()
        # inductor takes minutes to compile on a 2-core machine: Dynamo with the eager backend
        self.llm = torch_watchdog.agent.watch(torch.compile(model, backend="eager"), name="llm")
        with torch.inference_mode():  # warm up, the dynamic-shape recompile included
            for n in (5, 7):
                self.llm(self.tokens(n))
        self.kept: dict[int, bytearray] = {}

    def tokens(self, n: int):
        return self.torch.arange(n).remainder(64).unsqueeze(0)

    def __call__(self, request) -> dict:
        import torch_watchdog.agent

        n = max(1, min(int(request.query_params.get("n", "8")), 4096))
        with self.torch.inference_mode():
            self.llm(self.tokens(n))
        if n not in self.kept and self.grows():
            self.kept[n] = bytearray(os.urandom(16)) * (4 * MB // 16)  # 4 MB, touched
        ctx = serve.get_replica_context()
        return {"pid": os.getpid(), "server": torch_watchdog.agent.current().server,
                "rank": ctx.rank.rank, "deployment": ctx.deployment, "app": ctx.app_name}

    def grows(self) -> bool:
        try:
            with open(self.grow_file) as fh:
                return fh.read().strip() == str(os.getpid())
        except OSError:
            return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tmp", required=True)
    args = ap.parse_args()
    parent = os.getppid()
    import ray

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # the test killed (a CI timeout, Ctrl-C): SIGTERM here too, and Ray is shut down below
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        stop.set()
    # loopback only: Ray takes the interface address for its node otherwise (and turns a
    # 127.0.0.1 it is given into that address, unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
    # which the test sets: ray/_private/services.py, resolve_ip_for_localhost)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * MB,
             _temp_dir=os.path.join(args.tmp, "ray"), log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(Model.bind(args.tmp), name="llm", route_prefix="/")
        seen: set = set()
        deadline = time.monotonic() + 120
        while len(seen) < 2 and time.monotonic() < deadline and not stop.is_set():
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/?n=3", timeout=5) as r:
                seen.add(r.read())
        print("ready", flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
