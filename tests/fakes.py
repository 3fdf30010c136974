"""Fakes the tests share (issue 53): what more than one test file built for itself.

Clock: monotonic time that moves only when the test moves it. Call it for the time (pass it
where the code under test takes a `clock=`), set `t`, or move it on with `advance()`; pass
`clock.sleep` where the code would sleep: it advances the clock and returns at once.

The fake NVML backend (FakeNvml) is tests/unit/test_nvml.py's, imported from there; the agent
socket receiver (Collector) is tests/conftest.py's `collector` fixture.
"""
from __future__ import annotations


class Clock:
    """Seconds on a clock the test moves: `clock()` is now; `clock.t` may be set."""

    def __init__(self, t: float = 1000.0):
        self.t = float(t)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        """Move on `seconds`; the new time."""
        self.t += seconds
        return self.t

    def sleep(self, seconds: float) -> None:
        """A sleep that takes no time: the clock moves on `seconds`."""
        self.advance(seconds)
