"""A preload for the launcher test's fault case only: it makes the standby believe a preload
initialised CUDA (a CPU machine cannot), which must make the launcher give up on standbys.
Only inside a launcher child (`python -m torch_watchdog.launcher --child`): imported anywhere
else (a test runner collecting this folder) it changes nothing."""
import sys

if "--child" in sys.argv:
    import torch

    torch.cuda.is_initialized = lambda: True
