"""Runtime settings of watched callables: where events go, stall threshold, shape cap, routing."""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch_watchdog import events
from torch_watchdog.agent import calls, native, shapes


def _discard(event: events.Event) -> None:
    return None


# What every watched callable is told with no agent installed; install() and the mitigations
# change them through configure(), the only writer of the values below.
INERT = {"emit": _discard, "emit_later": None, "stall_ns": 50_000_000, "max_shapes": 65_536,
         "route_eager": False}
emit: Callable[[events.Event], None] = _discard
# The emitter's emit_later (install() sets it): new_shape events are queued as tuples of
# untracked values and built on the sender thread; None: built here and given to `emit`.
emit_later: Optional[Callable[[tuple], None]] = None
stall_ns: int = INERT["stall_ns"]
stall_s: float = stall_ns / 1e9  # the same in seconds, the hot paths' clock
max_shapes: int = INERT["max_shapes"]
route_eager: Any = False  # graph budget in "eager" mode: novel shapes skip the compiler


def configure(**settings: Any) -> None:
    """Set emit / emit_later / stall_ns / max_shapes / route_eager (install() and the
    mitigations do); the others keep their values. The modules that read a setting where each
    read counts get their own copy here: the hot paths (calls.py, _hotpath.c) the stall
    threshold and the routing, the shape memory its cap."""
    global emit, emit_later, stall_ns, stall_s, max_shapes, route_eager
    unknown = set(settings) - set(INERT)
    if unknown:
        raise TypeError(f"unknown runtime setting(s) {sorted(unknown)}")
    emit = settings.get("emit", emit)
    emit_later = settings.get("emit_later", emit_later)
    stall_ns = settings.get("stall_ns", stall_ns)
    max_shapes = settings.get("max_shapes", max_shapes)
    route_eager = settings.get("route_eager", route_eager)
    stall_s = stall_ns / 1e9
    calls.configure(stall_s, route_eager)
    shapes.configure(max_shapes)
    if native._hotpath is not None:
        native._hotpath.configure(stall_s, bool(route_eager))


def reset() -> None:
    """Back to inert: watched callables keep working and send nowhere."""
    configure(**INERT)


reset()  # the copies start from INERT too
