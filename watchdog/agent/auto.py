"""`import torch_watchdog.agent.auto`: install the agent from TORCH_WATCHDOG_* variables, never
raising."""
from torch_watchdog.agent import install

try:
    install()
except ValueError:  # only explicit arguments raise; there are none here
    pass
