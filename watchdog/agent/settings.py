"""Runtime settings of watched callables: where events go, stall threshold, shape cap, routing."""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch_watchdog import events


def _discard(event: events.Event) -> None:
    return None


class Settings:
    """The one record of the runtime settings (`current`), read where each is used.

    emit: where events go. emit_later: the emitter's (install() sets it): new_shape events are
    queued as tuples of untracked values and built on the sender thread; None: built by the
    caller and given to `emit`. stall_ns: a call this long is a stall (stall_s: the same in
    seconds, the hot paths' clock). max_shapes: the cap on remembered shapes per callable.
    route_eager: graph budget in "eager" mode: novel shapes skip the compiler."""

    __slots__ = ("emit", "emit_later", "stall_ns", "stall_s", "max_shapes", "route_eager")

    def __init__(self) -> None:
        self.emit: Callable[[events.Event], None] = _discard
        self.emit_later: Optional[Callable[[tuple[Any, ...]], None]] = None
        self.stall_ns: int = INERT["stall_ns"]
        self.stall_s: float = self.stall_ns / 1e9
        self.max_shapes: int = INERT["max_shapes"]
        self.route_eager: Any = False


# The stall threshold's one default (agent/config.py's `stall_threshold_s`, the C path's copy
# through configure()): a call at least this slow is a stall.
STALL_S = 0.05
MAX_SHAPES = 65_536  # distinct shapes remembered per watched callable, by default

# What every watched callable is told with no agent installed; install() and the mitigations
# change the settings through configure(), their only writer.
INERT: dict[str, Any] = {"emit": _discard, "emit_later": None,
                         "stall_ns": round(STALL_S * 1e9), "max_shapes": MAX_SHAPES,
                         "route_eager": False}
current = Settings()

# Called with `current` after each change: the C hot path keeps its own copy of the stall
# threshold and the routing (calls.py registers it), since it compares against them on every
# call and reading a Python attribute there would cost more than the comparison.
COPIES: list[Callable[[Settings], None]] = []


def configure(**changes: Any) -> None:
    """Set emit / emit_later / stall_ns / max_shapes / route_eager (install() and the
    mitigations do); the others keep their values."""
    unknown = set(changes) - set(INERT)
    if unknown:
        raise TypeError(f"unknown runtime setting(s) {sorted(unknown)}")
    for name, value in changes.items():
        setattr(current, name, value)
    current.stall_s = current.stall_ns / 1e9
    for copy in COPIES:
        copy(current)


def reset() -> None:
    """Back to inert: watched callables keep working and send nowhere."""
    configure(**INERT)
