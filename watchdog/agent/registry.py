"""Every watched callable of this process, and the fresh start each gets in a forked child."""
from __future__ import annotations

import weakref

from torch_watchdog.agent.forks import _AFTER_FORK

watched: weakref.WeakSet = weakref.WeakSet()  # of wrapper.Watched; watch() adds each

# The shape memories a forked child inherited, kept and never touched. Why: a worker must
# report the shapes *it* meets (a master's warm-up shapes are not in the worker's CUDA graphs),
# so each wrapper starts a fresh memory after fork; freeing the master's would write to every
# remembered key (its refcount) inside os.fork(), copying those pages into each worker, while
# kept they stay shared with the master.
_inherited: list = []


def _after_fork() -> None:
    """In a forked child (run inside os.fork()): every watched callable starts with no shapes,
    no calls and a full new_shape ration, whether or not an agent is installed. Only the
    forking thread exists here: plain assignments, no locks."""
    failed = None
    for w in list(watched):
        try:
            _inherited.append(w._h)
            w._forget()
        except Exception as e:  # the others still start fresh; the hook counts the error
            failed = e
    if failed is not None:
        raise failed


_AFTER_FORK.append(_after_fork)
