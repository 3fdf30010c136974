"""torch-compile-watchdog: see torch.compile memory growth and recompiles coming, act before OOM."""

__version__ = "0.1.0"
