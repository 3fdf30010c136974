"""The watched calls in progress, on this thread or any other: for the hooks and the drain."""
from __future__ import annotations

import sys
import threading
from typing import Any

from torch_watchdog.agent import native
from torch_watchdog.agent.calls import CALL_CODE, NO_ARG
from torch_watchdog.agent.forks import _AFTER_FORK


def current_shape() -> Any:
    """The signature of the watched call in progress on this thread (the innermost one), else
    that of one in progress on another thread (best effort), else None. The C path keeps a
    per-thread stack of its calls' signatures (a call it hands to the Python path is marked
    there); the Python path's are read from the call's own frame (its `sig` local). Why: the
    readers are rare (hooks.py tags a cudagraph warm-up or recording, drain.py polls while
    draining), so they pay for the walk and the Python path writes nothing per call for them;
    a walk is also exact per thread, where a shared slot would be the last writer's."""
    try:
        hotpath = native._hotpath
        if hotpath is not None:
            where, shape = hotpath.current()
            if where == 1:  # the innermost call on this thread is the C path's
                return shape
        shape = _shape_in(sys._getframe(1))
        if shape is not NO_ARG:
            return shape
        me = threading.get_ident()
        for ident, frame in list(sys._current_frames().items()):
            if ident != me:
                shape = _shape_in(frame)
                if shape is not NO_ARG:
                    return shape
        if hotpath is not None:
            anywhere, here, shape = hotpath.everywhere()
            if anywhere > here:  # another thread's call on the C path: the last one begun
                return shape
    except Exception:
        pass
    return None


def calls_in_flight() -> bool:
    """Is a watched call in progress on any thread (drain.py's question)? Exact on the C path
    (a count), whatever the signature; else a frame of the Python path."""
    try:
        hotpath = native._hotpath
        if hotpath is not None and hotpath.everywhere()[0] > 0:
            return True
    except Exception:
        pass
    return current_shape() is not None


def _shape_in(frame: Any) -> Any:
    """The `sig` of the innermost watched call on this stack (None before it is read), or
    NO_ARG if there is none."""
    while frame is not None:
        if frame.f_code is CALL_CODE:
            names = frame.f_locals
            if "sig" in names:
                return names["sig"]
            if "sb" in names:  # two keyword arguments: the tuple is built only on a miss
                return names["sa"], names["sb"]
            return None
        frame = frame.f_back
    return NO_ARG


def _after_fork() -> None:
    """In a forked child: the other threads' calls in progress on the C path are not this
    process's (they would keep a drain waiting forever)."""
    if native._hotpath is not None:
        native._hotpath.after_fork()


_AFTER_FORK.append(_after_fork)
