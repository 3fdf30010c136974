"""A server written without knowing about `Draining`, for the drain-exit tests: the agent
installed, a queue-worker loop calling a watched torch model every 2 ms, and nothing caught.
What it does once a watched call raises `Draining` is its `how`:

- `uncaught`: nothing: the exception ends the main thread (and the interpreter);
- `thread`: the loop runs in a (non-daemon) worker thread, which the exception ends; the main
  thread, joined to it, then returns;
- `exit`: catches every exception the way a careless loop does and calls sys.exit(0);
- `return`: breaks out of its loop at the first error and returns from main.

Appends "<pid> <how>" to PROGRESS when it serves (its first call answered).

    python plain_worker.py SOCKET PROGRESS HOW
"""
import os
import sys
import threading
import time

import torch

import torch_watchdog.agent as agent


def serve(model, how: str) -> None:
    x = torch.randn(4, 16)
    while True:
        if how in ("exit", "return"):
            try:
                model(x)
            except Exception:
                if how == "exit":
                    sys.exit(0)
                return
        else:
            model(x)
        time.sleep(0.002)


def main(sock: str, progress: str, how: str) -> int:
    agent.install(socket_path=sock, server="plain-worker", reconnect_s=0.2, restart_file=None)
    model = agent.watch(torch.nn.Linear(16, 16), name="plain")
    with torch.no_grad():
        model(torch.randn(4, 16))
        with open(progress, "a") as fh:
            fh.write(f"{os.getpid()} {how}\n")
        if how == "thread":
            worker = threading.Thread(target=serve, args=(model, how))
            worker.start()
            worker.join()
        else:
            serve(model, how)
    return 0


if __name__ == "__main__":  # run by the tests; importing it (pytest given its path) does nothing
    sys.exit(main(*sys.argv[1:4]))
