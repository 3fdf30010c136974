"""watch()'s hot paths leak nothing: every branch, 5,000 calls each under tracemalloc, on the C
and the Python path (a soak: 60,000 traced calls and their full collections take 7-15 s, the
longer in a process that holds more, as after the rest of the unit tests). The hot paths'
behaviour: tests/unit/test_timing.py."""
import gc
import sys
import tracemalloc

import pytest
import torch

from torch_watchdog.agent import settings
from torch_watchdog.agent.wrapper import watch

pytestmark = pytest.mark.usefixtures("hot_path")  # on the C and the Python path


def _allocated_after(calls: int, step) -> int:
    """Bytes still allocated (tracemalloc) after `calls` more calls of `step`, past a warm-up."""
    for i in range(200):
        step(i)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(calls):
            step(i)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_watched_calls_leak_nothing():
    """Every branch of the hot path, 5,000 calls each: a leaked reference per call (a shape, a
    float, an exception) would keep >= 5,000 x 8 bytes, a leaked object >= 5,000 x 32; what
    stays is 32-320 bytes (2-core VM, torch 2.13)."""
    out, x, m = object(), torch.ones(2, 3), torch.ones(2, 1)
    sizes = [torch.ones(n) for n in range(1, 9)]
    one = watch(lambda x: out, name="one")
    two = watch(lambda input_ids, attention_mask: out, name="two")
    several = watch(lambda a, b: out, name="several")

    def failing(x):
        raise ValueError("model failed")  # a new one each time (one raised again keeps its
        # tracebacks)

    bad = watch(failing, name="bad")

    def fail(i):
        try:
            bad(x)
        except ValueError:
            pass

    steps = [("one, same shape", lambda i: one(x)),
             ("one, eight shapes in turn", lambda i: one(sizes[i % 8])),
             ("two, same shapes", lambda i: two(input_ids=x, attention_mask=m)),
             ("two, eight shapes in turn", lambda i: two(input_ids=x, attention_mask=sizes[i % 8])),
             ("a failing call", fail),
             ("the Python path", lambda i: several(x, m))]
    refs = sys.getrefcount(out), sys.getrefcount(x), sys.getrefcount(m)
    try:
        for stall_ns in (10**12, 0):  # then every call a stall (its event goes nowhere)
            settings.configure(stall_ns=stall_ns)
            for name, step in steps:
                assert _allocated_after(5_000, step) < 16_000, (name, stall_ns)
    finally:
        settings.reset()
    assert (sys.getrefcount(out), sys.getrefcount(x), sys.getrefcount(m)) == refs
