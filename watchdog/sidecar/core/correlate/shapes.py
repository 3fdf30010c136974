"""The distinct input shapes of a server's watched callables, unique across its processes
(workers seeing the same sizes count them once), bounded in memory."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_watchdog import events

MAX_SHAPE_KEYS = 200_000  # unique shapes remembered per server (a few MB), then counted


@dataclass
class Shapes:
    distinct: int = 0
    # name -> its shapes (at most MAX_SHAPE_KEYS in all, then only counted in `overflow`)
    keys: dict[str, set[Any]] = field(default_factory=dict)
    overflow: dict[str, int] = field(default_factory=dict)
    remembered: int = 0
    # name -> the most distinct shapes one process reported (its own count covers its
    # new_shape events the sidecar never got: dropped)
    reported: dict[str, int] = field(default_factory=dict)
    counted: dict[str, int] = field(default_factory=dict)  # name -> its part of `distinct`

    def on_new_shape(self, e: events.NewShape) -> None:
        name = e.name
        keys = self.keys.setdefault(name, set())
        key = shape_key(e.shape)
        if key not in keys:
            if self.remembered < MAX_SHAPE_KEYS:
                keys.add(key)
                self.remembered += 1
            else:
                self.overflow[name] = self.overflow.get(name, 0) + 1
        reported = self.reported[name] = max(self.reported.get(name, 0), e.distinct)
        counted = max(reported, len(keys) + self.overflow.get(name, 0))
        was = self.counted.get(name, 0)
        if counted != was:
            self.distinct += counted - was
            self.counted[name] = counted


def shape_key(shape: Any) -> Any:
    """A shape as a set member: a tuple of tuples (the agent sends lists), else its repr."""
    try:
        return tuple([tuple(dims) if isinstance(dims, list) else dims for dims in shape])
    except TypeError:
        return repr(shape)
