"""torch-compile-watchdog: see torch.compile memory growth and recompiles coming, act before OOM."""

import os

__version__ = "0.1.0"


def pure_python() -> bool:
    """TORCH_WATCHDOG_PURE_PYTHON set (not empty, not "0"): the C paths (watch()'s hot path,
    the receiver's parser) are not used where they are built; read at their module's import."""
    return os.environ.get("TORCH_WATCHDOG_PURE_PYTHON", "") not in ("", "0")
