"""A server written without knowing about `Draining` (issue 37): the agent enabled by the
shipped drop-in's TORCH_WATCHDOG_* variables, a loop calling a watched torch model every 2 ms,
nothing caught. The first call refused by a drain ends its main thread."""
import time

import torch_watchdog.agent.auto  # noqa: F401  (install() from the environment)
import torch
from torch_watchdog import agent

model = agent.watch(torch.nn.Linear(16, 16), name="plain")
x = torch.randn(4, 16)
with torch.no_grad():
    while True:
        model(x)
        time.sleep(0.002)
