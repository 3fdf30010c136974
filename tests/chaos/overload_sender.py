"""A sender of the overload test (test_intake_flood.py): the agent with 64 watched models,
each called with a new shape every call at full speed (64 x 1,000 new_shape events a second
within the agent's ration) for `seconds`, then quiet: its heartbeats go on. Writes what its
agent counted (`dropped` per reason, the lost drop reports, `sent`) to `out` once quiet, and
`sent` again to `out`.final once its agent stopped (its last heartbeats counted).
`abrupt`: no quiet time: the agent is uninstalled as soon as the calls stop (as a server that
exits), and `out` gets what it counted after that (`lost`, `sent`).

    python overload_sender.py SOCKET SECONDS OUT [abrupt]
"""
import json
import os
import sys
import time

import torch

import torch_watchdog.agent as agent


def write(out: str, counts: dict) -> None:
    with open(out + ".tmp", "w") as fh:
        json.dump(counts, fh)
    os.rename(out + ".tmp", out)


def main(sock: str, seconds: float, out: str, abrupt: bool = False) -> None:
    agent.install(socket_path=sock, server=f"flood-{os.getpid()}", heartbeat_s=0.5,
                  reconnect_s=0.2, control=False, restart_file=None)
    models = [agent.watch(lambda x: x, name=f"m{i}") for i in range(64)]
    xs = [torch.empty(n) for n in range(1, 20_001)]
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        x = xs[i % len(xs)]
        for m in models:
            m(x)
        i += 1
    if abrupt:  # drops right up to the exit, the last ones after the last periodic heartbeat
        em = agent.current().emitter
        agent.uninstall()
        write(out, {"lost": em.lost(), "sent": em.sent, "rounds": i})
        return
    time.sleep(2.0)  # the queue drained; the next heartbeats carry the totals
    em = agent.current().emitter
    with open(out + ".tmp", "w") as fh:
        json.dump({"dropped": em.dropped, "lost_reports": em._lost_reports, "sent": em.sent,
                   "rounds": i}, fh)
    os.rename(out + ".tmp", out)
    time.sleep(3.0)  # heartbeats carry those totals; then the agent stops, and says how many
    agent.uninstall()  # datagrams it sent in all (the heartbeats after `out` included)
    with open(out + ".tmp", "w") as fh:
        json.dump({"sent": em.sent}, fh)
    os.rename(out + ".tmp", out + ".final")


if __name__ == "__main__":  # run by the test; importing it (pytest given its path) does nothing
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:] == ["abrupt"])
