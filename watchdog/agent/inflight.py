"""The watched calls in progress, on this thread or any other: for the hooks and the drain.

Both hot paths keep them explicitly (calls.py): the C path a per-thread stack of its calls'
signatures, where a call it hands to the Python path is marked, and a process-wide count; the
Python path a per-thread stack of signatures. Readers are rare (hooks.py tags a cudagraph
warm-up or recording, drain.py polls while draining)."""
from __future__ import annotations

import threading
from typing import Any

from torch_watchdog.agent import calls
from torch_watchdog.agent.forks import _AFTER_FORK

_C_PATH = 1  # _hotpath.current(): this thread's innermost call runs on the C path


def current_shape() -> Any:
    """The signature of the watched call in progress on this thread (the innermost one), else
    that of one in progress on another thread (best effort), else None."""
    try:
        hotpath = calls._hotpath
        where, shape = hotpath.current() if hotpath is not None else (0, None)
        if where == _C_PATH:
            return shape
        # the innermost is on the Python path (2), or the C path has none on this thread
        stack = calls.stacks.get(threading.get_ident())
        if stack:
            return stack[-1]
        for stack in list(calls.stacks.values()):
            if stack:
                return stack[-1]
        if hotpath is not None:
            anywhere, here, shape = hotpath.everywhere()
            if anywhere > here:  # another thread's call on the C path: the last one begun
                return shape
    except Exception:
        pass
    return None


def calls_in_flight() -> bool:
    """Is a watched call in progress on any thread (drain.py's question)?"""
    try:
        hotpath = calls._hotpath
        if hotpath is not None and hotpath.everywhere()[0] > 0:
            return True
        return any(list(calls.stacks.values()))
    except Exception:
        return False


def _after_fork() -> None:
    """In a forked child only the forking thread exists: the other threads' calls in progress
    are not this process's (they would keep a drain waiting forever)."""
    me = threading.get_ident()
    for ident in [i for i in list(calls.stacks) if i != me]:
        del calls.stacks[ident]
    if calls._hotpath is not None:
        calls._hotpath.after_fork()


_AFTER_FORK.append(_after_fork)
