"""What a forked child resets first: the per-process state the agent's modules keep."""
from __future__ import annotations

from typing import Callable

# Run first in a forked child (by the package's at-fork hook, before the agent's own reset),
# each in a try: a module that keeps per-process state appends its reset here when imported.
# No locks, no I/O, no torch/CUDA calls, no emit.
_AFTER_FORK: list[Callable[[], None]] = []
