"""A preload for the launcher test's fault case only: it makes the standby believe a preload
initialised CUDA (a CPU machine cannot), which must make the launcher give up on standbys."""
import torch

torch.cuda.is_initialized = lambda: True
