"""A server process of the identity tests (test_server_identity.py): the agent, a compiled
model called a few times a second until SIGTERM. `rank` first joins a torch.distributed (gloo)
job from the environment torchrun gives it and checks an all_reduce across its ranks."""
import sys
import time

import torch_watchdog.agent.auto  # noqa: F401  (the one import a server needs)

import torch

import torch_watchdog.agent

if __name__ == "__main__":
    if sys.argv[1:] == ["rank"]:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        one = torch.ones(1)
        dist.all_reduce(one)
        assert one.item() == dist.get_world_size()
    model = torch_watchdog.agent.watch(torch.compile(torch.nn.Linear(8, 8), backend="eager"),
                                       name="model")
    with torch.no_grad():
        while True:
            for n in (1, 2, 4):
                model(torch.ones(n, 8))
            time.sleep(0.2)
